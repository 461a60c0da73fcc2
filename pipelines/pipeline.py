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
    model: str = "smollm2"
    tasks: int = 24
    seed: int = 0
    page_words: int = 160
    doc_words: int = 240
    max_hops: int = 6
    every: int = 4
    plan: bool = True
    trigger: str = "ids"  # `steward synth hindsight --trigger` (the adapter records it; serving follows)
    train_steps: int = 30
    max_len: int = 1024
    rank: int = 8
    lr: float = 3e-4
    batch_size: int = 2
    top_layers: int = 0
    adapter_scope: str = "all"  # `steward train lora --adapter-scope`
    train_minutes: float = 0.0
    manager_traces: int = 3
    bench_length: int = 4096
    bench_distances: str = "512,3000"
    bench_sessions: int = 1
    bench_arms: str = "h2o,pace"
    budget: int = 512
    chunk: int = 256
    limit: int = 1024
    extra: dict = field(default_factory=dict)


@dataclass
class Stage:
    name: str
    params: dict
    upstream: list[str]
    command: Callable[[Path, dict[str, Path]], list[str]]  # (out dir, upstream dirs) → `steward` arguments
    json_output: bool = True


def stages(cfg: PipelineConfig) -> list[Stage]:
    m = cfg.model
    return [
        Stage("traces", {"tasks": cfg.tasks, "seed": cfg.seed, "page_words": cfg.page_words,
                         "doc_words": cfg.doc_words, "max_hops": cfg.max_hops}, [],
              lambda out, up: ["synth", "traces", "--tasks", str(cfg.tasks), "--seed", str(cfg.seed), "--page-words",
                               str(cfg.page_words), "--doc-words", str(cfg.doc_words), "--max-hops",
                               str(cfg.max_hops), "--out", str(out), "--json"]),
        # rows are capped at the training length, so every row the annotator keeps is trainable
        Stage("hindsight", {"every": cfg.every, "max_tokens": cfg.max_len, "plan": cfg.plan, "model": m,
                            "trigger": cfg.trigger}, ["traces"],
              lambda out, up: ["synth", "hindsight", str(up["traces"]), "--every", str(cfg.every), "--max-tokens",
                               str(cfg.max_len), "--plan" if cfg.plan else "--no-plan", "--model", m, "--trigger",
                               cfg.trigger, "--out", str(out / "ds"), "--json"]),
        Stage("train", {"steps": cfg.train_steps, "max_len": cfg.max_len, "rank": cfg.rank, "lr": cfg.lr, "model": m,
                        "batch_size": cfg.batch_size, "top_layers": cfg.top_layers, "minutes": cfg.train_minutes,
                        "adapter_scope": cfg.adapter_scope},
              ["hindsight"],
              lambda out, up: ["train", "lora", "--model", m, "--data", str(up["hindsight"] / "ds"), "--max-steps",
                               str(cfg.train_steps), "--max-len", str(cfg.max_len), "--rank", str(cfg.rank),
                               "--lr", str(cfg.lr), "--batch-size", str(cfg.batch_size), "--top-layers",
                               str(cfg.top_layers), "--max-minutes", str(cfg.train_minutes), "--adapter-scope",
                               cfg.adapter_scope, "--out", str(out),
                               "--resume", "--json"]),
        Stage("manager", {"traces": cfg.manager_traces, "every": cfg.every, "model": m}, ["hindsight", "train"],
              lambda out, up: ["eval", "manager", "--model", m, "--adapter", _adapter(up["train"]), "--data",
                               str(up["hindsight"] / "ds"), "--every", str(cfg.every), "--limit",
                               str(cfg.manager_traces), "--journal", str(out / "traces.jsonl"), "--json"]),
        Stage("longsession", {"length": cfg.bench_length, "distances": cfg.bench_distances, "arms": cfg.bench_arms,
                              "sessions": cfg.bench_sessions, "budget": cfg.budget, "chunk": cfg.chunk,
                              "limit": cfg.limit, "model": m}, [],
              lambda out, up: ["eval", "longsession", "--model", m, "--arms", cfg.bench_arms, "--length",
                               str(cfg.bench_length), "--distances", cfg.bench_distances, "--sessions",
                               str(cfg.bench_sessions), "--budget", str(cfg.budget), "--chunk", str(cfg.chunk),
                               "--limit", str(cfg.limit), "--no-code", "--out", str(out), "--json"]),
    ]


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
