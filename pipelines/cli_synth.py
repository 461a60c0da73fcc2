"""`steward synth ...` and `steward plan ...` (owned by the trace-synthesis work)."""

from __future__ import annotations

import typer

synth_app = typer.Typer(no_args_is_help=True)
plan_app = typer.Typer(no_args_is_help=True)
