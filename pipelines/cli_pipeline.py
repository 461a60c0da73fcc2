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
        tasks: int = typer.Option(24, help="synthesized research tasks (one correct trace each)"),
        seed: int = typer.Option(0),
        page_words: int = typer.Option(160, help="words per opened page (shorter → shorter traces)"),
        doc_words: int = typer.Option(240), max_hops: int = typer.Option(6),
        every: int = typer.Option(4, help="aux examples / aux thread every K tool responses"),
        plan: bool = typer.Option(True, help="also train on `Planning mode` rows"),
        trigger: str = typer.Option("ids", help="deletion trigger layout: ids | notes (`steward synth hindsight "
                                    "--trigger`)"),
        train_steps: int = typer.Option(30), max_len: int = typer.Option(1024), rank: int = typer.Option(8),
        lr: float = typer.Option(3e-4), batch_size: int = typer.Option(2),
        top_layers: int = typer.Option(0, help="LoRA only in the top N layers; 0 = all"),
        adapter_scope: str = typer.Option("all", help="all | aux: see `steward train lora --adapter-scope`"),
        train_minutes: float = typer.Option(0.0, help="training wall-clock budget in minutes; 0 = none"),
        manager_traces: int = typer.Option(3),
        bench_length: int = typer.Option(4096), bench_distances: str = typer.Option("512,3000"),
        bench_sessions: int = typer.Option(1), bench_arms: str = typer.Option("h2o,pace"),
        budget: int = typer.Option(512), chunk: int = typer.Option(256), limit: int = typer.Option(1024),
        only: str = typer.Option("", help="comma-separated stages to run (their upstream must be cached)"),
        mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Run every stage (or resume: finished stages with the same inputs are skipped)."""
    from kvsteward.pipelines.pipeline import PipelineConfig, run_pipeline

    cfg = PipelineConfig(model=model, tasks=tasks, seed=seed, page_words=page_words, doc_words=doc_words,
                         max_hops=max_hops, every=every, plan=plan, train_steps=train_steps, max_len=max_len,
                         rank=rank, lr=lr, batch_size=batch_size, top_layers=top_layers, train_minutes=train_minutes,
                         adapter_scope=adapter_scope, trigger=trigger,
                         manager_traces=manager_traces, bench_length=bench_length,
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
            console.print(f"[bold]{name}[/bold] ({took}) → {rec['dir']}")
        _print_findings(summary)


def _print_findings(summary: dict) -> None:
    """The two results a user runs the pipeline for: what the manager learned, and retention vs retrievability."""
    from rich.table import Table

    from kvsteward.train.tracking import default_tracking_uri

    run_id = summary.get("train", {}).get("result", {}).get("mlflow_run_id") or "-"
    console.print(f"MLflow training run {run_id}; browse: mlflow ui --backend-store-uri {default_tracking_uri()}")
    man = summary.get("manager", {}).get("result")
    if man:
        # Short headers: the JSON names do not fit an 80-column log (rich cut them to "precisi…", "harmfu…").
        cols = {"f1": "F1", "precision": "prec", "recall": "recall", "harmful_rate": "harmful",
                "parse_fail_rate": "parse fail", "peak_tokens_reduction": "peak ↓", "kv_reads_reduction": "reads ↓"}
        t = Table(title="memory manager on held-out traces (vs hindsight labels)",
                  caption="harmful: share of deletions a later step reads; peak ↓ / reads ↓: peak resident tokens / "
                          "KV reads saved against the replay without deletions")
        t.add_column("manager")
        for header in cols.values():
            t.add_column(header)
        for arm in ("base", "adapter"):
            if arm in man:
                t.add_row(arm, *(f"{man[arm].get(c, float('nan')):.2f}" for c in cols))
        console.print(t)
    ls = summary.get("longsession", {}).get("result")
    if ls:
        dists = sorted({d for a in ls["arms"].values() for d in a["by_distance"]}, key=int)
        t = Table(title="long session: forced-prefix accuracy (residency, rotary gap) by definition distance")
        t.add_column("arm")
        for d in dists:
            t.add_column(f"D={d}")
        for arm, rec in ls["arms"].items():
            cells = []
            for d in dists:
                c = rec["by_distance"].get(d)
                cells.append("-" if c is None else
                             f"{c['forced_acc']:.2f} (res {c['residency']:.2f}, gap {c['rotary_gap']:.0f})")
            t.add_row(arm, *cells)
        console.print(t)
