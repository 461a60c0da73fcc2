"""The study's table from peers.json (the --json output): python table.py"""

import json
from pathlib import Path

r = json.loads((Path(__file__).parent / "peers.json").read_text())


def cells(c: dict) -> str:
    return " | ".join(f"{c[k]['accuracy']:.2f}, {c[k]['wall_s']:.1f}" for k in ("0.5", "0.75"))


print("| method | kept 50 % (ratio 0.5): accuracy, s/prompt | kept 25 % (ratio 0.75): accuracy, s/prompt |")
print("|---|---|---|")
for pair in r["pairs"]:
    for side, name in (("kvpress", pair["kvpress"]), ("engine", pair["engine"])):
        c = r[side][name]
        print(f"| {side}: {name} | {cells(c)} |")
c = r["kvpress"]["knorm"]
print(f"| kvpress: knorm | {cells(c)} |")
for side, name in (("kvpress", "none"), ("engine", "full")):
    c = r[side][name]["0"]
    print(f"| {side}: {name} (uncompressed) | {c['accuracy']:.2f}, {c['wall_s']:.1f} | |")
print(f"\nuncompressed answers equal across stacks: {r['full_agreement']:.2f}; "
      f"context tokens (mean): {r['workload']['context_tokens_mean']:.0f}")
