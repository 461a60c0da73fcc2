"""Agent environments: seeded generators of correct traces with exact provenance, one module per environment.

| name | module | what the agent does |
|---|---|---|
| `templated` | `synth.traces.generate` | the original research generator: one fixed sentence per act (a shortcut audit
baseline) |
| `research` | `synth.traces.envs.research` | multi-hop questions over a fictional encyclopedia (search / open) |
| `ops` | `synth.traces.envs.ops` | a data / operations agent: services, metrics, logs, deploys, alerts |
| `support` | `synth.traces.envs.support` | a support agent: tickets, customers, orders, a knowledge base |

Each generator is deterministic in (seed, task index), assigns splits by task index (8:1:1) and keeps every entity
name of one split out of the others. `generate(env, n_tasks, seed, options)` is the one entry point.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kvsteward.synth.traces.trace import Trace


@dataclass(frozen=True)
class EnvSpec:
    name: str
    module: str  # imported on first use: every generator stays out of the CLI's start-up
    summary: str

    def load(self):
        return importlib.import_module(self.module)


ENVS: dict[str, EnvSpec] = {s.name: s for s in (
    EnvSpec("templated", "kvsteward.synth.traces.envs.templated", "the original research generator (templated notes)"),
    EnvSpec("research", "kvsteward.synth.traces.envs.research", "multi-hop research over a fictional encyclopedia"),
    EnvSpec("ops", "kvsteward.synth.traces.envs.ops", "data / operations agent: services, metrics, logs, deploys"),
    EnvSpec("support", "kvsteward.synth.traces.envs.support", 
            "support agent: tickets, customers, orders, knowledge base"),
)}


def env_names(text: str) -> list[str]:
    """A comma-separated environment list, checked against the registry (order kept, duplicates refused)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENVS]
    if not names or unknown:
        raise ValueError(f"unknown environment(s) {unknown or text!r}: choose from {', '.join(ENVS)} "
                         "(or longsession, alone)")
    if len(set(names)) != len(names):
        raise ValueError(f"environment listed twice in {text!r}")
    return names


def options_type(env: str) -> type:
    """The environment's options dataclass (every field has a default; `validate()` checks values)."""
    return ENVS[env].load().Options


def make_options(env: str, values: dict[str, Any]) -> Any:
    """The environment's options from `values`, ignoring names it does not have (shared CLI flags)."""
    cls = options_type(env)
    known = {f.name for f in fields(cls)}
    opts = cls(**{k: v for k, v in values.items() if k in known})
    opts.validate()
    return opts


def generate(env: str, n_tasks: int, seed: int, options: Any | None = None,
             progress: Callable[[int], None] | None = None) -> list[Trace]:
    """`n_tasks` correct traces of `env` (task i: split `generate.split_of(i)`, seed derived from (seed, env, i))."""
    if env not in ENVS:
        raise ValueError(f"unknown environment {env!r}: choose from {', '.join(ENVS)}")
    if n_tasks < 1:
        raise ValueError(f"--tasks must be at least 1, got {n_tasks}")
    mod = ENVS[env].load()
    opts = options if options is not None else mod.Options()
    opts.validate()
    traces = mod.generate(n_tasks, seed, opts, progress)
    for t in traces:
        if t.env != env:
            raise AssertionError(f"{env} generator wrote a trace tagged {t.env!r}")
    return traces


def generation_meta(env: str, n_tasks: int, seed: int, options: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {"generator": ENVS[env].module, "env": env, "tasks": n_tasks, "seed": seed, "config": asdict(options),
            "label_source": "oracle"}
