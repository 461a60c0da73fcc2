"""The original research generator (`synth.traces.generate`, `synth.traces.solver`): one fixed sentence per act.

Kept as an environment so the shortcut audit has its reference point: on its traces a bag-of-words classifier over
the notes reads every hindsight label off the template strings (`steward synth audit`)."""

from __future__ import annotations

from collections.abc import Callable

from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.solver import TraceConfig as Options
from kvsteward.synth.traces.trace import Trace

__all__ = ["Options", "generate"]


def generate(n_tasks: int, seed: int, options: Options, progress: Callable[[int], None] | None = None) -> list[Trace]:
    traces = generate_traces(n_tasks, seed, options, progress)
    for t in traces:
        t.env = "templated"
    return traces
