"""Tables of `diagnose.py`'s rows: accuracy per intervention (overall, per distance, per fact) and, for each probe
as_played misses, what every intervention answers.

    python summarize.py rows-seed7.json repositioned-seed7.json rows-seed2031.json repositioned-seed2031.json \
        --out summary.json

Files of one seed (`*-seedN.json`) are merged; an intervention present in two of them (`as_played`, replayed by
every run) must agree probe by probe (the play is deterministic), else the script fails.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def _acc(rows: list[dict]) -> dict:
    return {"acc": sum(r["score"] for r in rows) / len(rows), "answered": int(sum(r["score"] for r in rows)),
            "n": len(rows)}


def summarize(rows: list[dict]) -> dict:
    by = defaultdict(list)
    for r in rows:
        by[r["intervention"]].append(r)
    table = {}
    for name, rs in by.items():
        cell = _acc(rs)
        cell["by_distance"] = {str(d): _acc([r for r in rs if r["distance"] == d])
                               for d in sorted({r["distance"] for r in rs})}
        cell["by_fact"] = {p: _acc([r for r in rs if r["probe"] == p]) for p in sorted({r["probe"] for r in rs})}
        cell["gold_nll"] = sum(r["nll"] for r in rs) / len(rs)
        table[name] = cell
    played = {(r["session"], r["probe"]): r for r in by["as_played"]}
    misses = []
    for key, r in sorted(played.items()):
        if r["score"]:
            continue
        others = {k: v for k, v in r["competitor_logprob"].items() if not math.isnan(v)}
        misses.append({"session": key[0], "probe": key[1], "generated": r["generated"].split('"', 1)[0],
                       "competitor_logprob": others,
                       "answers": {x["intervention"]: x["generated"].split('"', 1)[0]
                                   for x in rows if (x["session"], x["probe"]) == key}})
    # what each intervention breaks that as_played answers (the cost of the change)
    broken = {name: sorted(f"{r['session']} {r['probe']}" for r in rs
                           if not r["score"] and played[(r["session"], r["probe"])]["score"])
              for name, rs in by.items()}
    return {"interventions": table, "as_played_misses": misses, "broken_vs_as_played": broken}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    merged: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for p in a.rows:
        seed = Path(p).stem.rsplit("-", 1)[-1]
        for r in json.loads(Path(p).read_text()):
            key = (r["session"], r["probe"], r["intervention"])
            old = merged[seed].get(key)
            if old is not None and (old["score"], old["generated"]) != (r["score"], r["generated"]):
                raise SystemExit(f"{p}: {key} differs from an earlier file's row: the play is not deterministic")
            merged[seed][key] = r
    out = {seed: summarize(list(rows.values())) for seed, rows in merged.items()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for seed, s in out.items():
        print(seed)
        for name, c in s["interventions"].items():
            d = "  ".join(f"D{k} {v['answered']}/{v['n']}" for k, v in c["by_distance"].items())
            f = "  ".join(f"{k.split(':')[1]} {v['answered']}/{v['n']}" for k, v in c["by_fact"].items())
            print(f"  {name:20s} {c['answered']:3d}/{c['n']:<3d} {d}   {f}   nll {c['gold_nll']:.3f}")


if __name__ == "__main__":
    main()
