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
    confidences: str = "0.8,0.9"
    max_harm: float = 0.02
    manager_traces: int = 10  # per test set (in-distribution, held-out environment, imported)
    attention_fit: int = 6
    workers: int = 1
    bench_length: int = 4096
    bench_distances: str = "512,3000"
    bench_sessions: int = 1
    bench_arms: str = "h2o,pace"
    budget: int = 512
    chunk: int = 256
    limit: int = 1024
    extra: dict = field(default_factory=dict)

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


def _calibrate_stage(cfg: PipelineConfig) -> Stage:
    # chosen on the validation traces of the training environments: never on a test set
    params = {"traces": cfg.calibrate_traces, "every": cfg.every, "biases": cfg.biases,
              "confidences": cfg.confidences, "max_harm": cfg.max_harm, "envs": cfg.train_envs()}
    return Stage("calibrate", params, ["hindsight", "train"], lambda out, up: [
        "eval", "calibrate", "--model", cfg.model, "--adapter", _adapter(up["train"]), "--data",
        str(up["hindsight"] / "ds"), "--split", "validation", "--env", ",".join(cfg.train_envs()), "--every",
        str(cfg.every), "--limit", str(cfg.calibrate_traces), "--biases", cfg.biases, "--confidences",
        cfg.confidences, "--max-harm", str(cfg.max_harm), "--min-f1", "0", "--workers", str(cfg.workers),
        "--journal", str(out / "traces.jsonl"), "--json"])


def _manager_stage(cfg: PipelineConfig, name: str, upstream: list[str], which: dict,
                   test_args: Callable[[dict[str, Path]], list[str]]) -> Stage:
    """One test set of `steward eval manager`: every arm on the same traces (the adapter as calibrated)."""
    params = {"traces": cfg.manager_traces, "every": cfg.every, "model": cfg.model, "attention_fit": cfg.attention_fit,
              **which}
    return Stage(name, params, upstream, lambda out, up: [
        "eval", "manager", "--model", cfg.model, "--adapter", _adapter(up["train"]), "--data",
        str(up["hindsight"] / "ds"), *test_args(up), "--every", str(cfg.every), "--limit", str(cfg.manager_traces),
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


def stages(cfg: PipelineConfig) -> list[Stage]:
    m = cfg.model
    train_envs = ",".join(cfg.train_envs())
    out = [_traces_stage(cfg), _hindsight_stage(cfg), _train_stage(cfg)]
    tested = ["hindsight", "train"]
    if cfg.calibrate_traces:
        out.append(_calibrate_stage(cfg))
        tested.append("calibrate")
    out.append(_manager_stage(cfg, "manager", tested, {"set": "test", "envs": train_envs},
                              lambda up: ["--split", "test", "--env", train_envs]))
    if cfg.holdout_env:
        out.append(_manager_stage(cfg, "heldout", tested, {"set": "heldout", "env": cfg.holdout_env},
                                  lambda up: ["--split", "test", "--env", cfg.holdout_env]))
    out += _import_stages(cfg)
    out.append(_manager_stage(cfg, "manager_imported", [*tested, "imported"], {"set": "imported"},
                              lambda up: ["--traces", str(up["imported"]), "--split", "all"]))
    out.append(Stage("longsession", {"length": cfg.bench_length, "distances": cfg.bench_distances,
                                     "arms": cfg.bench_arms, "sessions": cfg.bench_sessions, "budget": cfg.budget,
                                     "chunk": cfg.chunk, "limit": cfg.limit, "model": m}, [],
                     lambda out, up: ["eval", "longsession", "--model", m, "--arms", cfg.bench_arms, "--length",
                                      str(cfg.bench_length), "--distances", cfg.bench_distances, "--sessions",
                                      str(cfg.bench_sessions), "--budget", str(cfg.budget), "--chunk",
                                      str(cfg.chunk), "--limit", str(cfg.limit), "--no-code", "--out", str(out),
                                      "--json"]))
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


def run_pipeline(cfg: PipelineConfig, root: Path, log: Callable[[str], None] = print, only: set[str] | None = None,
                 mlflow_log: bool = True, stage_list: list[Stage] | None = None,
                 launcher: list[str] | None = None) -> dict:
    """Run (or resume) every stage; returns {stage: {"dir", "hash", "cached", "wall_s", "result"}}.
    `stage_list` / `launcher` replace the stages / the `steward` launcher (tests)."""
    root.mkdir(parents=True, exist_ok=True)
    hashes: dict[str, str] = {}
    dirs: dict[str, Path] = {}
    summary: dict[str, dict] = {}
    parent = _start_parent(cfg, root) if mlflow_log else None
    env = {**os.environ, **({PARENT_ENV: parent} if parent else {})}
    try:
        for st in stage_list or stages(cfg):
            if only and st.name not in only:
                continue
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
            log(f"stage {st.name}: running: steward {' '.join(args)}")
            t0 = time.perf_counter()
            proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"stage {st.name} failed (exit {proc.returncode}); its output folder {out} is "
                                   "kept, rerun to resume")
            lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
            result = json.loads(lines[-1]) if st.json_output and lines else {}
            record = {"stage": st.name, "dir": str(out), "hash": h, "params": st.params,
                      "wall_s": time.perf_counter() - t0, "result": result}
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2))
            tmp.rename(done)  # atomic: a stage is either finished or not
            summary[st.name] = {**record, "cached": False}
            log(f"stage {st.name}: done in {record['wall_s']:.0f}s")
    finally:
        if parent:
            _end_parent(summary)
    return summary


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


EVALUATIONS = ("calibrate", "manager", "heldout", "manager_imported")


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
    return run_id
