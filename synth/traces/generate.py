"""Generate N correct traces: task i gets a seed derived from (seed, i) and a split fixed by i (8:1:1), and is
sampled from and solved in that split's world — so no task, entity or document is shared between splits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from kvsteward.synth.rng import mix, rng
from kvsteward.synth.traces.solver import Solver, TraceConfig
from kvsteward.synth.traces.tasks import sample_task
from kvsteward.synth.traces.trace import Trace
from kvsteward.synth.traces.world import build_worlds

_SPLIT_CYCLE = ("train",) * 8 + ("validation", "test")


def split_of(index: int) -> str:
    return _SPLIT_CYCLE[index % len(_SPLIT_CYCLE)]


def generate_traces(n_tasks: int, seed: int, cfg: TraceConfig | None = None,
                    progress: Callable[[int], None] | None = None) -> list[Trace]:
    cfg = cfg or TraceConfig()
    cfg.validate()
    if n_tasks < 1:
        raise ValueError(f"--tasks must be at least 1, got {n_tasks}")
    worlds = build_worlds(seed, cfg.world_size, cfg.twin_rate, cfg.doc_words)
    traces = []
    for i in range(n_tasks):
        split = split_of(i)
        task_seed = mix(seed, "task", i)
        r = rng(task_seed)
        world = worlds[split]
        task = sample_task(world, r, cfg.min_hops, cfg.max_hops, cfg.compare_rate, cfg.recap_rate)
        solver = Solver(world, cfg, r)
        solver.solve(task)
        t = Trace(task_id=f"s{seed}-t{i:05d}", split=split, messages=solver.messages, reads=solver.reads,
                  label_source="oracle", task_seed=task_seed, question=task.question, answer=task.answer,
                  kind=task.kind, hops=task.hops, docs=sorted(solver.docs),
                  entities=sorted(world.name(d) for d in solver.docs))
        t.validate()
        traces.append(t)
        if progress:
            progress(i + 1)
    return traces


def generation_meta(n_tasks: int, seed: int, cfg: TraceConfig) -> dict:
    return {"generator": "kvsteward.synth.traces.generate", "tasks": n_tasks, "seed": seed, "config": asdict(cfg),
            "label_source": "oracle"}
