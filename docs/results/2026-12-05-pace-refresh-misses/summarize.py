"""Tables of the diagnosis: answers per intervention and session, the answer opening's attention per layer.

    python summarize.py rows-seed4513.json --out summary.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def summarize(rows: list[dict]) -> dict:
    names = list(dict.fromkeys(r["intervention"] for r in rows))
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[r["session"]][r["intervention"]] = r
    # `recomputed` is the resident set after the opener's own eviction; as played, the opener's logits saw the
    # rows that eviction removed, so the two can differ (listed, not hidden)
    recomputed_differs = sorted(s for s, d in by.items() if d["as_played"]["score"] != d["recomputed"]["score"])
    answered = {n: sum(int(d[n]["score"]) for d in by.values()) for n in names}
    misses = sorted(s for s, d in by.items() if not d["as_played"]["score"])
    fixes = {n: [s for s in misses if by[s][n]["score"]] for n in names}
    breaks = {n: [s for s, d in by.items() if d["as_played"]["score"] and not d[n]["score"]] for n in names}
    encoded = {n: round(sum(d[n]["encoded"] for d in by.values()) / len(by), 1) for n in names}
    played = [d["as_played"] for d in by.values()]
    layers = len(played[0]["attention"]["needed_line"])

    def layer_mean(group: str, hit: bool) -> list[float]:
        sel = [r for r in played if bool(r["score"]) == hit]
        return [round(sum(r["attention"][group][i] for r in sel) / max(len(sel), 1), 4) for i in range(layers)]

    attention = {("hits" if hit else "misses"): {g: layer_mean(g, hit) for g in ("needed_line", "line:quantum")}
                 for hit in (True, False)}
    return {"sessions": len(by), "answered": answered, "recomputed_differs": recomputed_differs, "misses": misses,
            "fixes": fixes, "breaks": breaks,
            "mean_encoded": encoded,
            "quantum_first_token_logprob": {s: d["as_played"]["competitor_logprob"].get("quantum")
                                            for s, d in by.items()},
            "attention_by_layer": attention,
            "per_session": {s: {n: int(d[n]["score"]) for n in names} for s, d in by.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = [r for path in a.rows for r in json.load(open(path))]
    out = summarize(rows)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    for n, k in out["answered"].items():
        print(f"{n:20s} {k}/{out['sessions']}  fixes {len(out['fixes'][n])}  breaks {len(out['breaks'][n])}  "
              f"encoded {out['mean_encoded'][n]}")


if __name__ == "__main__":
    main()
