"""The end-to-end pipeline: synth → hindsight → train → manager eval → long-session benchmark.

Each stage is one `steward` sub-command run in its own process (memory is returned between stages, and a crash
loses only the running stage). A stage's output folder is named by the hash of its parameters and its upstream
stages' hashes, and holds `stage.json` once it has finished: a rerun with the same inputs skips it, a changed input
reruns it and everything downstream. Training resumes from its last checkpoint when its folder exists unfinished.
All stages log under one MLflow parent run (`KVSTEWARD_PARENT_RUN` tells each stage's run whom to nest under).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsteward.runs import PARENT_ENV

DONE = "stage.json"


@dataclass
class PipelineConfig:
    """Every option of the recipe: `steward pipeline run` exposes each one, so a headline result is one command."""

    model: str = "smollm2"
    envs: str = "research,ops,support"  # environments synthesized (`steward synth traces --env`)
    holdout_env: str = ""  # trained on the others, evaluated as the held-out test set ("" = none)
    tasks: int = 60  # per environment
    seed: int = 0
    env_options: str = ""  # comma-separated KEY=VALUE environment options (`steward synth traces -o`)
    every: int = 2
    mask_prob: float = 0.5
    plan: bool = False
    pack: bool = False  # one packed row per trace (every boundary a branch on one trunk) instead of per-boundary rows
    trigger: str = "ids"  # `steward synth hindsight --trigger` (the adapter records it; serving follows)
    train_steps: int = 200
    max_len: int = 2048
    rank: int = 16
    alpha: int = 32
    lr: float = 1e-3
    batch_size: int = 2
    top_layers: int = 0
    lora_dropout: float = 0.0
    adapter_scope: str = "aux"  # `steward train lora --adapter-scope`: aux = trained as served
    aux_context: str = "full"  # the aux thread reads the session (`first` is an ablation)
    skip_trivial: bool = True
    train_seed: int = 0
    train_minutes: float = 0.0
    calibrate_traces: int = 10  # validation traces the decode rule is chosen on (0: no calibration stage)
    biases: str = "0,1"
    confidences: str = "auto"  # thresholds the calibration sweeps ("auto": by trigger, `calibration_confidences`)
    max_harm: float = 0.02
    manager_traces: int = 10  # per test set (in-distribution, held-out environment, imported)
    attention_fit: int = 6
    workers: int = 1
    bench_length: int = 4096
    bench_distances: str = "512,3000"
    bench_sessions: int = 1
    bench_arms: str = "h2o,pace"
    engine_tokens: int = 2048  # `steward engine check`'s budget run length (0: no engine self-check stage)
    # resident KV vs session length, per arm ("": none). Arms of --bench-arms at --bench-length come from the
    # long-session stage's own plays; a separate residency stage traces only what that stage does not play.
    residency_arms: str = "full,h2o,pace"
    residency_length: int = 0  # the session the residency trace follows (0: --bench-length)
    serve_check: bool = True  # one OpenAI-client round trip through `steward serve` (a turn, a drop, a reposition)
    manager_arms: str = ""  # `steward eval manager --arms` ("" : the command's default set)
    # with a per-response (`scores`) adapter: train traces whose scored decisions fit the stack (structure + the
    # adapter's P(no)), which then competes in `choose` and plays in every manager stage
    stack_fit: int = 20
    budget: int = 512
    chunk: int = 256
    limit: int = 1024
    extra: dict = field(default_factory=dict)

    def calibration_confidences(self) -> str:
        """The calibration's threshold grid: given, or by trigger — the list decoder's confidence rule sits high
        (0.8, 0.9); a `scores` adapter's P(no) mostly below 0.5 (a quarter of its labels are "no": a first run put
        every response between 0.2 and 0.3, docs/results/2026-12-05-manager-scores-adapter)."""
        if self.confidences != "auto":
            return self.confidences
        return "0.1,0.2,0.3,0.4,0.5" if self.trigger == "scores" else "0.8,0.9"

    @property
    def stacks(self) -> bool:
        """The stack arm runs: the adapter is per-response (it reads P(no), `eval.manager.stack`)."""
        return self.trigger == "scores" and self.stack_fit > 0

    def env_list(self) -> list[str]:
        return [e.strip() for e in self.envs.split(",") if e.strip()]

    def train_envs(self) -> list[str]:
        return [e for e in self.env_list() if e != self.holdout_env]

    def check(self) -> None:
        if self.holdout_env and self.holdout_env not in self.env_list():
            raise ValueError(f"--holdout-env {self.holdout_env!r} is not among --envs {self.envs!r}")
        if not self.train_envs():
            raise ValueError("no environment left to train on: --envs must name one besides --holdout-env")


@dataclass
class Stage:
    name: str
    params: dict
    upstream: list[str]
    command: Callable[[Path, dict[str, Path]], list[str]]  # (out dir, upstream dirs) → `steward` arguments
    json_output: bool = True


def _option_args(cfg: PipelineConfig) -> list[str]:
    return [a for pair in cfg.env_options.split(",") if pair.strip() for a in ("-o", pair.strip())]


def _traces_stage(cfg: PipelineConfig, name: str = "traces", envs: str | None = None, tasks: int | None = None,
                  seed: int | None = None) -> Stage:
    envs, tasks, seed = envs or cfg.envs, tasks or cfg.tasks, cfg.seed if seed is None else seed
    params = {"envs": envs, "tasks": tasks, "seed": seed, "env_options": cfg.env_options}
    return Stage(name, params, [], lambda out, up: [
        "synth", "traces", "--env", envs, "--tasks", str(tasks), "--seed", str(seed), *_option_args(cfg), "--out",
        str(out), "--json"])


def _hindsight_stage(cfg: PipelineConfig) -> Stage:
    # rows are capped at the training length, so every row the annotator keeps is trainable; the audit runs inside
    params = {"every": cfg.every, "max_tokens": cfg.max_len, "plan": cfg.plan, "model": cfg.model,
              "trigger": cfg.trigger, "pack": cfg.pack, "mask_prob": cfg.mask_prob}
    return Stage("hindsight", params, ["traces"], lambda out, up: [
        "synth", "hindsight", str(up["traces"]), "--every", str(cfg.every), "--max-tokens", str(cfg.max_len),
        "--plan" if cfg.plan else "--no-plan", "--model", cfg.model, "--trigger", cfg.trigger, "--mask-prob",
        str(cfg.mask_prob), *(["--pack"] if cfg.pack else []), "--out", str(out / "ds"), "--json"])


def _train_stage(cfg: PipelineConfig) -> Stage:
    params = {"steps": cfg.train_steps, "max_len": cfg.max_len, "rank": cfg.rank, "alpha": cfg.alpha, "lr": cfg.lr,
              "model": cfg.model, "batch_size": cfg.batch_size, "top_layers": cfg.top_layers,
              "minutes": cfg.train_minutes, "adapter_scope": cfg.adapter_scope, "aux_context": cfg.aux_context,
              "lora_dropout": cfg.lora_dropout, "skip_trivial": cfg.skip_trivial, "seed": cfg.train_seed,
              "envs": cfg.train_envs()}
    return Stage("train", params, ["hindsight"], lambda out, up: [
        "train", "lora", "--model", cfg.model, "--data", str(up["hindsight"] / "ds"), "--max-steps",
        str(cfg.train_steps), "--max-len", str(cfg.max_len), "--rank", str(cfg.rank), "--alpha", str(cfg.alpha),
        "--lr", str(cfg.lr), "--batch-size", str(cfg.batch_size), "--top-layers", str(cfg.top_layers),
        "--max-minutes", str(cfg.train_minutes), "--adapter-scope", cfg.adapter_scope, "--aux-context",
        cfg.aux_context, "--lora-dropout", str(cfg.lora_dropout), "--seed", str(cfg.train_seed),
        *(["--skip-trivial"] if cfg.skip_trivial else []), "--envs", ",".join(cfg.train_envs()),
        "--save-steps", str(max(1, cfg.train_steps // 4)), "--out", str(out), "--resume", "--json"])


CHOICE_RULES = "delete_all_read,structure"  # what the adapter must beat to be served


def _calibrate_stage(cfg: PipelineConfig) -> Stage:
    # chosen on the validation traces of the training environments: never on a test set
    params = {"traces": cfg.calibrate_traces, "every": cfg.every, "biases": cfg.biases,
              "confidences": cfg.calibration_confidences(), "max_harm": cfg.max_harm, "envs": cfg.train_envs(),
              "rules": CHOICE_RULES}  # played on the same replays: the choose stage reads them
    return Stage("calibrate", params, ["hindsight", "train"], lambda out, up: [
        "eval", "calibrate", "--model", cfg.model, "--adapter", _adapter(up["train"]), "--data",
        str(up["hindsight"] / "ds"), "--split", "validation", "--env", ",".join(cfg.train_envs()), "--every",
        str(cfg.every), "--limit", str(cfg.calibrate_traces), "--biases", cfg.biases, "--confidences",
        cfg.calibration_confidences(), "--max-harm", str(cfg.max_harm), "--min-f1", "0", "--rules", CHOICE_RULES,
        "--fit-envs", ",".join(cfg.train_envs()), "--workers", str(cfg.workers), "--journal", str(out / "traces.jsonl"),
        "--json"])


def _choose_stage(cfg: PipelineConfig) -> Stage:
    """The manager to serve, chosen on the same validation traces as the decode rule: the calibrated adapter against
    the fitted rules (`steward eval choose`), every number read from the calibration, which played the rules on its
    replays (without a calibration stage the choice replays them itself)."""
    traces = cfg.calibrate_traces or cfg.manager_traces
    params = {"traces": traces, "every": cfg.every, "envs": cfg.train_envs(), "max_harm": cfg.max_harm,
              "arms": CHOICE_RULES + ",adapter" + (",stack" if cfg.stacks else ""),
              **({"stack_fit": cfg.stack_fit} if cfg.stacks else {})}
    upstream = ["hindsight", "train", *(["calibrate"] if cfg.calibrate_traces else [])]
    return Stage("choose", params, upstream, lambda out, up: [
        "eval", "choose", "--model", cfg.model, "--adapter", _adapter(up["train"]), "--data",
        str(up["hindsight"] / "ds"), "--split", "validation", "--env", ",".join(cfg.train_envs()), "--every",
        str(cfg.every), "--limit", str(traces), "--fit-envs", ",".join(cfg.train_envs()), "--arms", params["arms"],
        *(["--calibration", str(up["calibrate"] / DONE)] if "calibrate" in up else []),
        *(["--stack-fit", str(cfg.stack_fit), "--stack-head", str(out / STACK_HEAD)] if cfg.stacks else []),
        "--workers", str(cfg.workers), "--journal", str(out / "traces.jsonl"), "--out", str(out / "manager"),
        "--json"])


STACK_HEAD = "stack_head"  # the choose stage's fitted stack head, read by every manager stage
# `steward eval manager`'s default arms (the stack joins them with a per-response adapter)
MANAGER_ARMS = "base,delete_all_read,keep_last_k,text_classifier,lexical_overlap,structure,attention_mass,adapter"


def _manager_arms(cfg: PipelineConfig) -> str:
    arms = cfg.manager_arms or MANAGER_ARMS
    return arms + ",stack" if cfg.stacks and "stack" not in arms.split(",") else arms


def _manager_stage(cfg: PipelineConfig, name: str, upstream: list[str], which: dict,
                   test_args: Callable[[dict[str, Path]], list[str]]) -> Stage:
    """One test set of `steward eval manager`: every arm on the same traces (the adapter as calibrated)."""
    arms = _manager_arms(cfg)
    params = {"traces": cfg.manager_traces, "every": cfg.every, "model": cfg.model, "attention_fit": cfg.attention_fit,
              **which, **({"arms": arms} if arms != MANAGER_ARMS else {})}
    if cfg.stacks:
        upstream = [*upstream, "choose"]  # its fitted stack head
    return Stage(name, params, upstream, lambda out, up: [
        "eval", "manager", "--model", cfg.model, "--adapter", _adapter(up["train"]), "--data",
        str(up["hindsight"] / "ds"), *test_args(up), *(["--arms", arms] if arms != MANAGER_ARMS else []),
        *(["--stack-head", str(up["choose"] / STACK_HEAD)] if cfg.stacks else []),
        "--every", str(cfg.every), "--limit", str(cfg.manager_traces),
        "--fit-envs", ",".join(cfg.train_envs()), "--attention-fit", str(cfg.attention_fit), "--workers",
        str(cfg.workers), "--journal", str(out / "traces.jsonl"), "--json"])


def _import_stages(cfg: PipelineConfig) -> list[Stage]:
    """The third test set goes the way a user's own traces go: fresh traces (another seed) of the test environment,
    exported as OpenAI JSONL with their provenance (`steward synth export --provenance`) and read back by `steward
    synth import --planner provenance`."""
    env = cfg.holdout_env or ",".join(cfg.train_envs())
    fresh = _traces_stage(cfg, "fresh_traces", env, cfg.manager_traces, cfg.seed + 1)
    export = Stage("exported", {}, ["fresh_traces"], lambda out, up: [
        "synth", "export", str(up["fresh_traces"]), "--provenance", "--out", str(out / "sessions.jsonl")],
        json_output=False)
    imported = Stage("imported", {}, ["exported"], lambda out, up: [
        "synth", "import", str(up["exported"] / "sessions.jsonl"), "--planner", "provenance", "--out", str(out)],
        json_output=False)
    return [fresh, export, imported]


def _engine_stage(cfg: PipelineConfig) -> Stage:
    """The engine's exactness self-check first: what every later number stands on."""
    return Stage("engine", {"check": "demo", "model": cfg.model, "tokens": cfg.engine_tokens, "budget": cfg.budget,
                            "chunk": cfg.chunk}, [], lambda out, up: [
        "pipeline", "engine-check", "--model", cfg.model, "--budget", str(cfg.budget), "--chunk", str(cfg.chunk),
        "--budget-tokens", str(cfg.engine_tokens), "--json"])


def _longsession_stage(cfg: PipelineConfig) -> Stage:
    return Stage("longsession", {"length": cfg.bench_length, "distances": cfg.bench_distances,
                                 "arms": cfg.bench_arms, "sessions": cfg.bench_sessions, "budget": cfg.budget,
                                 "chunk": cfg.chunk, "limit": cfg.limit, "model": cfg.model,
                                 "resident_series": True}, [],
                 lambda out, up: ["eval", "longsession", "--model", cfg.model, "--arms", cfg.bench_arms, "--length",
                                  str(cfg.bench_length), "--distances", cfg.bench_distances, "--sessions",
                                  str(cfg.bench_sessions), "--budget", str(cfg.budget), "--chunk", str(cfg.chunk),
                                  "--limit", str(cfg.limit), "--no-code", "--out", str(out), "--json"])


def residency_stage_needed(cfg: PipelineConfig) -> bool:
    """A separate residency stage runs only for arms or a length the long-session stage does not play (its plays
    record every arm's resident KV after each context message already)."""
    arms = {a for a in cfg.residency_arms.split(",") if a}
    length = cfg.residency_length or cfg.bench_length
    return bool(arms) and (bool(arms - set(cfg.bench_arms.split(","))) or length != cfg.bench_length)


def _residency_stage(cfg: PipelineConfig) -> Stage:
    """Resident KV after every chunk of the long session's context, per arm: flat under a budget, growing without."""
    length = cfg.residency_length or cfg.bench_length
    params = {"arms": cfg.residency_arms, "length": length,
              "distance": min(_ints(cfg.bench_distances)[-1], length // 2), "budget": cfg.budget, "chunk": cfg.chunk,
              "limit": cfg.limit, "model": cfg.model}
    return Stage("residency", params, [], lambda out, up: [
        "pipeline", "residency", "--model", cfg.model, "--arms", cfg.residency_arms, "--length",
        str(length), "--distance", str(params["distance"]), "--budget", str(cfg.budget), "--chunk",
        str(cfg.chunk), "--limit", str(cfg.limit), "--out", str(out / "residency.json")])


def _serve_stage(cfg: PipelineConfig) -> Stage:
    return Stage("serve", {"model": cfg.model}, [], lambda out, up: [
        "pipeline", "serve-check", "--model", cfg.model, "--out", str(out)])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def stages(cfg: PipelineConfig) -> list[Stage]:
    """In the order they run: the engine self-check, the long-session benchmark (and its residency trace), the
    manager's synth → train → calibrate → choose → three test sets, then a round trip through the server."""
    train_envs = ",".join(cfg.train_envs())
    out = [_engine_stage(cfg)] if cfg.engine_tokens else []
    out.append(_longsession_stage(cfg))
    if residency_stage_needed(cfg):
        out.append(_residency_stage(cfg))
    out += [_traces_stage(cfg), _hindsight_stage(cfg), _train_stage(cfg)]
    tested = ["hindsight", "train"]
    if cfg.calibrate_traces:
        out.append(_calibrate_stage(cfg))
        tested.append("calibrate")
    out.append(_choose_stage(cfg))
    out.append(_manager_stage(cfg, "manager", tested, {"set": "test", "envs": train_envs},
                              lambda up: ["--split", "test", "--env", train_envs]))
    if cfg.holdout_env:
        out.append(_manager_stage(cfg, "heldout", tested, {"set": "heldout", "env": cfg.holdout_env},
                                  lambda up: ["--split", "test", "--env", cfg.holdout_env]))
    out += _import_stages(cfg)
    out.append(_manager_stage(cfg, "manager_imported", [*tested, "imported"], {"set": "imported"},
                              lambda up: ["--traces", str(up["imported"]), "--split", "all"]))
    if cfg.serve_check:
        out.append(_serve_stage(cfg))
    return out


def _adapter(train_dir: Path) -> str:
    done = json.loads((train_dir / DONE).read_text())
    return done["result"]["adapter_dir"]


def stage_hash(stage: Stage, upstream_hashes: dict[str, str]) -> str:
    material = json.dumps({"stage": stage.name, "params": stage.params,
                           "upstream": {u: upstream_hashes[u] for u in stage.upstream}}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:12]


def _steward() -> list[str]:
    return [sys.executable, "-m", "kvsteward.pipelines.cli"]


# Seconds on 2 idle cores (fp32 SmolLM2, OMP_NUM_THREADS=2): a stage's estimate before it has ever run here. After a
# run, RUN_ROOT/timings.json holds each stage's measured / modelled ratio, and the next estimate of that stage scales
# by it (other sizes, another machine).
LOAD_S = 12.0  # a stage process that loads the model: imports + weights + tokenizer


def _model_estimate(st: Stage, cfg: PipelineConfig) -> float:
    p, n_envs = st.params, max(1, len(cfg.env_list()))
    rounds = -(-cfg.manager_traces // max(1, cfg.workers))  # traces each worker plays, one after another
    if st.name == "engine":
        return LOAD_S + 15 + 6 * p["tokens"] / 1024
    if st.name == "longsession":  # s per 1K tokens of session and arm (3 fact probes + a 96-token recall each)
        kt = p["length"] / 1024
        per_kt = {"full": 20.0, "pace": 18.0, "retention-only": 18.0, "pace-refresh": 75.0, "pace-refresh-tail": 75.0,
                  "pace-refresh-window": 75.0, "pace-refresh-h2o": 75.0}
        arms = [a for a in p["arms"].split(",") if a]
        return LOAD_S + p["sessions"] * len(_ints(p["distances"])) * sum(per_kt.get(a, 40.0) * kt + 4 for a in arms)
    if st.name == "residency":
        return LOAD_S + 10 * p["length"] / 1024 * len([a for a in p["arms"].split(",") if a])
    if st.name in ("traces", "fresh_traces"):
        return 4 + 0.02 * p["tasks"] * len(p["envs"].split(","))
    if st.name == "hindsight":
        return 10 + 0.4 * cfg.tasks * n_envs
    if st.name == "train":
        return LOAD_S + 20 + p["steps"] * p["batch_size"] * 7.0 * (p["max_len"] / 1024) ** 1.2
    if st.name == "calibrate":  # the reference, each bias and threshold, each rule: one replay per trace each
        per = -(-p["traces"] // max(1, cfg.workers))
        arms = len(p["biases"].split(",")) + len([c for c in p["confidences"].split(",") if c]) + 2
        return LOAD_S + per * 20 * (arms + 1)
    if st.name == "choose":  # the calibration played every arm: a fit and a choice (else three replays per trace)
        per = -(-p["traces"] // max(1, cfg.workers))
        # the stack: one scored replay per fit trace (~20 s on 2 cores), then its replay of each validation trace
        stack = LOAD_S + p["stack_fit"] * 20 + per * 20 if "stack_fit" in p else 0.0
        return stack + (15.0 if cfg.calibrate_traces else LOAD_S + 10 + per * (12 * 3 + 15))
    if st.name in ("manager", "heldout", "manager_imported"):
        n_arms = len(_manager_arms(cfg).split(","))
        return LOAD_S + 10 + rounds * (12 * (n_arms + 1) + 15)
    if st.name == "serve":
        return LOAD_S + 20
    return 5.0


TIMINGS = "timings.json"


def estimate(st: Stage, cfg: PipelineConfig, history: dict) -> float:
    """The stage's expected wall time: the cost model, scaled by how it fared against this stage's last run here."""
    model = _model_estimate(st, cfg)
    past = history.get(st.name)
    if past and past.get("model_s", 0) > 0 and past.get("wall_s", 0) > 0:
        model *= past["wall_s"] / past["model_s"]
    return model


class StageProgress:
    """What `run_pipeline` reports as stages run (a rich bar in `steward pipeline run`; silent by default)."""

    def start(self, name: str, index: int, total: int, estimate_s: float, log_path: Path | None) -> None: ...

    def finish(self, name: str, wall_s: float, ok: bool) -> None: ...


def run_pipeline(cfg: PipelineConfig, root: Path, log: Callable[[str], None] = print, only: set[str] | None = None,
                 mlflow_log: bool = True, stage_list: list[Stage] | None = None,
                 launcher: list[str] | None = None, progress: StageProgress | None = None) -> dict:
    """Run (or resume) every stage; returns {stage: {"dir", "hash", "cached", "wall_s", "result"}}.
    `stage_list` / `launcher` replace the stages / the `steward` launcher (tests). With `progress`, a stage's stderr
    goes to its folder's `stage.log` (the bar shows its last line) instead of this process's stderr. Writes
    ROOT/pipeline.json (this run's stage folders and MLflow parent run: what `steward report ROOT` reads) and
    ROOT/timings.json (the next run's estimates)."""
    root.mkdir(parents=True, exist_ok=True)
    hashes: dict[str, str] = {}
    dirs: dict[str, Path] = {}
    summary: dict[str, dict] = {}
    history = _read_json(root / TIMINGS)
    parent = _start_parent(cfg, root) if mlflow_log else None
    env = {**os.environ, **({PARENT_ENV: parent} if parent else {})}
    todo = [st for st in (stage_list or stages(cfg)) if not only or st.name in only]
    try:
        for i, st in enumerate(todo):
            missing = [u for u in st.upstream if u not in dirs]
            if missing:
                raise RuntimeError(f"stage {st.name} needs {missing}: do not skip them")
            hashes[st.name] = h = stage_hash(st, hashes)
            out = dirs[st.name] = root / f"{st.name}-{h}"
            done = out / DONE
            if done.exists():
                summary[st.name] = {**json.loads(done.read_text()), "cached": True}
                log(f"stage {st.name}: cached ({out.name})")
                continue
            out.mkdir(parents=True, exist_ok=True)
            args = st.command(out, dirs)
            argv = (launcher or _steward()) + args
            est = estimate(st, cfg, history)
            log(f"stage {st.name}: running (estimate {_mmss(est)}): steward {' '.join(args)}")
            stage_log = out / "stage.log" if progress is not None else None
            if progress is not None:
                progress.start(st.name, i, len(todo), est, stage_log)
            t0, cpu0 = time.perf_counter(), _child_cpu()
            if stage_log is not None:
                with open(stage_log, "w") as err:
                    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            else:
                proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
            wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
            if progress is not None:
                progress.finish(st.name, wall, proc.returncode == 0)
            if proc.returncode != 0:
                tail = "" if stage_log is None else "\n" + "\n".join(
                    _clean(stage_log.read_text(errors="replace")).splitlines()[-25:])
                raise RuntimeError(f"stage {st.name} failed (exit {proc.returncode}); its output folder {out} is "
                                   f"kept, rerun to resume{tail}")
            lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
            result = json.loads(lines[-1]) if st.json_output and lines else {}
            record = {"stage": st.name, "dir": str(out), "hash": h, "params": st.params,
                      "wall_s": wall, "cpu_s": cpu, "estimate_s": est, "result": result}
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2))
            tmp.rename(done)  # atomic: a stage is either finished or not
            summary[st.name] = {**record, "cached": False}
            history[st.name] = {"wall_s": wall, "model_s": _model_estimate(st, cfg)}
            (root / TIMINGS).write_text(json.dumps(history, indent=1))
            log(f"stage {st.name}: done in {record['wall_s']:.0f}s")
    finally:
        if parent:
            _end_parent(summary)
        index = {"stages": {n: r["dir"] for n, r in summary.items()}, "mlflow_run_id": parent,
                 "config": asdict(cfg)}
        (root / "pipeline.json").write_text(json.dumps(index, indent=1))
    return summary


def _child_cpu() -> float:
    """CPU seconds (user + system) of the finished stage processes so far: with `wall_s`, how contended a stage
    ran (on 2 idle cores a model stage uses up to ~2 CPU seconds per second)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _mmss(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _clean(text: str) -> str:
    """A log's text as a reader sees it: carriage-return rewrites resolved, terminal escapes gone."""
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return "\n".join(line.split("\r")[-1] for line in text.split("\n"))


def _start_parent(cfg: PipelineConfig, root: Path) -> str:
    import mlflow

    from kvsteward.train.tracking import ensure_tracking

    ensure_tracking()
    run = mlflow.start_run(run_name="pipeline")
    mlflow.log_params({k: str(v) for k, v in asdict(cfg).items()} | {"root": str(root)})
    return run.info.run_id


def _end_parent(summary: dict) -> None:
    import mlflow

    for name, rec in summary.items():
        mlflow.log_metric(f"{name}.wall_s", rec.get("wall_s", 0.0))
        mlflow.log_dict(rec, f"stages/{name}.json")
    mlflow.end_run()
    attach_to_adapter_run(summary)


EVALUATIONS = ("calibrate", "choose", "manager", "heldout", "manager_imported")


def attach_to_adapter_run(summary: dict) -> str | None:
    """The registered adapter's training run gets what a reader of the model needs beside the weights: the dataset
    card (with its shortcut audit) and every evaluation of this pipeline, as artifacts under `card/` and
    `evaluation/`. Returns the run id (None without a tracked training run)."""
    import mlflow

    run_id = summary.get("train", {}).get("result", {}).get("mlflow_run_id")
    if not run_id:
        return None
    client = mlflow.MlflowClient()
    card = Path(summary.get("hindsight", {}).get("dir", "")) / "ds" / "card.json"
    if card.is_file():
        client.log_artifact(run_id, str(card), "card")
        client.log_artifact(run_id, str(card.with_name("README.md")), "card")
    for name in EVALUATIONS:
        if name in summary:
            client.log_dict(run_id, summary[name]["result"], f"evaluation/{name}.json")
    chosen = summary.get("choose", {}).get("result", {})
    if chosen.get("manager_dir") and Path(chosen["manager_dir"]).is_dir():  # the served manager beside the weights
        client.log_artifacts(run_id, chosen["manager_dir"], "manager")
        client.set_tag(run_id, "kvsteward.served_manager", chosen["choice"])
    return run_id
