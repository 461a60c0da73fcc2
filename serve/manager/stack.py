"""The stacked manager as served: the per-response adapter reads the session, a fitted head decides.

`StackManager` = a `synth.traces.baselines.StackClassifier` (the structure classifier's trees with the adapter's
P(no) as one more column) at an operating point. A decision is the served per-response forward on the fork
(`thread.aux_steps` with a `scores` adapter: the trigger, every open response's P(no)), then the head over each read
open response's structural features and that P(no) (`synth.traces.decisions.decisions_at`). Nothing read: no
forward. The evaluation's `stack` arm (`eval.manager.stack.StackArm`) decides through it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace

from kvsteward.serve.manager.decode import AuxDecision, rule_decision
from kvsteward.serve.manager.thread import aux_steps
from kvsteward.synth.traces.baselines import POINTS, StackClassifier
from kvsteward.synth.traces.decisions import Decision, decisions_at


def with_scores(decisions: list[Decision], p_no: dict[int, float]) -> list[Decision]:
    """The decisions with the adapter's P(no) of their cursor as the stack's model column."""
    return [replace(d, model_score=p_no[d.cursor]) for d in decisions]


@dataclass
class StackManager:
    head: StackClassifier
    point: str = "f1"
    name: str = "stack"
    needs_model: bool = True  # the worker forks with the adapter on and passes the fork (a rule needs neither)

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"stack: operating point must be one of {POINTS}, got {self.point!r}")

    def steps(self, fork, tokenizer, messages: list[dict],
              open_cursors: list[int]) -> Generator[None, None, AuxDecision]:
        """The decision on `fork` (a fork of the main session, the per-response adapter on) as aux steps."""
        if fork.engine.trigger_style != "scores":
            raise ValueError("the stack reads a per-response adapter's P(no): serve it with an adapter trained on "
                             f"the scores trigger (this engine's: {fork.engine.trigger_style!r})")
        if not decisions_at(messages, open_cursors, len(messages)):
            return rule_decision([])
        read = yield from aux_steps(fork, tokenizer, messages, open_cursors, keep_unread=True)
        return self.decide_with(messages, open_cursors, read.confidence or {})

    def decide_with(self, messages: list[dict], open_cursors: list[int], p_no: dict[int, float]) -> AuxDecision:
        """The head's decision given the adapter's P(no) of every read open response (the engine's fork above, or
        SGLang's request: `serve.sglang.manager.SglangManager.scores_decision`)."""
        scored = with_scores(decisions_at(messages, open_cursors, len(messages)), p_no)
        out = rule_decision(self.head.delete(scored, self.point) if scored else [])
        out.confidence = {d.cursor: d.model_score for d in scored}
        return out
