"""`steward pipeline run`: synth → hindsight → train → manager eval → long-session benchmark, cached and resumable."""

from __future__ import annotations

import json
import threading
import time
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
        biases: str = typer.Option("0,1"),
        confidences: str = typer.Option("auto", help="calibration thresholds (auto: 0.8,0.9 for a list adapter, "
                                                     "0.1,...,0.5 for --trigger scores; empty: none)"),
        max_harm: float = typer.Option(0.02, help="calibration target: harmful deletions / deletions"),
        manager_traces: int = typer.Option(10, help="traces per test set (in-distribution, held-out, imported)"),
        attention_fit: int = typer.Option(6, help="validation traces that choose the attention-mass threshold"),
        workers: int = typer.Option(1, help="processes per evaluation stage"),
        bench_length: int = typer.Option(4096), bench_distances: str = typer.Option("512,3000"),
        bench_sessions: int = typer.Option(1), bench_arms: str = typer.Option("h2o,pace"),
        budget: int = typer.Option(512), chunk: int = typer.Option(256), limit: int = typer.Option(1024),
        engine_tokens: int = typer.Option(2048, help="the engine self-check's budget run length (0: no engine "
                                          "stage)"),
        residency_arms: str = typer.Option("full,h2o,pace", help="arms whose resident KV is traced along the long "
                                           "session: those of --bench-arms come from its plays, others (or another "
                                           "--residency-length) from a separate residency stage; empty: none"),
        residency_length: int = typer.Option(0, help="length of the session the residency trace follows (0: "
                                             "--bench-length)"),
        serve_check: bool = typer.Option(True, "--serve-check/--no-serve-check",
                                         help="one OpenAI-client round trip through `steward serve`"),
        manager_arms: str = typer.Option("", help="`steward eval manager --arms` (empty: its default set)"),
        stack_fit: int = typer.Option(20, help="with --trigger scores: train traces whose scored decisions fit the "
                                               "stack (structure + the adapter's P(no)); it competes in choose and "
                                               "plays in every manager stage (0: no stack)"),
        report: bool = typer.Option(True, "--report/--no-report", help="write ROOT/report.html at the end"),
        only: str = typer.Option("", help="comma-separated stages to run (their upstream must be cached)"),
        mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Run every stage (or resume: finished stages with the same inputs are skipped): traces → hindsight (+ audit)
    → train → calibrate → choose (the served manager, on validation) → the manager against the baselines on the
    in-distribution test split, the held-out environment and an imported trace file → the long-session benchmark."""
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
                         budget=budget, chunk=chunk, limit=limit, engine_tokens=engine_tokens,
                         residency_arms=residency_arms, residency_length=residency_length, serve_check=serve_check,
                         manager_arms=manager_arms, stack_fit=stack_fit)
    t0 = time.perf_counter()
    try:
        cfg.check()
        with RichStageProgress(console) as bars:
            summary = run_pipeline(cfg, root, log=console.log, only=set(only.split(",")) - {""} or None,
                                   mlflow_log=mlflow_log, progress=bars)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    built = None
    if report:
        from kvsteward.pipelines.report import build_report

        t1 = time.perf_counter()
        built = build_report(root, mlflow_log=mlflow_log)
        built["wall_s"] = time.perf_counter() - t1
    if as_json:
        print(json.dumps(summary))
    else:
        _print_findings(summary)
        _print_summary(summary, root, built, time.perf_counter() - t0)


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
    chosen = summary.get("choose", {}).get("result")
    if chosen:
        console.print(f"served manager (chosen on validation): [bold]{chosen['choice']}[/bold] — {chosen['reason']}; "
                      f"steward serve --manager {chosen['manager_dir']}")
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


class RichStageProgress:
    """One bar per stage: how far it is against its estimate (the cost model, scaled by this folder's last run of
    the stage: `timings.json`), elapsed / estimated time, time left, and the stage's last log line."""

    def __init__(self, con: Console):
        from rich.progress import BarColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("[bold]{task.fields[step]} {task.description:<16}"),
                                 BarColumn(bar_width=24), TextColumn("{task.fields[clock]}"),
                                 TextColumn("[dim]{task.fields[info]}"),
                                 console=con, refresh_per_second=2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self._halt()
        self.progress.stop()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def start(self, name: str, index: int, total: int, estimate_s: float, log_path: Path | None) -> None:
        from kvsteward.pipelines.pipeline import _mmss

        task = self.progress.add_task(name, total=100, step=f"[{index + 1}/{total}]",
                                      clock=f"0s / ~{_mmss(estimate_s)}", info="starting")
        self._stop = threading.Event()
        t0 = time.monotonic()

        def tick() -> None:
            while not self._stop.wait(0.5):
                el = time.monotonic() - t0
                left = estimate_s - el
                clock = (f"{_mmss(el)} / ~{_mmss(estimate_s)}, ~{_mmss(left)} left" if left > 0 else
                         f"{_mmss(el)} / ~{_mmss(estimate_s)}, over the estimate")
                self.progress.update(task, completed=min(99.0, 100 * el / max(estimate_s, 1e-6)), clock=clock,
                                     info=last_line(log_path))

        self._task = task
        self._thread = threading.Thread(target=tick, daemon=True)
        self._thread.start()

    def finish(self, name: str, wall_s: float, ok: bool) -> None:
        from kvsteward.pipelines.pipeline import _mmss

        self._halt()
        self.progress.update(self._task, completed=100 if ok else self.progress.tasks[-1].completed,
                             clock=f"{_mmss(wall_s)}", info="done" if ok else "[red]FAILED")


def last_line(path: Path | None, width: int = 48) -> str:
    """The last non-empty line a stage wrote to its log (tqdm's carriage returns and terminal escapes resolved)."""
    if path is None or not path.is_file():
        return ""
    from kvsteward.pipelines.pipeline import _clean

    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        tail = f.read().decode(errors="replace")
    pieces = [p.strip() for line in _clean_all(tail, _clean) for p in [line] if p.strip()]
    text = pieces[-1] if pieces else ""
    if text.startswith("[") and "]" in text[:12]:  # rich's log time column
        text = text.split("]", 1)[1].strip()
    return text if len(text) <= width else text[: width - 1] + "…"


def _clean_all(tail: str, clean) -> list[str]:
    lines = []
    for raw in tail.replace("\r\n", "\n").split("\n"):
        parts = [p for p in raw.split("\r") if p.strip()]
        if parts:
            lines.append(clean(parts[-1]))
    return lines


# where to look, per stage (relative to its folder; "" = the folder itself)
OUTPUTS = {"engine": ["stage.json"], "longsession": ["report.md", "results.json", "acc_vs_distance.png"],
           "residency": ["residency.json"], "traces": [""], "hindsight": ["ds/card.json"], "train": ["adapter"],
           "calibrate": ["traces.jsonl"], "choose": ["manager/manager.json"], "manager": ["stage.json"],
           "heldout": ["stage.json"], "fresh_traces": [""], "exported": ["sessions.jsonl"], "imported": [""],
           "manager_imported": ["stage.json"], "serve": ["serve.json", "server.log"]}


def stage_outputs(name: str, rec: dict) -> list[str]:
    d = Path(rec["dir"])
    if name == "train" and (rec.get("result") or {}).get("adapter_dir"):
        return [rec["result"]["adapter_dir"]]
    found = [str(d / o) if o else str(d) + "/" for o in OUTPUTS.get(name, [""]) if (d / o).exists()]
    return found or [str(d) + "/"]


def _print_summary(summary: dict, root: Path, built: dict | None, total_s: float) -> None:
    """The end of a run: each stage's wall time and outputs, the report, the MLflow runs and how to browse them."""
    from rich.table import Table

    from kvsteward.pipelines.pipeline import _mmss
    from kvsteward.train.tracking import default_tracking_uri

    t = Table(title=f"kvsteward pipeline: {root} ({_mmss(total_s)} this run)", show_lines=False)
    for col in ("stage", "wall", "outputs"):
        t.add_column(col, overflow="fold")
    for name, rec in summary.items():
        wall = f"cached ({_mmss(rec.get('wall_s', 0))} when run)" if rec["cached"] else _mmss(rec.get("wall_s", 0))
        t.add_row(name, wall, "\n".join(stage_outputs(name, rec)))
    if built:
        t.add_row("report", _mmss(built.get("wall_s", 0)), "\n".join([str(built["html"]),
                                                                    *map(str, built["figures"].values())]))
    console.print(t)
    _print_reference()
    if built:
        console.print(f"[bold]report:[/bold] {Path(built['html']).resolve()}  (open it in a browser; the PNGs sit "
                      "beside it)")
    index = json.loads((root / "pipeline.json").read_text()) if (root / "pipeline.json").is_file() else {}
    uri = default_tracking_uri()
    parent = index.get("mlflow_run_id")
    train_run = summary.get("train", {}).get("result", {}).get("mlflow_run_id")
    if parent or train_run:
        console.print(f"[bold]MLflow:[/bold] pipeline run {parent or '-'} (stages nested under it; the report under "
                      f"its artifacts/report/), adapter training run {train_run or '-'}; store {uri}")
        console.print(f"  browse: {Path('.venv/bin/mlflow') if Path('.venv/bin/mlflow').exists() else 'mlflow'} ui "
                      f"--backend-store-uri {uri} --port 5000   then open http://127.0.0.1:5000 "
                      "(experiment kvsteward)")


def _print_reference() -> None:
    """The shipped 8K long-session result, said to be shipped: what the demo's short live session cannot show."""
    from rich.table import Table

    from kvsteward.pipelines import reference

    if not reference.ARTIFACT.is_file():
        return
    ref = reference.load()
    dists = sorted({d for a in ref["arms"].values() for d in a["by_distance"]}, key=int)
    t = Table(title="long session at 8K, 30 probes per cell: SHIPPED reference, not run by this demo",
              caption=f"{reference.ARTIFACT.relative_to(reference.HERE.parent)}; reproduce ({ref['wall']}): "
                      f"{ref['command']}")
    t.add_column("arm")
    for d in dists:
        t.add_column(f"D={d}")
    for arm, rec in ref["arms"].items():
        t.add_row(arm, *(f"{rec['by_distance'][d]['forced_acc']:.2f}" if d in rec["by_distance"] else "-"
                         for d in dists))
    console.print(t)


@app.command()
def residency(model: str = typer.Option("smollm2"), arms: str = typer.Option("full,h2o,pace"),
              length: int = typer.Option(4096, help="session length (tokens of context)"),
              distance: int = typer.Option(3000, help="definition → probe distance of the session"),
              budget: int = typer.Option(512), chunk: int = typer.Option(256), limit: int = typer.Option(1024),
              seed: int = typer.Option(7), out: Path = typer.Option(..., help="JSON file to write")) -> None:
    """Resident KV along one long session, per arm: after every context message, the tokens appended so far, the
    resident slots and the resident KV bytes (the same session `steward eval longsession` generates)."""
    from kvsteward.eval.longsession.runner import RunConfig, _open_session
    from kvsteward.serve.engine import Engine
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.longsession.generate import generate_sessions

    arm_list = [a for a in arms.split(",") if a]
    with console.status(f"loading {model} ..."):
        engine = Engine.load(model)
    (sess,) = generate_sessions(engine.tokenizer, 1, length, [distance], seed)
    cfg = RunConfig(arms=tuple(arm_list), budget=budget, chunk=chunk, limit=limit, code=False)
    messages = [m.model_dump() for m in sess.messages]
    ids = message_token_ids(engine.tokenizer, messages)
    series, peaks = {}, {}
    for arm in arm_list:
        t0 = time.perf_counter()
        s = _open_session(engine, arm, cfg, sess)
        pts = []
        for i, toks in enumerate(ids):
            s.append(toks, kind=messages[i]["role"], logits=None)
            pts.append({"tokens": s.n_logical, "resident": s.resident, "kv_bytes": s.table.kv_bytes()})
        series[arm], peaks[arm] = pts, s.peak_resident
        console.log(f"{arm}: {s.n_logical} tokens, peak resident {s.peak_resident} slots, "
                    f"{pts[-1]['kv_bytes'] / 2**20:.1f} MiB resident ({time.perf_counter() - t0:.0f}s)")
    result = {"session": sess.id, "length": length, "distance": distance, "budget": budget, "chunk": chunk,
              "limit": limit, "series": series,
              "peak_resident": peaks}  # the engine's peak: inside a chunk, before its eviction (B + H)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    print(json.dumps(result))


@app.command("serve-check")
def serve_check(model: str = typer.Option("smollm2"), out: Path = typer.Option(..., help="output folder"),
                max_tokens: int = typer.Option(24)) -> None:
    """One round trip through `steward serve` with the OpenAI client: a turn, a drop + reposition, the reply."""
    from kvsteward.pipelines.roundtrip import round_trip

    try:
        record = round_trip(model, out, max_tokens=max_tokens, log=console.log)
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    print(json.dumps(record))


def report_command(run_dir: Path = typer.Argument(..., help="a `steward pipeline run` root (e.g. runs/demo)"),
                   mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow",
                                                   help="log the page and PNGs to the run's MLflow run")) -> None:
    """RUN_DIR/report.html and its PNGs: long-session accuracy vs distance, resident KV vs session length, the
    manager arms (F1, harmful rate, intervals), the serving round trip; logged to the pipeline's MLflow run."""
    from kvsteward.pipelines.report import build_report

    try:
        built = build_report(run_dir, mlflow_log=mlflow_log)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    for p in [built["html"], *built["figures"].values()]:
        console.print(str(p))
    if built["mlflow_run_id"]:
        console.print(f"logged to MLflow run {built['mlflow_run_id']} (artifacts/report/)")


@app.command("engine-check")
def engine_check(model: str = typer.Option("smollm2"), budget: int = typer.Option(512),
                 chunk: int = typer.Option(256), budget_tokens: int = typer.Option(2048),
                 ops_tokens: int = typer.Option(96, help="tokens of the drop / reposition / refresh comparison"),
                 renumbers: int = typer.Option(100, help="successive renumbers of the drift check"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """The engine's exactness self-check at demo sizes (the same checks as `steward engine check`, smaller: fewer
    tokens against the reference replay, 100 renumbers instead of 500)."""
    from kvsteward.kernels.check import bf16_rerotation_error, renumber_drift, rerotation_errors
    from kvsteward.serve.bench import checks
    from kvsteward.serve.engine import Engine

    with console.status(f"loading {model} ..."):
        eng = Engine.load(model)
    t0 = time.perf_counter()
    prompt = eng.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    result = {"model": model, "generate_equivalence": checks.generate_equivalence(eng, prompt, new_tokens=16)}
    console.log(f"greedy decode == transformers generate(): {result['generate_equivalence']}")
    result["rerotation_max_abs_err"] = rerotation_errors(eng.model.config, n=128)
    result["rerotation_bf16_max_ulp"] = bf16_rerotation_error(eng.model.config, n=128)
    drift = renumber_drift(eng.model.config, steps=renumbers, n=64)
    result.update({"renumber_steps": renumbers, "renumber_max_abs_err": drift["reference_max_abs_err"],
                   "renumber_chained_max_abs_err": drift["chained_max_abs_err"],
                   "renumber_single_max_abs_err": drift["single_renumber_max_abs_err"]})
    console.log(f"re-rotation vs float64: {result['rerotation_max_abs_err']}; {renumbers} renumbers: "
                f"{drift['reference_max_abs_err']:.2e} from the fp32 reference, {drift['chained_max_abs_err']:.2e} "
                "chained")
    result["op_max_abs_logit_err"] = checks.op_logit_errors(eng, n=ops_tokens)
    console.log(f"drop / reposition / refresh vs the reference replay: {result['op_max_abs_logit_err']}")
    result.update(checks.budget_run(eng, budget_tokens, budget, chunk, progress=console.log))
    result["wall_s"] = time.perf_counter() - t0
    print(json.dumps(result)) if as_json else console.print_json(json.dumps(result))
