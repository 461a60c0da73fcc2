"""The manager evaluation's non-model arms: the cheap baselines and an attention-mass rule, on the same decisions.

Every arm of `eval.manager.evaluate.play` decides at the same boundaries of the same replays as the learned manager:
- model arms (`(use_adapter, close_bias, min_confidence)` tuples): the aux thread as served (`serve.manager`);
- `RuleArm`: a fitted `synth.traces.baselines.Baseline` (delete_all_read, keep_last_k, text_classifier, lexical_overlap,
  structure) reading the visible context (`Baseline.decide_at`), fitted on the dataset's train split;
- `AttentionArm`: H2O's signal per tool response: the attention the main thread paid to its tokens (cumulative
  attention per token, per later query, averaged over the response; `attention_mass`), a response deleted when that
  mass is below a threshold chosen on validation replays (`fit_attention_threshold`). Its replay collects scores
  (`SESSION`), which never evicts: the replay is the same uncompressed main thread apart from what the arm drops.
Unread responses are never decisions (`keep_unread`): no arm may delete them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from kvsteward.serve.manager.decode import AuxDecision, rule_decision
from kvsteward.serve.manager.rule import RuleManager
from kvsteward.synth.traces.baselines import SAFE_HARMFUL, Baseline, choose, sweep
from kvsteward.synth.traces.hindsight import boundaries, expired, unread_cursors
from kvsteward.synth.traces.trace import Trace

# A session that collects H2O's cumulative attention and never evicts (a budget no trace reaches).
SESSION = {"policy": "h2o", "budget": 1 << 40}
ARM_NAMES = ("base", "delete_all_read", "keep_last_k", "text_classifier", "lexical_overlap", "structure",
             "attention_mass", "adapter", "stack")  # stack: `eval.manager.stack`, on the per-response adapter
RULES = ("delete_all_read", "keep_last_k", "text_classifier", "lexical_overlap", "structure")


@dataclass
class RuleArm:
    """A fitted cheap baseline as an arm, at an operating point of its fit (`f1`: best train F1; `safe`: best F1
    with <= 2 % harmful deletions on train)."""

    name: str
    baseline: Baseline
    point: str = "f1"
    session: dict = field(default_factory=dict)  # the replay's session: the plain uncompressed one

    @property
    def key(self) -> str:
        """What it computes (for journals): the rule, its point, and a digest of its fitted setting."""
        setting = json.dumps(self.baseline.points, sort_keys=True, default=str)
        return f"rule {self.name} at {self.point} ({hashlib.sha256(setting.encode()).hexdigest()[:10]})"

    @cached_property
    def served(self) -> RuleManager:
        """What a server with this rule runs (built on first use: also in a worker the arm was pickled to)."""
        return RuleManager(self.name, self.baseline, self.point)

    def decide(self, session, messages: list[dict], open_cursors: list[int]) -> AuxDecision:
        return self.served.decide(messages, open_cursors)


def attention_mass(session, open_cursors: list[int]) -> dict[int, float]:
    """Per open cursor: the mean over its resident tokens of the cumulative attention a token received divided by the
    queries that could see it (tokens appended after it), so an old response is not favoured by its age."""
    t = session.table
    step, logical, cum = t.field("step"), t.field("logical"), t.field("cumulative").double()
    later = (session.n_logical - 1 - logical).clamp(min=1).double()
    per_token = cum / later
    out = {}
    for c in open_cursors:
        sel = step == c
        out[c] = float(per_token[sel].mean()) if bool(sel.any()) else 0.0
    return out


@dataclass
class AttentionArm:
    """Delete the read responses whose attention mass is at or below `threshold` (None: delete nothing)."""

    threshold: float | None
    name: str = "attention_mass"
    session: dict = field(default_factory=lambda: dict(SESSION))

    @property
    def key(self) -> str:
        return f"attention mass at threshold {self.threshold if self.threshold is None else float(self.threshold)!r}"

    def decide(self, session, messages: list[dict], open_cursors: list[int]) -> AuxDecision:
        if self.threshold is None:
            return rule_decision(set())
        unread = set(unread_cursors(messages))
        read = [c for c in open_cursors if c not in unread]
        mass = attention_mass(session, read)
        return rule_decision({c for c in read if mass[c] <= self.threshold})


def attention_decisions(engine, trace: Trace, every: int) -> list[tuple[float, bool]]:
    """(attention mass, expired) of every read cursor at every boundary of one replay without deletions: what
    `fit_attention_threshold` chooses its threshold on."""
    from kvsteward.synth.chat import message_token_ids

    msgs = trace.messages[:-1]
    cuts = set(boundaries(trace, every))
    s = engine.session(chunk=512, **SESSION)
    out = []
    pieces = message_token_ids(engine.tokenizer, msgs)
    for i in range(len(msgs) + 1):  # boundary i is before message i; the last one before the final answer
        if i in cuts:
            unread = set(unread_cursors(msgs[:i]))
            read = [c for c in trace.cursors() if c < i and c not in unread]
            gone = set(expired(trace, i))
            out += [(m, c in gone) for c, m in attention_mass(s, read).items()]
        if i < len(msgs):
            s.append(pieces[i], kind=msgs[i]["role"])
    return out


def fit_attention_threshold(engine, traces: Sequence[Trace], every: int, point: str = "f1",
                            progress: Callable[[str], None] | None = None) -> dict:
    """The attention-mass threshold with the best F1 (`point="safe"`: the best F1 with <= 2 % harmful deletions) on
    `traces` (validation traces: never the ones reported), from replays without deletions. Deleting = mass <=
    threshold, so the score is the negated mass."""
    pairs = []
    for n, t in enumerate(traces, start=1):
        pairs += attention_decisions(engine, t, every)
        if progress:
            progress(f"attention mass: fit replay {n}/{len(traces)} ({t.task_id})")
    if not pairs:
        raise ValueError("no read cursor at any boundary of the fit traces: nothing to choose a threshold on")
    mass = np.array([m for m, _ in pairs])
    labels = np.array([y for _, y in pairs])
    scores = -mass
    grid = sorted(set(np.quantile(scores, np.linspace(0, 1, 101)).tolist()) | {float(scores.max()) + 1.0})
    rows = sweep(scores, labels, grid)
    chosen = choose(rows, SAFE_HARMFUL if point == "safe" else None)
    # None: no threshold meets the point (or the best one deletes nothing): the arm deletes nothing
    threshold = None if chosen is None or chosen["tp"] + chosen["fp"] == 0 else -float(chosen["threshold"])
    return {"threshold": threshold, "point": point, "fit_decisions": len(pairs), "fit_traces": len(traces),
            "fit": None if chosen is None else {k: v for k, v in chosen.items() if k != "threshold"}}
