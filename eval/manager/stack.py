"""The stacked manager: the structure classifier's features plus the per-response adapter's reading of the session.

Does the small model's reading add anything to structure? The `stack` rule (`synth.traces.baselines.
StackClassifier`) answers it on the same decisions as `structure`: the same trees with one more column, the adapter's
P(no) for the response. Here the model side:

- `model_scores`: P(no) of every read open response at a boundary, by the served per-response decision itself
  (`serve.manager.thread.run_aux` on a shared fork of the main session, the adapter on): what a served stack reads;
- `scored_decisions`: the uncompressed decisions of a trace (as `decisions_from_trace`: nothing deleted before, the
  rules' one fit) with their scores, from one replay of the trace;
- `fit_stack`: the head fitted on the train traces' scored decisions (thresholds on trace-grouped out-of-fold
  scores, as every fitted rule);
- `StackArm`: the head as an evaluation arm, deciding on the replay's own session (its earlier deletions applied)
  through the served `serve.manager.stack.StackManager`.

The engine must carry the per-response (`scores` trigger) adapter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsteward.serve.manager.decode import AuxDecision, drive, rule_decision
from kvsteward.serve.manager.stack import StackManager, with_scores
from kvsteward.serve.manager.thread import run_aux
from kvsteward.synth.traces.baselines import StackClassifier
from kvsteward.synth.traces.decisions import Decision, decisions_at
from kvsteward.synth.traces.hindsight import expired
from kvsteward.synth.traces.trace import Trace


class StackError(ValueError):
    """The stack cannot be fitted or played (no per-response adapter, no decision to fit on)."""


def check_scores_engine(engine) -> None:
    if not engine.is_peft or engine.trigger_style != "scores":
        raise StackError("the stack reads a per-response adapter's P(no): load the engine with an adapter trained "
                         f"on the scores trigger (this engine: adapter {engine.is_peft}, trigger "
                         f"{engine.trigger_style!r})")


def model_scores(session, messages: list[dict], open_cursors: list[int]) -> dict[int, float]:
    """Read open cursor → the adapter's P(no) at the boundary after `messages`, as the served decision computes it
    (a shared fork of `session`, the adapter on, the scores trigger); empty when nothing is read."""
    d = run_aux(session, session.engine.tokenizer, messages, open_cursors, use_adapter=True)
    return dict(d.confidence or {})


def scored_decisions(engine, trace: Trace, every: int) -> list[Decision]:
    """The decisions of `trace` at its `every`-th boundaries with nothing deleted before, labelled by hindsight,
    each with the adapter's P(no) read on the replay's uncompressed session."""
    from kvsteward.eval.manager.evaluate import Tally, replay

    out: list[Decision] = []

    def collect(session, messages: list[dict], open_cursors: list[int]) -> AuxDecision:
        b = len(messages)
        decisions = decisions_at(messages, open_cursors, b, set(expired(trace, b)).__contains__, trace.task_id,
                                 trace.env, trace.cues)
        if decisions:
            out.extend(with_scores(decisions, model_scores(session, messages, open_cursors)))
        return rule_decision([])  # delete nothing: every later boundary sees all earlier cursors open

    replay(engine, trace, every, collect, Tally())
    return out


def fit_stack(engine, traces: Sequence[Trace], every: int,
              progress: Callable[[str], None] | None = None) -> tuple[StackClassifier, list[Decision]]:
    """The stacked head fitted on the scored decisions of `traces` (the train split); returns it and the
    decisions."""
    check_scores_engine(engine)
    decisions: list[Decision] = []
    for i, t in enumerate(traces):
        decisions += scored_decisions(engine, t, every)
        if progress:
            progress(f"stack fit: scored {i + 1}/{len(traces)} train traces ({len(decisions)} decisions)")
    if not decisions:
        raise StackError(f"no read tool response at any {every}-th boundary of the {len(traces)} fit traces")
    return StackClassifier().fit(decisions), decisions


@dataclass
class StackArm:
    """The stacked head as an evaluation arm (an `eval.manager.arms` rule arm that reads the model): at each
    boundary the structural decisions of the visible context, the adapter's P(no) on the replay's session, the
    head's deletion at its operating point."""

    head: StackClassifier
    point: str = "f1"
    record: dict = field(default_factory=dict)  # where the head comes from (fit size, points): reported, not keyed
    name: str = "stack"
    session: dict = field(default_factory=dict)  # the replay's plain uncompressed session

    @property
    def key(self) -> str:
        setting = json.dumps(self.head.points, sort_keys=True, default=str)
        return f"stack at {self.point} ({hashlib.sha256(setting.encode()).hexdigest()[:10]})"

    def decide(self, session, messages: list[dict], open_cursors: list[int]) -> AuxDecision:
        fork = session.fork(shared=True)  # as `run_aux`: the main K/V read in place, the adapter on
        fork.config.use_adapter = True
        return drive(StackManager(self.head, self.point).steps(fork, session.engine.tokenizer, messages,
                                                                open_cursors))
