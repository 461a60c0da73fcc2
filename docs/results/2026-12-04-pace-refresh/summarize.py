"""Tables of the pace-refresh study from its runs' journals: fact-probe accuracy per arm and distance, the misses
(probe, greedy text), and wall time per arm summed over the same (session, arm) pairs.

    python summarize.py NAME=DIR [NAME=DIR ...] --out summary.json

Each DIR is a `steward eval longsession --out` folder (its journal.jsonl or shard journals, and sessions.jsonl).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _records(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("journal*.jsonl")):
        out += [r for r in map(json.loads, path.read_text().splitlines()) if "rows" in r]
    return out


def _golds(folder: Path) -> dict[tuple[str, str], str]:
    golds = {}
    for line in (folder / "sessions.jsonl").read_text().splitlines():
        s = json.loads(line)
        for p in s["probes"]:
            if p["kind"] == "fact":
                golds[(s["id"], p["id"])] = p["gold"]
    return golds


def summarize(folder: Path) -> dict:
    records = _records(folder)
    golds = _golds(folder)
    cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    wall: dict[str, float] = defaultdict(float)
    sessions: dict[str, set] = defaultdict(set)
    misses = []
    for r in records:
        wall[r["arm"]] += r["wall_s"]
        sessions[r["arm"]].add(r["session"])
        for row in r["rows"]:
            if row["kind"] != "fact":
                continue
            cells[r["arm"]][str(row["distance"])].append(row["score"])
            if row["score"] < 1:
                misses.append({"session": r["session"], "arm": r["arm"], "probe": row["probe"],
                               "gold": golds[(r["session"], row["probe"])],
                               "generated": row["extra"].get("generated", "")})
    arms = {}
    for arm, by_d in cells.items():
        arms[arm] = {"by_distance": {d: {"forced_acc": sum(v) / len(v), "answered": int(sum(v)), "n": len(v)}
                                     for d, v in sorted(by_d.items(), key=lambda kv: int(kv[0]))},
                     "min_forced_acc": min(sum(v) / len(v) for v in by_d.values()),
                     "pairs": len(sessions[arm]), "wall_s": wall[arm]}
    common = set.intersection(*sessions.values()) if sessions else set()
    ratio = {}
    if "pace" in arms and "pace-refresh" in arms:
        w = {a: sum(r["wall_s"] for r in records if r["arm"] == a and r["session"] in common)
             for a in ("pace", "pace-refresh")}
        ratio = {"pace_refresh_over_pace_wall": w["pace-refresh"] / w["pace"], "pairs": len(common)}
    return {"arms": arms, "misses": misses, "wall_ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="NAME=DIR")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {}
    for item in a.runs:
        name, folder = item.split("=", 1)
        out[name] = summarize(Path(folder))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, s in out.items():
        cells = {arm: {d: f"{c['answered']}/{c['n']}" for d, c in v["by_distance"].items()}
                 for arm, v in s["arms"].items()}
        print(name, cells, s["wall_ratio"])


if __name__ == "__main__":
    main()
