"""Per-arm means over the clean rounds of the two bench outputs (round 1 of run A overlapped other work on the same
cores and is excluded; see README.md): python summarize.py > summary.json"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
KEYS = ("output_tok_s", "requests_per_s", "p50_s", "p95_s", "mean_s", "running_peak", "running_mean",
        "queue_time_mean_s", "prompt_tokens", "prompt_tokens_computed", "seal_requests", "peak_kv_used",
        "mean_kv_used", "peak_kv_allocated", "retractions", "reprefills", "tree_compactions", "tree_freed",
        "tree_refused", "tree_compacted_miss", "strict_check_failures", "wall_s")


def rounds() -> list[tuple[str, int, dict[str, dict], dict[str, float]]]:
    """(run, round, {arm: result}, {arm: no-op mean latency}) for every round of both runs."""
    out = []
    for run in ("run-a.json", "run-b.json"):
        d = json.loads((HERE / run).read_text())
        n = len(next(iter(d["repeats"].values())))
        for r in range(n):
            noop = {a: v[r] for a, v in d["no_op_mean_latency_s"].items() if len(v) > r}
            out.append((run, r + 1, {a: v[r] for a, v in d["repeats"].items()}, noop))
    return out


def main() -> None:
    clean = [x for x in rounds() if not (x[0] == "run-a.json" and x[1] == 1)]
    arms = list(clean[0][2])
    per_arm = {a: {k: statistics.fmean(r[2][a].get(k, 0) for r in clean) for k in KEYS} for a in arms}
    ratio = [r[2]["kvsteward"]["output_tok_s"] / r[2]["default"]["output_tok_s"] for r in clean]
    free = [r[2]["kvsteward"]["output_tok_s"] / r[2]["kvsteward_nofree"]["output_tok_s"] for r in clean]
    noop = [r[3]["kvsteward"] / r[3]["default"] for r in clean]
    print(json.dumps({
        "clean_rounds": [f"{r[0]} round {r[1]}" for r in clean], "arms": per_arm,
        "kvsteward_vs_default_output_tok_s": per_arm["kvsteward"]["output_tok_s"] / per_arm["default"]["output_tok_s"],
        "kvsteward_vs_default_per_round": ratio, "kvsteward_vs_nofree_per_round": free,
        "kvsteward_vs_nofree_output_tok_s":
            per_arm["kvsteward"]["output_tok_s"] / per_arm["kvsteward_nofree"]["output_tok_s"],
        "no_op_overhead": statistics.fmean(r[3]["kvsteward"] for r in clean)
        / statistics.fmean(r[3]["default"] for r in clean), "no_op_overhead_per_round": noop,
        "excluded_round": {a: {k: v for k, v in res.items() if k in ("output_tok_s", "p95_s")}
                           for a, res in rounds()[0][2].items()},
    }, indent=1))


if __name__ == "__main__":
    main()
