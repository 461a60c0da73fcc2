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
        envs: str = typer.Option("research,ops,support", help="environments to synthesize (`steward synth traces "
                                 "--env`)"),
        holdout_env: str = typer.Option("", help="train on the other environments and evaluate on this one as a "
                                        "held-out test set (leave-one-environment-out)"),
        tasks: int = typer.Option(60, help="synthesized tasks per environment (one correct trace each)"),
        seed: int = typer.Option(0),
        env_options: str = typer.Option("", help="comma-separated KEY=VALUE environment options (`steward synth "
                                        "traces -o`, see docs/synth.md)"),
        every: int = typer.Option(2, help="aux examples / aux thread every K tool responses"),
        mask_prob: float = typer.Option(0.5, help="hindsight pre-masking rate (expired cursors already deleted)"),
        plan: bool = typer.Option(False, help="also train on `Planning mode` rows"),
        pack: bool = typer.Option(False, help="packed rows: one per trace, every boundary a branch"),
        trigger: str = typer.Option("ids", help="deletion trigger layout: ids | notes (`steward synth hindsight "
                                    "--trigger`)"),
        train_steps: int = typer.Option(200), max_len: int = typer.Option(2048), rank: int = typer.Option(16),
        alpha: int = typer.Option(32), lr: float = typer.Option(1e-3), batch_size: int = typer.Option(2),
        top_layers: int = typer.Option(0, help="LoRA only in the top N layers; 0 = all"),
        lora_dropout: float = typer.Option(0.0),
        adapter_scope: str = typer.Option("aux", help="aux (trained as served) | all: see `steward train lora`"),
        aux_context: str = typer.Option("full", help="full (the aux thread reads the session) | first (ablation)"),
        skip_trivial: bool = typer.Option(True, help="leave out deletion rows whose open cursors are all unread"),
        train_seed: int = typer.Option(0),
        train_minutes: float = typer.Option(0.0, help="training wall-clock budget in minutes; 0 = none"),
        calibrate_traces: int = typer.Option(10, help="validation traces the aux decode rule is chosen on (0: no "
                                             "calibration stage)"),
        biases: str = typer.Option("0,1"), confidences: str = typer.Option("0.8,0.9"),
        max_harm: float = typer.Option(0.02, help="calibration target: harmful deletions / deletions"),
        manager_traces: int = typer.Option(10, help="traces per test set (in-distribution, held-out, imported)"),
        attention_fit: int = typer.Option(6, help="validation traces that choose the attention-mass threshold"),
        workers: int = typer.Option(1, help="processes per evaluation stage"),
        bench_length: int = typer.Option(4096), bench_distances: str = typer.Option("512,3000"),
        bench_sessions: int = typer.Option(1), bench_arms: str = typer.Option("h2o,pace"),
        budget: int = typer.Option(512), chunk: int = typer.Option(256), limit: int = typer.Option(1024),
        only: str = typer.Option("", help="comma-separated stages to run (their upstream must be cached)"),
        mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Run every stage (or resume: finished stages with the same inputs are skipped): traces → hindsight (+ audit)
    → train → calibrate → the manager against the baselines on the in-distribution test split, the held-out
    environment and an imported trace file → the long-session benchmark."""
    from kvsteward.pipelines.pipeline import PipelineConfig, run_pipeline

    cfg = PipelineConfig(model=model, envs=envs, holdout_env=holdout_env, tasks=tasks, seed=seed,
                         env_options=env_options, every=every,
                         mask_prob=mask_prob, plan=plan, pack=pack, trigger=trigger, train_steps=train_steps,
                         max_len=max_len, rank=rank, alpha=alpha, lr=lr, batch_size=batch_size,
                         top_layers=top_layers, lora_dropout=lora_dropout, adapter_scope=adapter_scope,
                         aux_context=aux_context, skip_trivial=skip_trivial, train_seed=train_seed,
                         train_minutes=train_minutes, calibrate_traces=calibrate_traces, biases=biases,
                         confidences=confidences, max_harm=max_harm, manager_traces=manager_traces,
                         attention_fit=attention_fit, workers=workers, bench_length=bench_length,
                         bench_distances=bench_distances, bench_sessions=bench_sessions, bench_arms=bench_arms,
                         budget=budget, chunk=chunk, limit=limit)
    try:
        cfg.check()
        summary = run_pipeline(cfg, root, log=console.log, only=set(only.split(",")) - {""} or None,
                               mlflow_log=mlflow_log)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    if as_json:
        print(json.dumps(summary))
    else:
        for name, rec in summary.items():
            took = "cached" if rec["cached"] else f"{rec['wall_s']:.0f}s"
            console.print(f"[bold]{name}[/bold] ({took}) → {rec['dir']}")
        _print_findings(summary)


# arm names as the tables print them (an 80-column log: `make demo`)
SHORT = {"delete_all_read": "all read", "keep_last_k": "last K", "text_classifier": "BoW LR",
         "lexical_overlap": "overlap", "structure": "structure", "attention_mass": "attention"}
TEST_SETS = {"manager": "in-distribution test split", "heldout": "held-out environment",
             "manager_imported": "imported trace file"}


def _print_findings(summary: dict) -> None:
    """The two results a user runs the pipeline for: what the manager learned, and retention vs retrievability."""
    from rich.table import Table

    from kvsteward.train.tracking import default_tracking_uri

    run_id = summary.get("train", {}).get("result", {}).get("mlflow_run_id") or "-"
    console.print(f"MLflow training run {run_id}; browse: mlflow ui --backend-store-uri {default_tracking_uri()}")
    audit = summary.get("hindsight", {}).get("result", {}).get("audit")
    if audit:
        flags = audit.get("flags") or []
        best = max(audit["baselines"].items(), key=lambda kv: kv[1].get("f1") or 0)
        console.print(f"shortcut audit (validation): best cheap baseline {best[0]} F1 {best[1].get('f1') or 0:.2f}"
                      + (f"; FLAGGED: {', '.join(str(f) for f in flags)}" if flags else "; nothing flagged"))
    # Short headers: the JSON names do not fit an 80-column log (rich cut them to "precisi…", "harmfu…").
    cols = {"f1": "F1", "precision": "prec", "recall": "recall", "harmful_rate": "harmful",
            "parse_fail_rate": "parse fail", "peak_tokens_reduction": "peak ↓", "kv_reads_reduction": "reads ↓"}
    for stage, title in TEST_SETS.items():
        man = summary.get(stage, {}).get("result")
        if not man:
            continue
        t = Table(title=f"memory managers, {title} ({man.get('n_traces', '?')} traces, same decisions)",
                  caption="harmful: share of deletions a later step reads; peak ↓ / reads ↓: peak resident tokens / "
                          "KV reads saved against the replay without deletions")
        t.add_column("manager")
        for header in cols.values():
            t.add_column(header)
        for arm in man.get("arms") or [a for a in ("base", "adapter") if a in man]:
            row = man[arm]
            t.add_row(SHORT.get(arm, arm), *("-" if row.get(c) is None or row.get(c) != row.get(c) else f"{row[c]:.2f}"
                             for c in cols))
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
