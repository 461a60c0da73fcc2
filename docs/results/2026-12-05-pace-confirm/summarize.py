"""Count fact probes answered per domain x arm x distance from the journals (cheap; reads JSON only).

python summarize.py [--out summary.json]   (run from this folder or give paths)
"""
import glob
import json
import os
import sys
from collections import defaultdict

here = os.path.dirname(os.path.abspath(__file__))
out = {}
for dom in ("settlement", "ops"):
    folder = os.path.join(here, f"{dom}-9311")
    rows, walls = [], defaultdict(list)
    sess = {}
    if os.path.exists(os.path.join(folder, "sessions.jsonl")):
        for line in open(os.path.join(folder, "sessions.jsonl")):
            x = json.loads(line)
            sess[x["id"]] = x
    for j in sorted(glob.glob(os.path.join(folder, "journal*.jsonl"))):
        for line in open(j):
            r = json.loads(line)
            walls[r["arm"]].append(r["wall_s"])
            rows += [x for x in r["rows"] if x["kind"] == "fact"]
    cells = defaultdict(lambda: {"answered": 0, "n": 0, "sessions": set(), "misses": []})
    for x in rows:
        c = cells[(x["arm"], x["distance"])]
        c["n"] += 1
        c["sessions"].add(x["session"])
        if x["score"] >= 1.0:
            c["answered"] += 1
        else:
            se = sess.get(x["session"], {})
            gold = next((p.get("gold") for p in se.get("probes", []) if p["id"] == x["probe"]), None)
            gen = (x.get("extra") or {}).get("generated", "")
            other = [k for k, v in se.get("facts", {}).items() if isinstance(v, str) and v and gen.startswith(v)
                     and v != gold]
            c["misses"].append({"session": x["session"], "probe": x["probe"], "gold": gold,
                                "generated": gen[:60], "generated_is_other_fact": other, "nll": x.get("nll")})
    d = {}
    for (arm, dist), c in sorted(cells.items()):
        d.setdefault(arm, {})[str(dist)] = {"answered": c["answered"], "n": c["n"], "sessions": len(c["sessions"]),
                                            "acc": round(c["answered"] / c["n"], 4), "misses": c["misses"]}
    for arm, w in walls.items():
        d.setdefault(arm, {})["wall_s_per_session"] = {"mean": round(sum(w) / len(w), 1), "plays": len(w)}
    out[dom] = d
json.dump(out, sys.stdout if "--out" not in sys.argv else open(sys.argv[sys.argv.index("--out") + 1], "w"), indent=1)
