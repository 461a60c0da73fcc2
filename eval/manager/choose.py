"""Which manager to serve, chosen on validation (`steward eval choose`, the pipeline's `choose` stage).

The candidates are the adapter (as calibrated: its close bias or confidence rule), the fitted rules a small model
has to beat (`structure`, `delete_all_read`) and, with a per-response adapter, the stack (structure + its P(no):
`eval.manager.stack`), each scored by `eval.manager.evaluate` on the same validation replays.
The winner is the best deletion F1 among the arms whose harmful rate is within `max_harm` (all arms when none is);
a tie goes to the cheaper arm (`PREFERENCE`: a rule costs no forward, delete-all-read needs no fit). The test split
never takes part: its numbers then measure the served manager, not the choice.
"""

from __future__ import annotations

import math

# cheapest first: ties go to the earlier arm (the stack is the adapter's forward and a head on top)
PREFERENCE = ("delete_all_read", "structure", "adapter", "stack")
TIE = 1e-9


def _f1(summary: dict) -> float:
    f1 = summary.get("f1")
    return -math.inf if f1 is None or (isinstance(f1, float) and math.isnan(f1)) else float(f1)


def choose_manager(validation: dict[str, dict], max_harm: float = 1.0) -> tuple[str, str]:
    """(winning arm, the reason in words) among `validation` (arm → `evaluate` summary with `f1`, `harmful_rate`,
    `n_decisions`); `ValueError` when no arm was scored on any decision."""
    arms = [a for a in PREFERENCE if a in validation] + sorted(a for a in validation if a not in PREFERENCE)
    scored = [a for a in arms if validation[a].get("n_decisions", 0) > 0]
    if not scored:
        raise ValueError(f"no arm decided anything on validation ({', '.join(arms) or 'no arms'}): nothing to choose")
    within = [a for a in scored if (validation[a].get("harmful_rate") or 0.0) <= max_harm]
    pool = within or scored
    best = max(_f1(validation[a]) for a in pool)
    winner = next(a for a in pool if _f1(validation[a]) >= best - TIE)
    others = ", ".join(f"{a} {_f1(validation[a]):.3f}" for a in scored if a != winner)
    cap = "" if max_harm >= 1.0 else (f" among the arms within {max_harm:.0%} harmful" if within else
                                      f" (no arm within {max_harm:.0%} harmful: the cap is not met)")
    return winner, f"best validation F1{cap}: {winner} {best:.3f} (vs {others or 'no other arm'})"


def calibrated_summary(calibration: dict) -> dict:
    """The adapter's validation summary at the decode rule `steward eval calibrate` chose (its JSON output), so the
    choice need not replay the adapter again on the same traces."""
    if calibration.get("min_confidence") is not None:
        table, key = calibration["by_confidence"], calibration["min_confidence"]
    else:
        table, key = calibration["by_bias"], calibration["close_bias"]
    for k, summary in table.items():
        if math.isclose(float(k), float(key)):
            return summary
    raise ValueError(f"the calibration record has no summary for its chosen rule {calibration.get('chosen')!r}")
