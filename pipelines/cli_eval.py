"""`steward eval ...`: the long-session benchmark (and, later, the learned-manager metrics)."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from e


def _progress(transient: bool = False):
    """A rich progress display on stderr: description, bar, done / total, elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=transient)


@contextmanager
def _pair_bar(pairs: int):
    """Two bars on stderr: (session, arm) pairs of the sweep, and the context messages of the pair being played."""
    with _progress() as prog:
        overall = prog.add_task("pairs", total=pairs)
        current = prog.add_task("", total=1, visible=False)

        class Bar:
            def start(self, label: str, messages: int) -> None:
                prog.reset(current, total=messages, description=label, visible=True)

            def advance(self) -> None:
                prog.advance(current)

            def finish(self) -> None:
                prog.advance(overall)

        yield Bar()


@app.command()
def longsession(model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
                arms: str = typer.Option("h2o,retention-only,positions-only,pace",
                                         help="comma-separated arms: full, streaming, h2o, snapkv, tova, "
                                              "positions-only, retention-only, pace, pace-tiered, pace-refresh, "
                                              "pace-refresh-tail, pace-refresh-window, "
                                              "pace-refresh-h2o, akv-rolling"),
                length: int = typer.Option(16384, help="session length in tokens (context before the probes)"),
                distances: str = typer.Option("1024,8192,15000", help="definition → probe distances in tokens"),
                budget: int = typer.Option(512, help="B: resident slots after each chunk"),
                chunk: int = typer.Option(512, help="H: prefill chunk"),
                limit: int = typer.Option(2048, help="L: position limit of the bounded arms"),
                sessions: int = typer.Option(5, help="sessions (seeds) per distance"),
                seed: int = typer.Option(7),
                domain: str = typer.Option("settlement", help="session domain: settlement (fee rules in Python, "
                                           "stdlib source as filler) or ops (an on-call service's YAML config, "
                                           "the Python docs' prose as filler)"),
                sessions_file: Path | None = typer.Option(None, help="score the sessions in this JSONL file instead "
                                                                      "(schema: docs/sessions-schema.md)"),
                shard_of: str = typer.Option("", "--shard", help="I/N: play only sessions I, I+N, ... (run N "
                                             "processes with the same --out, then --report-only for the whole sweep)"),
                code: bool = typer.Option(True, help="run the code probes (slow; near zero on a 135M model)"),
                blueprint: str = typer.Option("facts", help="the oracle plan's granularity: facts (each needed "
                                                            "fact's tokens) or messages (the whole message holding "
                                                            "each)"),
                planner: str = typer.Option("oracle", help="who makes the foresight arms' plan: oracle (the "
                                            "generator's record), lexical (TF-IDF over the messages), previous (the "
                                            "message before the probes), llm (a model; needs --blueprint messages, "
                                            "as every planner but the oracle)"),
                planner_model: str = typer.Option("smollm2", help="model of --planner llm (or the endpoint's model "
                                                  "name)"),
                endpoint: str | None = typer.Option(None, help="OpenAI-compatible base URL for --planner llm instead "
                                                    "of a local model"),
                message_chars: int = typer.Option(200, help="characters of each message the llm planner is shown"),
                plan_only: bool = typer.Option(False, "--plan-only", help="make the plans, report the planner's "
                                               "edges against the oracle, play nothing"),
                dtype: str = typer.Option("float32", help="weights and K/V: float32, or bfloat16 (AVX512-BF16 "
                                          "matmuls on CPU, ~3x pace-refresh's tokens/s here; re-rotation starts "
                                          "from fp32 reference keys)"),
                out: Path = typer.Option(Path("runs/longsession"), help="output folder (JSON, Markdown, plots)"),
                mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the run to MLflow"),
                report_only: bool = typer.Option(False, "--report-only", help="play nothing: report the (session, "
                                                 "arm) pairs already finished in OUT/journal.jsonl (partial sweep)"),
                as_json: bool = typer.Option(False, "--json", help="print the result JSON on stdout")) -> None:
    """Residency vs retrievability: every arm on exactly the same sessions, paired against h2o.

    Each finished (session, arm) pair is appended to OUT/journal.jsonl; running the same command again resumes
    (finished pairs are not played again)."""
    from kvsteward.eval.longsession.report import log_to_mlflow, write_report
    from kvsteward.eval.longsession.runner import DTYPES, JOURNAL, RunConfig, run, shard, shard_journal
    from kvsteward.serve.engine import Engine
    from kvsteward.serve.engine.policies import ARMS
    from kvsteward.synth.longsession.generate import generate_sessions
    from kvsteward.synth.longsession.schema import read_jsonl, write_jsonl

    arm_list = tuple(a.strip() for a in arms.split(",") if a.strip())
    unknown = [a for a in arm_list if a not in ARMS]
    if unknown:
        raise typer.BadParameter(f"unknown arms {unknown}; known: {sorted(ARMS)}")
    try:  # RunConfig checks its fields: before the model loads
        cfg = RunConfig(arms=arm_list, budget=budget, chunk=chunk, limit=limit, code=code, blueprint=blueprint,
                        planner=planner, dtype=dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if sessions_file is not None and not sessions_file.is_file():  # before the model loads
        raise typer.BadParameter(f"sessions file {sessions_file} does not exist")
    from kvsteward.synth.longsession.generate import DOMAINS

    if domain not in DOMAINS:
        raise typer.BadParameter(f"unknown domain {domain!r}; known: {sorted(DOMAINS)}")
    with console.status(f"loading {model} ({dtype}) ..."):
        engine = Engine.load(model, dtype=DTYPES[dtype])
    if sessions_file is not None:
        sess = read_jsonl(sessions_file, engine.tokenizer)
    else:
        sess = generate_sessions(engine.tokenizer, sessions, length, _ints(distances), seed, progress=True,
                                 domain=domain)
    journal = out / JOURNAL
    if shard_of:
        parts = shard_of.split("/")
        if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
            raise typer.BadParameter(f"--shard must be I/N (e.g. 0/2), got {shard_of!r}")
        index, count = int(parts[0]), int(parts[1])
        try:
            sess = shard(sess, index, count)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        journal = out / shard_journal(index, count)
    out.mkdir(parents=True, exist_ok=True)
    if not shard_of:  # shards share the folder: only the whole sweep writes its session file
        write_jsonl(sess, out / "sessions.jsonl")
    plans, plan_info = _session_plans(sess, cfg.planner, planner_model, endpoint, message_chars, engine)
    if plan_only:
        (out / "plans.json").write_text(json.dumps(plan_info, indent=1) + "\n")
        if as_json:
            print(json.dumps(plan_info))
        return
    try:
        with _pair_bar(len(sess) * len(arm_list)) as bar:
            result = run(engine, sess, cfg, progress=console.log, journal=journal, play_missing=not report_only,
                         bar=bar, plans=plans)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e
    result["model"] = model
    result["planner"] = plan_info
    result["domain"] = None if sessions_file is not None else domain
    paths = write_report(result, out)
    console.print(paths["markdown"].read_text())
    if mlflow_log:
        params = {"model": model, "arms": arms, "length": length, "distances": distances, "budget": budget,
                  "chunk": chunk, "limit": limit, "sessions": len(sess), "seed": seed,
                  "domain": result["domain"] or "", "sessions_file": str(sessions_file or ""),
                  "blueprint": blueprint, "planner": plan_info["name"], "dtype": dtype}
        result["mlflow_run_id"] = log_to_mlflow(result, out, params)
    if as_json:
        print(json.dumps({k: v for k, v in json.loads(paths["json"].read_text()).items()
                          if k not in ("probes", "other_probes")}
                         | {"mlflow_run_id": result.get("mlflow_run_id")}))


def _session_plans(sessions: list, planner: str, model: str, endpoint: str | None, message_chars: int,
                   engine) -> tuple[dict[str, list[dict]] | None, dict]:
    """The planner's blueprint per session id (None for the oracle: each session's own) and what the report says
    of it: name, edge recall / precision against the oracle (overall and fact probes), planned tokens."""
    from kvsteward.synth.longsession import planner as lp

    if planner == "oracle":
        return None, {"name": "oracle", "oracle": True}
    llm, name = None, planner
    if planner == "llm":
        from kvsteward.synth.traces import planner as pl

        if endpoint:
            complete, name = pl.endpoint_completer(endpoint, model, 24), f"llm:{model}@endpoint"
        else:
            complete, name = pl.engine_completer(engine, 8), f"llm:{model}"
        llm = lp.LLMSessionPlanner(complete, name=name, message_chars=message_chars)
    with _progress(transient=True) as p:
        job = p.add_task(f"planning with {name}", total=len(sessions))
        reads, failures = lp.plan_sessions(sessions, planner, llm, on_session=lambda: p.advance(job))
    info = {"name": name, "oracle": False, **lp.score(sessions, reads), "parse_failures": failures,
            "reads": {s.id: r for s, r in zip(sessions, reads, strict=True)}}
    console.log(f"plan by {name}: edge recall {info['edge_recall']:.2f}, precision {info['edge_precision']:.2f} "
                f"(fact probes {info['fact_edge_recall']:.2f} / {info['fact_edge_precision']:.2f}), "
                f"{info['planned_tokens_mean']:.0f} planned tokens per session")
    return {s.id: lp.blueprint_of(s, r) for s, r in zip(sessions, reads, strict=True)}, info


def _min_confidence(value: float | None, flag: str) -> float | None:
    """A confidence option as the aux knob: None stays None (not given), 0 is the greedy list (None), (0, 1] a
    probability; anything else refused by name before the model loads."""
    from kvsteward.serve.manager.decode import check_min_confidence

    if value is None or value == 0:
        return None
    try:
        return check_min_confidence(value)
    except ValueError as e:
        raise typer.BadParameter(f"{flag} must be a probability in (0, 1] or 0 (the greedy list), got {value}") from e


def _check_aux_context(aux_context: str | None) -> None:
    from kvsteward.synth.traces.hindsight import check_aux_context

    if aux_context is not None:
        try:
            check_aux_context(aux_context, "--aux-context")
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e


def _numeric_metrics(groups: dict[str, dict]) -> dict[str, float]:
    """MLflow metrics `<group>.<key>` from summaries: the numbers only (NaN, lists and dicts left to the JSON)."""
    return {f"{g}.{k}": float(v) for g, summary in groups.items() for k, v in summary.items()
            if isinstance(v, (int, float)) and v == v}


def _interleave(traces: list) -> list:
    """The traces environment by environment in turn (each environment's own order kept), so the first N of a
    multi-environment set hold every environment alike."""
    by_env: dict[str, list] = {}
    for t in traces:
        by_env.setdefault(t.env, []).append(t)
    queues = list(by_env.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def _traces(data: Path, traces: Path | None, split: str, limit: int, envs: str = "") -> list:
    """At most `limit` traces of `split` (`all`: every split) and of the environments `envs` (comma-separated; empty:
    all): from `traces`, or the folder the dataset card at `data` names."""
    from kvsteward.synth.traces.dataset import CARD_JSON
    from kvsteward.synth.traces.trace import read_traces

    card = data / CARD_JSON
    src = traces or (Path(json.loads(card.read_text())["source_traces"]) if card.exists() else None)
    if src is None:
        raise typer.BadParameter(f"{data} has no {CARD_JSON} naming its traces: pass --traces")
    want = {e.strip() for e in envs.split(",") if e.strip()}
    trs = _interleave([t for t in read_traces(src) if split in ("all", t.split) and (not want or t.env in want)])
    trs = trs[:limit]
    if not trs:
        raise typer.BadParameter(f"no {split!r} traces{f' of {sorted(want)}' if want else ''} in {src}")
    return trs


def _check_parallel(workers: int, journal: Path | None) -> None:
    if workers < 1:
        raise typer.BadParameter(f"--workers must be >= 1, got {workers}")
    if journal is not None and journal.is_dir():
        raise typer.BadParameter(f"--journal {journal} is a folder: give a file path")


def _parallel(model: str, adapter: Path | None, engine, workers: int, journal: Path | None) -> dict:
    """`play`'s process and journal arguments: each worker loads what this process loaded."""
    from functools import partial

    from kvsteward.eval.manager.evaluate import load_engine

    adapter_dir = str(adapter) if adapter else None
    return {"workers": workers, "journal": journal,
            "engine_factory": partial(load_engine, model, adapter_dir, engine.aux_context),
            "journal_key": {"model": model, "adapter": str(Path(adapter_dir).resolve()) if adapter_dir else None}}


def _rule_arms(names: list[str], data: Path, baselines: Path | None, point: str, fit_envs: list[str],
               every: int) -> tuple[dict, dict]:
    """The fitted cheap baselines as arms, and the fitted rules: from `baselines` (a folder of `save_baselines`,
    e.g. a manager folder's `rules/`) when given, else fitted now by the one fit (`baselines.fit_on_traces`) on the
    train-split traces of `fit_envs` (all environments when empty; the adapter's, so a held-out environment stays
    unseen by every arm) at the evaluation's `every`."""
    from kvsteward.eval.manager.arms import RuleArm
    from kvsteward.synth.traces.baselines import fit_on_traces, load_baselines

    if not names:
        return {}, {}
    fitted, missing = {}, list(names)
    if baselines is not None:
        try:
            fitted = load_baselines(baselines)
        except (FileNotFoundError, ValueError) as e:
            raise typer.BadParameter(f"--baselines {baselines}: {e}") from None
        missing = [n for n in names if n not in fitted]
    if missing:
        train = _traces(data, None, "train", 1 << 30, ",".join(fit_envs))
        where = f"{len(train)} train traces" + (f" of {', '.join(fit_envs)}" if fit_envs else "")
        with console.status(f"fitting {', '.join(missing)} on {where} ..."):
            try:
                fitted |= fit_on_traces(train, every, missing)
            except ValueError as e:
                raise typer.BadParameter(f"cannot fit the baselines on {where}: {e}") from e
    return {n: RuleArm(n, fitted[n], point) for n in names}, fitted


def _is_scores_adapter(adapter: Path) -> bool:
    from kvsteward.models import adapter_meta

    return adapter_meta(adapter)["trigger"] == "scores"


def _stack_arm(scorer, data: Path, folder: Path | None, n_fit: int, fit_envs: list[str], every: int, point: str):
    """The stacked head as an arm: read from `folder` when it holds one, else fitted on the scored decisions of
    `n_fit` train traces of `fit_envs` (and written to `folder` when given)."""
    from kvsteward.eval.manager.stack import StackArm, StackError, fit_stack
    from kvsteward.synth.traces.baselines import load_baselines, save_baselines

    if folder is not None and (folder / "baselines.json").is_file():
        try:
            head = load_baselines(folder)["stack"]
        except (KeyError, ValueError) as e:
            raise typer.BadParameter(f"--stack-head {folder}: no fitted stack head there ({e})") from None
        return StackArm(head, point, record={"source": str(folder), "points": head.points})
    if n_fit < 1:
        raise typer.BadParameter(f"--stack-fit must be >= 1, got {n_fit}")
    train = _traces(data, None, "train", n_fit, ",".join(fit_envs))
    try:
        head, decisions = fit_stack(scorer, train, every, progress=console.log)
    except StackError as e:
        raise typer.BadParameter(str(e)) from e
    if folder is not None:  # the head, and the scored decisions it was fitted on (per-cue and ablation studies)
        save_baselines({"stack": head}, folder)
        with (folder / "scored_decisions.jsonl").open("w") as f:
            f.writelines(json.dumps(d.to_dict()) + "\n" for d in decisions)
    record = {"source": str(folder) if folder else "fitted", "train_traces": len(train), "decisions": len(decisions),
              "deletable_share": sum(bool(d.label) for d in decisions) / len(decisions), "points": head.points}
    return StackArm(head, point, record=record)


def _attention_arm(engine, data: Path, traces: Path | None, every: int, fit_traces: int, threshold: float | None,
                   point: str, envs: str):
    """The attention-mass arm, its threshold given or chosen on validation replays (`eval.manager.arms`)."""
    from kvsteward.eval.manager.arms import AttentionArm, fit_attention_threshold

    if threshold is not None:
        return AttentionArm(threshold), {"threshold": threshold, "given": True}
    fit = fit_attention_threshold(engine, _traces(data, traces, "validation", fit_traces, envs), every, point,
                                  progress=console.log)
    return AttentionArm(fit["threshold"]), fit


def _arm_table(result: dict, arms: list[str]) -> None:
    from rich.table import Table

    cols = {"f1": "F1", "precision": "prec", "recall": "recall", "harmful_rate": "harmful", "n_decisions": "decisions",
            "deleted": "deleted", "peak_tokens_reduction": "peak ↓", "kv_reads_reduction": "reads ↓",
            "answer_acc": "answers"}
    t = Table(title=f"memory managers on the same decisions ({result['n_traces']} traces)",
              caption="harmful: deletions a later step reads / deletions; peak ↓ / reads ↓: saved against the "
                      "replay without deletions")
    t.add_column("arm")
    for header in cols.values():
        t.add_column(header, justify="right")
    for arm in arms:
        row = result[arm]
        t.add_row(arm, *(f"{row[c]:.0f}" if c in ("n_decisions", "deleted") else
                         "-" if row.get(c) is None or row[c] != row[c] else f"{row[c]:.3f}" for c in cols))
    console.print(t)


@app.command()
def manager(model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
            adapter: Path | None = typer.Option(None, help="LoRA adapter folder (omit: no adapter arm)"),
            scores_adapter: Path | None = typer.Option(None, help="a second adapter, trained on the scores trigger "
                                                                  "(per-response decisions, as calibrated): its arm "
                                                                  "`adapter_scores` beside the list adapter's"),
            data: Path = typer.Option(..., help="dataset from `steward synth hindsight` (its card names the traces; "
                                                "its train split fits the cheap baselines)"),
            traces: Path | None = typer.Option(None, help="traces folder to evaluate on (default: the dataset card's "
                                                          "source), e.g. one made by `steward synth import`"),
            split: str = typer.Option("test", help="train | validation | test | all"),
            env: str = typer.Option("", "--env", help="only traces of these environments (comma-separated): a "
                                                      "held-out environment"),
            every: int = typer.Option(4, help="aux thread every K tool turns"),
            limit: int = typer.Option(10, help="at most this many traces"),
            arms: str = typer.Option(",".join(("base", "delete_all_read", "keep_last_k", "text_classifier",
                                                "lexical_overlap", "structure", "attention_mass", "adapter")),
                                     help="comma-separated arms (adapter only with --adapter; stack, "
                                          "structure + the per-response P(no), only with --scores-adapter)"),
            point: str = typer.Option("f1", help="the cheap baselines' operating point: f1 (best train F1) or safe "
                                                 "(best F1 with <= 2 % harmful on train)"),
            baselines: Path | None = typer.Option(None, help="fitted baselines folder (`steward eval choose`'s "
                                                             "OUT/rules; default: fitted now on the train-split "
                                                             "traces of --fit-envs, nothing deleted before)"),
            attention_fit: int = typer.Option(10, help="validation traces whose replays choose the attention-mass "
                                                       "threshold"),
            attention_threshold: float | None = typer.Option(None, help="attention-mass threshold (skips the fit)"),
            fit_envs: str | None = typer.Option(None, help="environments whose train / validation traces fit the "
                                                           "baselines and the attention threshold (default: those "
                                                           "the adapter was trained on, all without one)"),
            stack_fit: int = typer.Option(20, help="train traces (of --fit-envs) whose scored decisions fit the "
                                                   "stack head (arm `stack`: structure + the --scores-adapter's "
                                                   "P(no))"),
            stack_head: Path | None = typer.Option(None, help="folder of the fitted stack head: read from it when it "
                                                              "holds one, else fitted and written there"),
            plan: bool = typer.Option(False, help="also score `Planning mode` blueprints"),
            base: bool = typer.Option(True, "--base/--no-base", help="also run the base model as the manager "
                                                                     "(--no-base: drop the base arm)"),
            close_bias: float | None = typer.Option(None, help="nats added to closing the deletion list (serving's "
                                                              "--aux-close-bias): > 0 deletes less, fewer harmful "
                                                              "deletions; default: the adapter's calibrated bias "
                                                              "(`steward eval calibrate`), 0 without one"),
            min_confidence: float | None = typer.Option(None, help="delete only the ids the manager lists with at "
                                                                  "least this probability (serving's "
                                                                  "--aux-min-confidence; 0: the greedy list); "
                                                                  "default: the adapter's calibrated rule, greedy "
                                                                  "without one"),
            delete_unread: bool = typer.Option(False, "--delete-unread",
                                               help="let the manager delete tool responses not read yet (serving's "
                                                    "--aux-delete-unread; default: never)"),
            aux_context: str | None = typer.Option(None, help="what the aux trigger follows: full (the session, the "
                                                        "default) or first (its first message only: an ablation); "
                                                        "default: as the adapter was trained (its kvsteward.json)"),
            workers: int = typer.Option(1, help="play traces in this many processes (each loads the model; "
                                                "results as with 1)"),
            journal: Path | None = typer.Option(None, help="JSONL file of finished traces: rerun with the same "
                                                           "command to resume after a crash"),
            mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the metrics to MLflow"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """The learned manager against the base model and the strongest cheap baselines (delete-all-read, keep-last-K,
    a bag-of-words classifier, lexical overlap, attention mass), every arm on the same replays and decisions:
    deletion P/R/F1, harmful deletions (95 % CI), peak tokens / KV reads / answer accuracy vs uncompressed, per arm
    and per cue."""
    from kvsteward.eval.manager.arms import ARM_NAMES, RULES
    from kvsteward.eval.manager.evaluate import JournalError, evaluate, load_engine

    if close_bias is not None and not math.isfinite(close_bias):  # before the model loads
        raise typer.BadParameter(f"--close-bias must be a finite number of nats, got {close_bias}")
    conf_given = _min_confidence(min_confidence, "--min-confidence")
    wanted = [a.strip() for a in arms.split(",") if a.strip()]
    if unknown := [a for a in wanted if a not in ARM_NAMES]:
        raise typer.BadParameter(f"--arms: unknown {unknown}; known: {', '.join(ARM_NAMES)}")
    if not base:
        wanted = [a for a in wanted if a != "base"]
    if adapter is None:
        wanted = [a for a in wanted if a != "adapter"]
    stack = "stack" in wanted
    # the stack reads a per-response adapter: --scores-adapter, or --adapter when that one is per-response
    stack_on_main = stack and scores_adapter is None and adapter is not None and _is_scores_adapter(adapter)
    if stack and scores_adapter is None and not stack_on_main:
        raise typer.BadParameter("--arms stack stacks a per-response adapter's P(no) on the structure features: "
                                 "give --scores-adapter DIR (or a scores-trigger --adapter)")
    wanted = [a for a in wanted if a != "stack"]  # played on the scores adapter's engine, after the others
    if not wanted and scores_adapter is None and not stack:
        raise typer.BadParameter("--no-base leaves no manager to evaluate: give --adapter DIR" if not base else
                                 "--arms leaves no arm to evaluate")
    if point not in ("f1", "safe"):
        raise typer.BadParameter(f"--point must be f1 or safe, got {point!r}")
    if split not in ("train", "validation", "test", "all"):
        raise typer.BadParameter(f"--split must be train, validation, test or all, got {split!r}")
    _check_aux_context(aux_context)
    _check_parallel(workers, journal)
    if adapter is not None:  # refused before any baseline is fit or model loaded
        from kvsteward.models import check_adapter

        check_adapter(adapter)
    if scores_adapter is not None:
        from kvsteward.models import adapter_meta, check_adapter

        check_adapter(scores_adapter)
        if (trig := adapter_meta(scores_adapter)["trigger"]) != "scores":
            raise typer.BadParameter(f"--scores-adapter {scores_adapter} was trained on the {trig!r} trigger, not "
                                     "scores: pass it as --adapter")
    trs = _traces(data, traces, split, limit, env)
    if fit_envs is None:
        from kvsteward.models import adapter_meta

        trained = adapter or scores_adapter
        fit_list = list(adapter_meta(trained).get("train_envs") or []) if trained else []
    else:
        fit_list = [e.strip() for e in fit_envs.split(",") if e.strip()]
    rules, _ = _rule_arms([a for a in wanted if a in RULES], data, baselines, point, fit_list, every)
    with console.status(f"loading {model} ..."):
        engine = load_engine(model, str(adapter) if adapter else None, aux_context)
    attention_fit_record = None
    if "attention_mass" in wanted:  # chosen on the dataset's own validation traces of the fit environments
        rules["attention_mass"], attention_fit_record = _attention_arm(
            engine, data, None, every, attention_fit, attention_threshold, point, ",".join(fit_list))
    if stack_on_main:
        rules["stack"] = _stack_arm(engine, data, stack_head, stack_fit, fit_list, every, point)
        wanted.append("stack")
    model_arms = tuple(a for a in wanted if a in ("base", "adapter"))
    # one bias for both arms when given; else the adapter's calibrated one for the adapter (the base model has none)
    bias = {arm: close_bias if close_bias is not None else engine.close_bias if arm == "adapter" else 0.0
            for arm in model_arms}
    conf = {arm: conf_given if min_confidence is not None else engine.min_confidence if arm == "adapter" else None
            for arm in model_arms}
    try:
        result = evaluate(engine, trs, every=every, arms=model_arms, plan=plan, progress=console.log,
                          close_bias=bias, keep_unread=not delete_unread, min_confidence=conf,
                          rules={a: rules[a] for a in wanted if a in rules},
                          **_parallel(model, adapter, engine, workers, journal))
    except JournalError as e:
        raise typer.BadParameter(str(e)) from e
    if scores_adapter is not None:  # its own engine (one adapter per engine) and its own uncompressed replay
        with console.status(f"loading {model} with {scores_adapter} ..."):
            scorer = load_engine(model, str(scores_adapter), None)
        scores_journal = journal.with_name(journal.stem + ".scores" + journal.suffix) if journal else None
        stack_arm = ({"stack": _stack_arm(scorer, data, stack_head, stack_fit, fit_list, every, point)}
                     if stack else {})
        try:
            second = evaluate(scorer, trs, every=every, arms=("adapter",), progress=console.log,
                              close_bias={"adapter": scorer.close_bias}, keep_unread=not delete_unread,
                              min_confidence={"adapter": scorer.min_confidence}, rules=stack_arm,
                              **_parallel(model, scores_adapter, scorer, workers, scores_journal))
        except JournalError as e:
            raise typer.BadParameter(str(e)) from e
        result["adapter_scores"] = second["adapter"]
        wanted.append("adapter_scores")
        if stack:
            result["stack"] = second["stack"]
            result["stack_fit"] = stack_arm["stack"].record
            wanted.append("stack")
    if stack_on_main:
        result["stack_fit"] = rules["stack"].record
    result = {a: result[a] for a in wanted} | {k: v for k, v in result.items() if k not in wanted}
    result.update({"arms": wanted, "split": split, "envs": sorted({t.env for t in trs}),
                   "traces_source": str(traces) if traces else "dataset", "point": point, "fit_envs": fit_list,
                   "attention_fit": attention_fit_record,
                   "baseline_settings": {a: rules[a].baseline.points[point] for a in wanted if a in RULES}})
    if mlflow_log:
        import mlflow

        from kvsteward.runs import stage_run

        with stage_run("manager-eval") as run:
            mlflow.log_params({"model": model, "adapter": str(adapter or ""), "data": str(data), "split": split,
                               "scores_adapter": str(scores_adapter or ""),
                               "env": env, "traces_source": result["traces_source"], "arms": ",".join(wanted),
                               "every": every, "traces": len(trs), "point": point,
                               **{f"{arm}.close_bias": bias[arm] for arm in model_arms},
                               **{f"{arm}.min_confidence": conf[arm] for arm in model_arms if conf[arm] is not None},
                               "keep_unread": not delete_unread, "aux_context": engine.aux_context})
            mlflow.log_metrics(_numeric_metrics({arm: result[arm] for arm in wanted}))
            mlflow.log_dict(result, "manager_eval.json")
        result["mlflow_run_id"] = run.info.run_id
    if as_json:
        print(json.dumps(result))
    else:
        _arm_table(result, wanted)


@app.command()
def calibrate(model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
              adapter: Path = typer.Option(..., help="LoRA adapter folder: its kvsteward.json receives the choice"),
              data: Path = typer.Option(..., help="dataset from `steward synth hindsight` (its card names the traces)"),
              traces: Path | None = typer.Option(None, help="traces folder (default: the dataset card's source)"),
              split: str = typer.Option("validation", help="the held-out split to choose on (not the test split "
                                                           "you report)"),
              env: str = typer.Option("", "--env", help="only traces of these environments (comma-separated): the "
                                                        "adapter's training environments"),
              every: int = typer.Option(4, help="aux thread every K tool turns (as you will serve it)"),
              limit: int = typer.Option(40, help="at most this many traces"),
              biases: str = typer.Option("0,1", help="comma-separated close biases to try (nats)"),
              confidences: str = typer.Option("0.8,0.9", help="comma-separated thresholds of the confidence rule to "
                                                              "try too (at bias 0: delete the ids listed with at "
                                                              "least this probability; serving's "
                                                              "--aux-min-confidence); empty: none"),
              max_harm: float = typer.Option(0.02, help="target: harmful deletions / deletions at most this"),
              min_f1: float = typer.Option(0.8, help="target: deletion F1 at least this"),
              delete_unread: bool = typer.Option(False, "--delete-unread",
                                                 help="let the manager delete tool responses not read yet (serving's "
                                                      "--aux-delete-unread; default: never)"),
              aux_context: str | None = typer.Option(None, help="what the aux trigger follows: full or first; "
                                                          "default: as the adapter was trained"),
              write: bool = typer.Option(True, "--write/--no-write", help="record the chosen bias in the adapter's "
                                                                        "kvsteward.json (the serving default)"),
              rules: str = typer.Option("", help="fitted rules to play on the same replays (e.g. "
                                                 "delete_all_read,structure): what `steward eval choose "
                                                 "--calibration` compares the adapter with, without replaying"),
              fit_envs: str | None = typer.Option(None, help="environments whose train traces fit --rules "
                                                             "(default: those the adapter was trained on)"),
              workers: int = typer.Option(1, help="play traces in this many processes (each loads the model; "
                                                        "results as with 1)"),
              journal: Path | None = typer.Option(None, help="JSONL file of finished traces: rerun with the same "
                                                                   "command to resume after a crash"),
              mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the sweep to MLflow"),
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Choose the aux close bias (or confidence threshold) on held-out traces: the adapter as memory manager at every
    bias and threshold (all against one uncompressed replay per trace); the highest F1 with harmful rate <=
    --max-harm and F1 >= --min-f1 (else the lowest harmful rate, reported as not met); recorded in the adapter for
    `steward serve` and `steward eval manager`."""
    from kvsteward.eval.manager.calibrate import check_biases, check_confidences, choose, record, sweep
    from kvsteward.eval.manager.evaluate import JournalError
    from kvsteward.models import ModelNotFound, check_adapter
    from kvsteward.serve.engine import Engine

    try:  # everything before the model loads
        bias_list = check_biases([float(x) for x in biases.split(",") if x.strip()])
    except ValueError as e:
        raise typer.BadParameter(f"--biases must be comma-separated finite numbers of nats, got {biases!r} "
                                 f"({e})") from e
    try:
        conf_list = check_confidences([float(x) for x in confidences.split(",") if x.strip()])
    except ValueError as e:
        raise typer.BadParameter(f"--confidences must be comma-separated probabilities in (0, 1], got "
                                 f"{confidences!r} ({e})") from e
    try:
        check_adapter(str(adapter))
    except ModelNotFound as e:
        raise typer.BadParameter(str(e)) from e
    if not (0.0 <= max_harm <= 1.0 and 0.0 <= min_f1 <= 1.0):
        raise typer.BadParameter(f"--max-harm and --min-f1 are rates in [0, 1], got {max_harm} and {min_f1}")
    _check_aux_context(aux_context)
    _check_parallel(workers, journal)
    from kvsteward.eval.manager.arms import RULES
    from kvsteward.models import adapter_meta

    rule_names = [r.strip() for r in rules.split(",") if r.strip()]
    if unknown := [r for r in rule_names if r not in RULES]:
        raise typer.BadParameter(f"--rules: unknown {unknown}; known: {', '.join(RULES)}")
    trs = _traces(data, traces, split, limit, env)
    if split == "test":
        console.print("[yellow]warning:[/yellow] choosing on the test split: its numbers then measure the choice, "
                      "not the manager (use --split validation)")
    fit_list = ([e.strip() for e in fit_envs.split(",") if e.strip()] if fit_envs is not None else
                list(adapter_meta(adapter).get("train_envs") or []))
    rule_arms, fitted = _rule_arms(rule_names, data, None, "f1", fit_list, every)
    with console.status(f"loading {model} ..."):
        engine = Engine.load(model, adapter=str(adapter))
    recorded_context = engine.aux_context
    if aux_context is not None:
        engine.aux_context = aux_context
    try:
        result = sweep(engine, trs, bias_list, every=every, keep_unread=not delete_unread, progress=console.log,
                       confidences=conf_list, rules=rule_arms,
                       **_parallel(model, adapter, engine, workers, journal))
    except JournalError as e:
        raise typer.BadParameter(str(e)) from e
    choice = choose(result["by_bias"], max_harm, min_f1, result["by_confidence"])
    out = {"close_bias": choice.close_bias, "min_confidence": choice.min_confidence, "chosen": choice.name,
           "met": choice.met, "reason": choice.reason, "adapter_dir": str(adapter), "split": split, **result,
           "by_bias": {str(b): s for b, s in result["by_bias"].items()},
           "by_confidence": {str(c): s for c, s in result["by_confidence"].items()}, "written": write,
           "rule_settings": {n: fitted[n].points for n in rule_names}, "fit_envs": fit_list}
    if write:
        record(adapter, choice, result, split, max_harm, min_f1)
        if engine.aux_context != recorded_context:
            console.print(f"[yellow]warning:[/yellow] the bias was chosen with --aux-context {engine.aux_context}, "
                          f"but the adapter records {recorded_context}: serve it with --aux-context "
                          f"{engine.aux_context} (the calibration record names the context)")
    if mlflow_log:
        import mlflow

        from kvsteward.runs import stage_run

        with stage_run("manager-calibrate") as run:
            mlflow.log_params({"model": model, "adapter": str(adapter), "data": str(data), "split": split,
                               "every": every, "traces": len(trs), "biases": ",".join(f"{b:g}" for b in bias_list),
                               "confidences": ",".join(f"{c:g}" for c in conf_list),
                               "chosen_min_confidence": choice.min_confidence,
                               "max_harm": max_harm, "min_f1": min_f1, "keep_unread": not delete_unread,
                               "aux_context": engine.aux_context, "chosen_close_bias": choice.close_bias,
                               "met": choice.met})
            mlflow.log_metrics(_numeric_metrics({f"bias_{b:g}": s for b, s in result["by_bias"].items()}
                                                | {f"confidence_{c:g}": s for c, s in result["by_confidence"].items()}))
            mlflow.log_dict(out, "manager_calibrate.json")
        out["mlflow_run_id"] = run.info.run_id
    print(json.dumps(out)) if as_json else console.print_json(json.dumps(out))


@app.command()
def choose(model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
           adapter: Path | None = typer.Option(None, help="LoRA adapter folder (as calibrated): the adapter arm"),
           data: Path = typer.Option(..., help="dataset from `steward synth hindsight` (its card names the traces)"),
           split: str = typer.Option("validation", help="the split to choose on (never the test split you report)"),
           env: str = typer.Option("", "--env", help="only traces of these environments (comma-separated)"),
           every: int = typer.Option(4, help="aux thread every K tool turns (as you will serve it)"),
           limit: int = typer.Option(10, help="at most this many traces"),
           arms: str = typer.Option("delete_all_read,structure,adapter",
                                    help="the candidates (adapter only with --adapter; stack only with a "
                                         "scores-trigger --adapter)"),
           fit_envs: str | None = typer.Option(None, help="environments whose train traces fit the rules (default: "
                                                          "those the adapter was trained on, all without one)"),
           max_harm: float = typer.Option(1.0, help="only arms with harmful rate <= this compete (1: all)"),
           stack_fit: int = typer.Option(20, help="train traces whose scored decisions fit the stack head (arm "
                                                  "`stack`: structure + the per-response --adapter's P(no))"),
           stack_head: Path | None = typer.Option(None, help="folder of the fitted stack head: read from it when it "
                                                             "holds one, else fitted and written there"),
           calibration: Path | None = typer.Option(None, help="`steward eval calibrate --json` output on the same "
                                                              "traces: the adapter's numbers (and those of the "
                                                              "rules it played with --rules) are read from it, "
                                                              "not replayed"),
           out: Path = typer.Option(..., help="the manager folder to write (`steward serve --manager OUT`)"),
           workers: int = typer.Option(1, help="play traces in this many processes"),
           journal: Path | None = typer.Option(None, help="JSONL file of finished traces (resume after a crash)"),
           mlflow_log: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the choice to MLflow"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Choose the manager to serve on validation: the adapter (as calibrated) against the fitted rules, every arm on
    the same replays; the best F1 (within --max-harm) wins, a tie goes to the cheaper arm. Writes OUT/manager.json
    (the choice and its evidence) and OUT/rules (the fitted rules), which `steward serve --manager OUT` serves."""
    from kvsteward.eval.manager.choose import calibrated_summary, choose_manager
    from kvsteward.eval.manager.evaluate import JournalError, evaluate, load_engine
    from kvsteward.serve.manager.rule import MANAGER_ARMS, save_choice

    wanted = [a.strip() for a in arms.split(",") if a.strip()]
    if unknown := [a for a in wanted if a not in MANAGER_ARMS]:
        raise typer.BadParameter(f"--arms: unknown {unknown}; the candidates are {', '.join(MANAGER_ARMS)}")
    if "adapter" in wanted and adapter is None:
        wanted.remove("adapter")
    if "stack" in wanted and (adapter is None or not _is_scores_adapter(adapter)):
        raise typer.BadParameter("--arms stack stacks a per-response adapter's P(no) on the structure features: "
                                 "give a scores-trigger --adapter")
    if not wanted:
        raise typer.BadParameter("--arms leaves nothing to choose among")
    if split not in ("train", "validation", "test", "all"):
        raise typer.BadParameter(f"--split must be train, validation, test or all, got {split!r}")
    if not 0.0 <= max_harm <= 1.0:
        raise typer.BadParameter(f"--max-harm is a rate in [0, 1], got {max_harm}")
    _check_parallel(workers, journal)
    cal, adapter_summary = None, None
    if calibration is not None:
        try:
            cal = _calibration_record(calibration)
            adapter_summary = calibrated_summary(cal)
        except (OSError, KeyError, ValueError) as e:
            raise typer.BadParameter(f"--calibration {calibration}: {e}") from e
    if adapter is not None:
        from kvsteward.models import ModelNotFound, adapter_meta, check_adapter

        try:
            check_adapter(str(adapter))
        except ModelNotFound as e:
            raise typer.BadParameter(str(e)) from e
    if split == "test":
        console.print("[yellow]warning:[/yellow] choosing on the test split: its numbers then measure the choice")
    trs = _traces(data, None, split, limit, env)
    if cal is not None and (cal.get("task_ids", [t.task_id for t in trs]) != [t.task_id for t in trs]
                            or cal.get("every", every) != every):
        raise typer.BadParameter(f"--calibration {calibration} was played on other traces or another --every: give "
                                 "choose the calibration's --split, --env, --limit and --every")
    fit_list = ([e.strip() for e in fit_envs.split(",") if e.strip()] if fit_envs is not None else
                list(adapter_meta(adapter).get("train_envs") or []) if adapter else [])
    rules, fitted = _rule_arms([a for a in wanted if a not in ("adapter", "stack")], data, None, "f1", fit_list,
                               every)
    # a rule the calibration already played on these traces, fitted to the same setting, is read, not replayed
    played = (cal or {}).get("rules") or {}
    settings = (cal or {}).get("rule_settings") or {}
    reused = {a: played[a] for a in rules
              if a in played and settings.get(a) == json.loads(json.dumps(fitted[a].points))}
    to_play = {a: arm for a, arm in rules.items() if a not in reused}
    play_adapter = "adapter" in wanted and adapter_summary is None
    result, stack_record = {}, None
    if to_play or play_adapter or "stack" in wanted:
        with console.status(f"loading {model} ..."):
            engine = load_engine(model, str(adapter) if adapter else None)
        if "stack" in wanted:  # fitted on the train traces, played on the validation replays with the others
            to_play["stack"] = _stack_arm(engine, data, stack_head, stack_fit, fit_list, every, "f1")
            fitted["stack"], stack_record = to_play["stack"].head, to_play["stack"].record
        try:
            result = evaluate(engine, trs, every=every, arms=("adapter",) if play_adapter else (),
                              progress=console.log, close_bias={"adapter": engine.close_bias},
                              min_confidence={"adapter": engine.min_confidence}, rules=to_play,
                              **_parallel(model, adapter, engine, workers, journal))
        except JournalError as e:
            raise typer.BadParameter(str(e)) from e
    result |= reused
    validation = {a: result[a] for a in wanted if a in result}
    if "adapter" in wanted and adapter_summary is not None:
        validation["adapter"] = adapter_summary
    try:
        winner, reason = choose_manager(validation, max_harm)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    record = {"reason": reason, "split": split, "envs": sorted({t.env for t in trs}), "n_traces": len(trs),
              "every": every, "fit_envs": fit_list, "max_harm": max_harm, "validation": validation,
              "sources": {a: "calibration" if a in reused or (a == "adapter" and adapter_summary is not None)
                          else "replayed" for a in validation},
              "data": str(data), "model": model, "stack_fit": stack_record}
    save_choice(out, winner, fitted, str(adapter) if adapter else None, record)
    body = {"choice": winner, "manager_dir": str(out), **record}
    if mlflow_log:
        import mlflow

        from kvsteward.runs import stage_run

        with stage_run("manager-choose") as run:
            mlflow.log_params({"model": model, "adapter": str(adapter or ""), "data": str(data), "split": split,
                               "env": env, "every": every, "traces": len(trs), "arms": ",".join(wanted),
                               "max_harm": max_harm, "choice": winner})
            mlflow.set_tag("kvsteward.served_manager", winner)
            mlflow.log_metrics(_numeric_metrics(validation))
            mlflow.log_artifacts(str(out), "manager")
        body["mlflow_run_id"] = run.info.run_id
    if as_json:
        print(json.dumps(body, default=str))
    else:
        _arm_table({**validation, "n_traces": len(trs)}, list(validation))
        console.print(f"serving [bold]{winner}[/bold]: {reason} → steward serve --manager {out}")


def _calibration_record(path: Path) -> dict:
    """`steward eval calibrate --json`'s object: the file itself, or a pipeline stage's stage.json holding it."""
    body = json.loads(Path(path).read_text())
    return body.get("result", body) if "by_bias" not in body else body
