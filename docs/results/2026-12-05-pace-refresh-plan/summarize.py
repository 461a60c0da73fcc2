"""Tables of the diagnosis: fact probes answered per intervention and probe kind, the as-played misses each
intervention fixes and the hits it breaks, tokens encoded, and the fee-rate probes' quantum log-probability.

    python summarize.py rows-seed6143.json --out summary.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def summarize(rows: list[dict]) -> dict:
    names = list(dict.fromkeys(r["intervention"] for r in rows))
    by: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)  # (session, probe) -> intervention -> row
    for r in rows:
        by[(r["session"], r["probe"])][r["intervention"]] = r
    probes = sorted({p for _, p in by})
    misses = sorted(k for k, d in by.items() if not d["as_played"]["score"])
    table = {n: {p: sum(int(d[n]["score"]) for (_, q), d in by.items() if q == p) for p in probes} for n in names}
    return {"probes_per_kind": {p: sum(1 for _, q in by if q == p) for p in probes},
            "answered": table,
            "as_played_misses": [f"{s} {p}" for s, p in misses],
            "fixes": {n: [f"{s} {p}" for s, p in misses if by[(s, p)][n]["score"]] for n in names},
            "breaks": {n: [f"{s} {p}" for (s, p), d in by.items() if d["as_played"]["score"] and not d[n]["score"]]
                       for n in names},
            "mean_encoded": {n: round(sum(d[n]["encoded"] for d in by.values()) / len(by), 1) for n in names},
            # the quantum's log-probability at its first token that differs from the fee rate's, per intervention
            "fee_rate_quantum_logprob": {n: {s: round(d[n]["competitor_logprob"]["quantum"], 3)
                                             for (s, p), d in by.items() if p == "fact:fee_rate"} for n in names}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = summarize([r for path in a.rows for r in json.load(open(path))])
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    for n, per in out["answered"].items():
        print(f"{n:18s} {per}  fixes {len(out['fixes'][n])}  breaks {len(out['breaks'][n])}  "
              f"encoded {out['mean_encoded'][n]}")


if __name__ == "__main__":
    main()
