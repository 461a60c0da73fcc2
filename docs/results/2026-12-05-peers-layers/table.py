"""The study's table from peers.json (the --json output): python table.py"""

import json
from pathlib import Path

r = json.loads((Path(__file__).parent / "peers.json").read_text())
rows = {side: {} for side in ("kvpress", "engine")}
for side in rows:
    for row in r["rows"][side]:
        rows[side].setdefault(row.get("press") or row.get("policy"), {}).setdefault(f"{row['ratio']:g}", []).append(row)
LABELS = {"": "one set for all layers and heads", "-layers": "one set per layer", "-heads": "per KV head"}


def cells(side: str, name: str) -> str:
    out = []
    for k in ("0.5", "0.75"):
        c = r[side][name][k]
        resident = [x.get("resident", x["kept"]) for x in rows[side][name][k]]
        out.append(f"{c['accuracy']:.2f}, {c['wall_s']:.1f}, {sum(resident) / len(resident):.0f}")
    return " | ".join(out)


print("| method | kept 50 %: accuracy, s/prompt, resident slots | kept 25 %: accuracy, s/prompt, resident slots |")
print("|---|---|---|")
for press, label, engines in (("tova", "one set per layer", ("tova", "tova-layers")),
                              ("snapkv", "per KV head", ("snapkv", "snapkv-layers")), (None, "", ("h2o-layers",))):
    if press:
        print(f"| kvpress: {press} ({label}) | {cells('kvpress', press)} |")
    for name in engines:
        suffix = "-layers" if name.endswith("-layers") else ""
        print(f"| engine: {name} ({LABELS[suffix]}) | {cells('engine', name)} |")
for side, name in (("kvpress", "none"), ("engine", "full")):
    c = r[side][name]["0"]
    print(f"| {side}: {name} (uncompressed) | {c['accuracy']:.2f}, {c['wall_s']:.1f} | |")
print(f"\nuncompressed answers equal across stacks: {r['full_agreement']:.2f}; "
      f"context tokens (mean): {r['workload']['context_tokens_mean']:.0f}; "
      f"walls: kvpress {r['workload']['kvpress_wall_s']:.0f} s, engine {r['workload']['engine_wall_s']:.0f} s")
