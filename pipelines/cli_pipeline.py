"""`steward pipeline run`: synth → hindsight → train → manager eval → long-session benchmark, cached and resumable."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def run(model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
        root: Path = typer.Option(Path("runs/pipeline"), help="stage folders live here (named by input hash)"),
        tasks: int = typer.Option(24), seed: int = typer.Option(0), every: int = typer.Option(4),
        train_steps: int = typer.Option(30), max_len: int = typer.Option(1024), rank: int = typer.Option(8),
        lr: float = typer.Option(3e-4), manager_traces: int = typer.Option(3),
        bench_length: int = typer.Option(4096), bench_distances: str = typer.Option("512,3000"),
        bench_sessions: int = typer.Option(1), bench_arms: str = typer.Option("h2o,pace"),
        budget: int = typer.Option(512), chunk: int = typer.Option(256), limit: int = typer.Option(1024),
        only: str = typer.Option("", help="comma-separated stages to run (their upstream must be cached)"),
        mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Run every stage (or resume: finished stages with the same inputs are skipped)."""
    from kvsteward.pipelines.pipeline import PipelineConfig, run_pipeline

    cfg = PipelineConfig(model=model, tasks=tasks, seed=seed, every=every, train_steps=train_steps, max_len=max_len,
                         rank=rank, lr=lr, manager_traces=manager_traces, bench_length=bench_length,
                         bench_distances=bench_distances, bench_sessions=bench_sessions, bench_arms=bench_arms,
                         budget=budget, chunk=chunk, limit=limit)
    try:
        summary = run_pipeline(cfg, root, log=console.log, only=set(only.split(",")) - {""} or None,
                               mlflow_log=mlflow_log)
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    if as_json:
        print(json.dumps(summary))
    else:
        for name, rec in summary.items():
            took = "cached" if rec["cached"] else f"{rec['wall_s']:.0f}s"
            console.print(f"[bold]{name}[/bold] ({took}): {json.dumps(rec['result'])[:300]}")
