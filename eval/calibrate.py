"""Choose the aux thread's close bias on held-out traces, and record it with the adapter (`steward eval calibrate`).

The close bias (nats added to closing the deletion list: `serve.aux._constrained_steps`) trades recall for precision:
a higher bias lists a prefix of what a lower one lists, so fewer deletions and fewer harmful ones. Which bias meets a
harm target depends on the adapter (three seeds of one configuration differed threefold in harm at bias 0), so it is
chosen per adapter — on the validation split: choosing it on the test split would report the selection, not the
manager. The choice goes into the adapter's `kvsteward.json` (`close_bias`, with the `calibration` record), where
`Engine.load` reads it as the serving default; `steward serve --aux-close-bias` and `steward eval manager
--close-bias` still override it.

Each bias is the adapter arm of `eval.manager` (the aux thread exactly as served), all against one uncompressed
replay per trace (`eval.manager.play`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvsteward.eval.manager import play, reference, summarize
from kvsteward.serve.engine import Engine
from kvsteward.synth.trace import Trace


def check_biases(biases: list[float]) -> list[float]:
    """The sweep's biases, ascending and distinct; refused by name when empty or not finite."""
    if not biases:
        raise ValueError("calibration needs at least one close bias")
    bad = [b for b in biases if not math.isfinite(b)]
    if bad:
        raise ValueError(f"close biases must be finite numbers of nats, got {bad}")
    return sorted(set(biases))


def arm_name(bias: float) -> str:
    return f"bias {bias:g}"


def sweep(engine: Engine, traces: list[Trace], biases: list[float], every: int = 4, max_aux_tokens: int = 48,
          keep_unread: bool = True, progress: Callable[[str], None] | None = None, **parallel) -> dict:
    """The adapter as memory manager at every close bias, each scored as `eval.manager.evaluate` scores its adapter
    arm: `{"by_bias": {bias: summary}, "uncompressed": {...}, ...}`. `parallel`: `workers`, `engine_factory`,
    `journal`, `journal_key` of `eval.manager.play`."""
    biases = check_biases(biases)
    arms = {arm_name(b): (True, b) for b in biases}
    tallies = play(engine, traces, every, arms, max_aux_tokens=max_aux_tokens, progress=progress,
                   keep_unread=keep_unread, **parallel)
    ref = tallies["uncompressed"]
    return {"by_bias": {b: summarize(tallies[arm_name(b)], ref) for b in biases}, "uncompressed": reference(ref),
            "n_traces": len(traces), "every": every, "keep_unread": keep_unread, "aux_context": engine.aux_context}


@dataclass(frozen=True)
class Choice:
    close_bias: float
    met: bool  # the chosen bias meets both targets
    reason: str


def _harm(summary: dict) -> float:
    # no deletion harms nothing (its harmful_rate is NaN: 0 / 0)
    return summary["harmful"] / summary["deleted"] if summary["deleted"] else 0.0


def choose(by_bias: dict[float, dict], max_harm: float, min_f1: float) -> Choice:
    """The bias to serve: among those with harmful rate <= `max_harm` and F1 >= `min_f1`, the highest F1 (a tie: the
    lower bias, which deletes more). When none meets both, the lowest harmful rate among those that keep F1 >=
    `min_f1` (among all when none does; a tie: the higher F1), and `met` is False: the target is not reached."""
    if not by_bias:
        raise ValueError("nothing to choose from: no bias was measured")
    ok = [b for b, s in by_bias.items() if _harm(s) <= max_harm and s["f1"] >= min_f1]
    if ok:
        best = max(ok, key=lambda b: (by_bias[b]["f1"], -b))
        return Choice(best, True, f"highest F1 ({by_bias[best]['f1']:.3f}) with harmful rate <= {max_harm:g}")
    pool = [b for b, s in by_bias.items() if s["f1"] >= min_f1] or list(by_bias)
    best = min(pool, key=lambda b: (_harm(by_bias[b]), -by_bias[b]["f1"], b))
    keeps = "" if by_bias[best]["f1"] >= min_f1 else f" (no bias keeps F1 >= {min_f1:g})"
    return Choice(best, False, f"no bias has harmful rate <= {max_harm:g} and F1 >= {min_f1:g}: the lowest harmful "
                               f"rate ({_harm(by_bias[best]):.3f}){keeps}")


def record(adapter: str | Path, choice: Choice, result: dict, split: str, max_harm: float, min_f1: float) -> dict:
    """Write the choice into the adapter's `kvsteward.json` (the rest of the record kept); returns the new record."""
    from kvsteward.models import ADAPTER_META, write_adapter_meta

    path = Path(adapter).expanduser() / ADAPTER_META
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta["close_bias"] = choice.close_bias
    meta["calibration"] = {"split": split, "traces": result["n_traces"], "every": result["every"],
                           "aux_context": result["aux_context"], "keep_unread": result["keep_unread"],
                           "max_harm": max_harm, "min_f1": min_f1, "met": choice.met, "reason": choice.reason,
                           "by_bias": {str(b): {"harmful_rate": _harm(s)} | {k: s[k] for k in (
                               "f1", "precision", "recall", "deleted", "harmful", "harmful_rate_ci95",
                               "answer_acc_delta") if k in s}
                                       for b, s in result["by_bias"].items()}}
    write_adapter_meta(adapter, meta)
    return meta
