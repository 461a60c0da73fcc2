"""`steward engine ...` and `steward bench ...`."""

from __future__ import annotations

import typer

engine_app = typer.Typer(no_args_is_help=True)
bench_app = typer.Typer(no_args_is_help=True)
