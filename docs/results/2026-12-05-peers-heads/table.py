"""The study's table from peers.json (the --json output): python table.py"""

import json
from pathlib import Path

HEADER = ("| method | kept 50 %: accuracy, s/prompt, resident slots | kept 25 %: accuracy, s/prompt, resident slots |\n"
          "|---|---|---|")


def load(folder: Path) -> tuple[dict, dict]:
    """The --json output in `folder` and its rows grouped by side, method and ratio."""
    r = json.loads((folder / "peers.json").read_text())
    rows = {side: {} for side in ("kvpress", "engine")}
    for side in rows:
        for row in r["rows"][side]:
            name = row.get("press") or row.get("policy")
            rows[side].setdefault(name, {}).setdefault(f"{row['ratio']:g}", []).append(row)
    return r, rows


def cells(r: dict, rows: dict, side: str, name: str) -> str:
    out = []
    for k in ("0.5", "0.75"):
        c = r[side][name][k]
        resident = [x.get("resident", x["kept"]) for x in rows[side][name][k]]
        out.append(f"{c['accuracy']:.2f}, {c['wall_s']:.1f}, {sum(resident) / len(resident):.0f}")
    return " | ".join(out)


def footer(r: dict) -> None:
    """The uncompressed rows, then the run's agreement, context length and walls."""
    for side, name in (("kvpress", "none"), ("engine", "full")):
        c = r[side][name]["0"]
        print(f"| {side}: {name} (uncompressed) | {c['accuracy']:.2f}, {c['wall_s']:.1f} | |")
    print(f"\nuncompressed answers equal across stacks: {r['full_agreement']:.2f}; "
          f"context tokens (mean): {r['workload']['context_tokens_mean']:.0f}; "
          f"walls: kvpress {r['workload']['kvpress_wall_s']:.0f} s, engine {r['workload']['engine_wall_s']:.0f} s")


def main() -> None:
    r, rows = load(Path(__file__).parent)
    print(HEADER)
    for press, engines in (("snapkv", ("snapkv", "snapkv-heads")), ("tova", ("tova", "tova-heads")),
                           ("observed", ("h2o", "h2o-heads")), ("streaming", ("streaming",))):
        print(f"| kvpress: {press} (per head) | {cells(r, rows, 'kvpress', press)} |")
        for name in engines:
            label = "per head" if name.endswith("-heads") else "one set for all heads"
            print(f"| engine: {name} ({label}) | {cells(r, rows, 'engine', name)} |")
    print(f"| kvpress: knorm (per head) | {cells(r, rows, 'kvpress', 'knorm')} |")
    footer(r)


if __name__ == "__main__":
    main()
