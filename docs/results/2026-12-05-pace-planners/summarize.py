"""Fact probes answered per run folder x distance, with every miss (what was generated, and which other fact of the
session it equals), from the journals; and the lexical plan's edges per session (from the run's --json output).

python summarize.py [--out summary.json]   (reads the folders next to this file)
"""
import glob
import json
import os
import sys
from collections import defaultdict

here = os.path.dirname(os.path.abspath(__file__))
RUNS = ("settlement-lexical", "ops-lexical", "settlement-oracle-d1024", "ops-oracle-d1024", "settlement-full-on-misses",
        "settlement-lexical-32k", "ops-lexical-32k")


def sessions_of(folder: str) -> dict:
    path = os.path.join(folder, "sessions.jsonl")
    return {x["id"]: x for x in map(json.loads, open(path))} if os.path.exists(path) else {}


def summarize(folder: str) -> dict:
    sess, cells, walls = sessions_of(folder), defaultdict(lambda: {"answered": 0, "n": 0, "misses": []}), []
    for j in sorted(glob.glob(os.path.join(folder, "journal*.jsonl"))):
        for r in map(json.loads, open(j)):
            walls.append(r["wall_s"])
            for x in (x for x in r["rows"] if x["kind"] == "fact"):
                c = cells[str(x["distance"])]
                c["n"] += 1
                if x["score"] >= 1.0:
                    c["answered"] += 1
                    continue
                se = sess.get(x["session"], {})
                gold = next((p.get("gold") for p in se.get("probes", []) if p["id"] == x["probe"]), None)
                gen = (x.get("extra") or {}).get("generated", "")
                other = [k for k, v in se.get("facts", {}).items() if isinstance(v, str) and v and gen.startswith(v)
                         and v != gold]
                c["misses"].append({"session": x["session"], "probe": x["probe"], "gold": gold,
                                    "generated": gen[:40], "generated_is_other_fact": other})
    out = {d: {**c, "acc": round(c["answered"] / c["n"], 4)} for d, c in sorted(cells.items())}
    if walls:
        out["wall_s_per_session"] = {"mean": round(sum(walls) / len(walls), 1), "plays": len(walls)}
    return out


result = {run: summarize(os.path.join(here, run)) for run in RUNS if os.path.isdir(os.path.join(here, run))}
for run in RUNS:
    path = os.path.join(here, f"{run}.stdout.json")
    if "lexical" in run and os.path.exists(path) and os.path.getsize(path):
        plan = json.load(open(path))["planner"]
        result[run]["planner"] = {k: v for k, v in plan.items() if k != "reads"}
json.dump(result, sys.stdout if "--out" not in sys.argv else open(sys.argv[sys.argv.index("--out") + 1], "w"), indent=1)
