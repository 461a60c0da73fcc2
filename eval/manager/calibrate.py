"""Choose the aux thread's close bias on held-out traces, and record it with the adapter (`steward eval calibrate`).

The close bias (nats added to closing the deletion list: `serve.manager.decode._constrained_steps`) trades recall for
precision: a higher bias lists a prefix of what a lower one lists, so fewer deletions and fewer harmful ones. Which
bias meets a harm target depends on the adapter (three seeds of one configuration differed threefold in harm at bias
0), so it is chosen per adapter — on the validation split: choosing it on the test split would report the selection,
not the manager. The choice goes into the adapter's `kvsteward.json` (`close_bias`, with the `calibration` record),
where
`Engine.load` reads it as the serving default; `steward serve --aux-close-bias` and `steward eval manager
--close-bias` still override it.

The other knob is the confidence rule (`serve.manager.decode._confident_steps`, `--aux-min-confidence`): delete only
the ids the manager lists with probability >= a threshold. `--confidences` adds one arm per threshold (at close bias
0) to the sweep; the choice is made among all arms, and both knobs are recorded (`close_bias`, `min_confidence`: None
when a greedy arm wins).

Each arm is the adapter arm of `eval.manager.evaluate` (the aux thread exactly as served), all against one uncompressed
replay per trace (`eval.manager.evaluate.play`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvsteward.eval.manager.evaluate import play, reference, summarize
from kvsteward.serve.engine import Engine
from kvsteward.synth.traces.trace import Trace


def check_biases(biases: list[float]) -> list[float]:
    """The sweep's biases, ascending and distinct; refused by name when empty or not finite."""
    if not biases:
        raise ValueError("calibration needs at least one close bias")
    bad = [b for b in biases if not math.isfinite(b)]
    if bad:
        raise ValueError(f"close biases must be finite numbers of nats, got {bad}")
    return sorted(set(biases))


def check_confidences(confidences: list[float]) -> list[float]:
    """The sweep's confidence thresholds, ascending and distinct, each a probability in (0, 1]."""
    bad = [c for c in confidences if not 0.0 < c <= 1.0]
    if bad:
        raise ValueError(f"confidences must be probabilities in (0, 1], got {bad}")
    return sorted(set(confidences))


def arm_name(bias: float) -> str:
    return f"bias {bias:g}"


def confidence_arm(confidence: float) -> str:
    return f"confidence {confidence:g}"


def sweep(engine: Engine, traces: list[Trace], biases: list[float], every: int = 4, max_aux_tokens: int = 48,
          keep_unread: bool = True, progress: Callable[[str], None] | None = None,
          confidences: list[float] = (), rules: dict | None = None, **parallel) -> dict:
    """The adapter as memory manager at every close bias (greedy), and under the confidence rule at every threshold
    of `confidences` (close bias 0), each scored as `eval.manager.evaluate.evaluate` scores its adapter arm:
    `{"by_bias": {bias: summary}, "by_confidence": {threshold: summary}, "uncompressed": {...}, ...}`. `rules`
    (name → `eval.manager.arms` rule arm) are played on the same replays too (`"rules": {name: summary}`): what
    `steward eval choose` compares the adapter with, so the choice needs no second pass over the traces.
    `parallel`: `workers`, `engine_factory`, `journal`, `journal_key` of `eval.manager.evaluate.play`."""
    biases = check_biases(biases)
    confidences = check_confidences(list(confidences))
    rules = rules or {}
    arms = {arm_name(b): (True, b, None) for b in biases} | {confidence_arm(c): (True, 0.0, c) for c in confidences}
    tallies = play(engine, traces, every, arms | rules, max_aux_tokens=max_aux_tokens, progress=progress,
                   keep_unread=keep_unread, **parallel)
    ref = tallies["uncompressed"]
    return {"by_bias": {b: summarize(tallies[arm_name(b)], ref) for b in biases},
            "by_confidence": {c: summarize(tallies[confidence_arm(c)], ref) for c in confidences},
            "rules": {name: summarize(tallies[name], ref) for name in rules},
            "uncompressed": reference(ref), "task_ids": [t.task_id for t in traces],
            "n_traces": len(traces), "every": every, "keep_unread": keep_unread, "aux_context": engine.aux_context}


@dataclass(frozen=True)
class Choice:
    close_bias: float
    met: bool  # the chosen arm meets both targets
    reason: str
    min_confidence: float | None = None  # the confidence rule's threshold when a confidence arm won

    @property
    def name(self) -> str:
        return arm_name(self.close_bias) if self.min_confidence is None else confidence_arm(self.min_confidence)


def _harm(summary: dict) -> float:
    # no deletion harms nothing (its harmful_rate is NaN: 0 / 0)
    return summary["harmful"] / summary["deleted"] if summary["deleted"] else 0.0


def choose(by_bias: dict[float, dict], max_harm: float, min_f1: float,
           by_confidence: dict[float, dict] | None = None) -> Choice:
    """The arm to serve (a greedy close bias, or a confidence threshold at bias 0): among those with harmful rate <=
    `max_harm` and F1 >= `min_f1`, the highest F1 (a tie: the lower bias, then greedy, then the lower threshold:
    the one that deletes more). When none meets both, the lowest harmful rate among those that keep F1 >= `min_f1`
    (among all when none does; a tie: the higher F1), and `met` is False: the target is not reached.

    An arm that deletes nothing on the sweep is never chosen while another deletes something: it is no decode rule
    for a manager (its harm is 0 / 0), and choosing it would serve a manager that never acts, which an operator can
    have by not running one."""
    arms = [(b, None, s) for b, s in by_bias.items()] + [(0.0, c, s) for c, s in (by_confidence or {}).items()]
    if not arms:
        raise ValueError("nothing to choose from: no bias was measured")
    if not (acting := [a for a in arms if a[2]["deleted"]]):
        b, c, s = min(arms, key=lambda a: (a[1] is not None, a[0], a[1] or 0.0))
        return Choice(b, False, "no arm deletes anything on these traces", c)
    arms = acting
    ok = [a for a in arms if _harm(a[2]) <= max_harm and a[2]["f1"] >= min_f1]
    if ok:
        b, c, s = max(ok, key=lambda a: (a[2]["f1"], -a[0], -(a[1] or 0.0)))
        return Choice(b, True, f"highest F1 ({s['f1']:.3f}) with harmful rate <= {max_harm:g}", c)
    pool = [a for a in arms if a[2]["f1"] >= min_f1] or arms
    b, c, s = min(pool, key=lambda a: (_harm(a[2]), -a[2]["f1"], a[0], a[1] or 0.0))
    keeps = "" if s["f1"] >= min_f1 else f" (no arm keeps F1 >= {min_f1:g})"
    return Choice(b, False, f"no arm has harmful rate <= {max_harm:g} and F1 >= {min_f1:g}: the lowest harmful "
                            f"rate ({_harm(s):.3f}){keeps}", c)


def _brief(summary: dict) -> dict:
    """What the calibration record keeps of an arm's summary."""
    return {"harmful_rate": _harm(summary)} | {k: summary[k] for k in (
        "f1", "precision", "recall", "deleted", "harmful", "harmful_rate_ci95", "answer_acc_delta") if k in summary}


def record(adapter: str | Path, choice: Choice, result: dict, split: str, max_harm: float, min_f1: float) -> dict:
    """Write the choice into the adapter's `kvsteward.json` (the rest of the record kept); returns the new record."""
    from kvsteward.models import ADAPTER_META, write_adapter_meta

    path = Path(adapter).expanduser() / ADAPTER_META
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta["close_bias"] = choice.close_bias
    meta["min_confidence"] = choice.min_confidence
    meta["calibration"] = {"split": split, "traces": result["n_traces"], "every": result["every"],
                           "aux_context": result["aux_context"], "keep_unread": result["keep_unread"],
                           "max_harm": max_harm, "min_f1": min_f1, "met": choice.met, "reason": choice.reason,
                           "by_bias": {str(b): _brief(s) for b, s in result["by_bias"].items()},
                           "by_confidence": {str(c): _brief(s) for c, s in result.get("by_confidence", {}).items()}}
    write_adapter_meta(adapter, meta)
    return meta
