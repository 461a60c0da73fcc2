"""bfloat16 against float32 on the same sessions, probe by probe: check-bf16/ (this study) against the float32
journals of ../2026-12-05-pace-confirm (the same session ids, the same settings).

python compare_fp32.py > check-compare.json
"""
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
fp32 = {}
for dom in ("settlement", "ops"):
    for r in map(json.loads, open(os.path.join(here, "..", "2026-12-05-pace-confirm", f"{dom}-9311", "journal.jsonl"))):
        for x in r["rows"]:
            fp32[(r["session"], x["probe"])] = x
probes, walls = [], {}
for r in map(json.loads, open(os.path.join(here, "check-bf16", "journal.jsonl"))):
    walls[r["session"]] = r["wall_s"]
    for x in (x for x in r["rows"] if x["kind"] == "fact"):
        f = fp32[(r["session"], x["probe"])]
        probes.append({"session": r["session"], "probe": x["probe"], "bf16": x["score"], "fp32": f["score"],
                       "bf16_generated": x["extra"].get("generated", "")[:24],
                       "fp32_generated": f["extra"].get("generated", "")[:24]})
json.dump({"probes": len(probes), "same_score": sum(p["bf16"] == p["fp32"] for p in probes),
           "bf16_answered": sum(p["bf16"] >= 1 for p in probes), "fp32_answered": sum(p["fp32"] >= 1 for p in probes),
           "bf16_wall_s_per_session": round(sum(walls.values()) / len(walls), 1), "rows": probes},
          sys.stdout, indent=1)
