"""Long-session benchmark outputs: results.json, report.md, PNG plots, and MLflow logging.

`result` has the shape printed by `steward eval longsession --json`:

    {"arms": {arm: {"by_distance": {D: {"forced_acc", "gold_nll", "recall", "residency", "rotary_gap", "n"}},
                    "peak_resident_slots": int, "wall_s": float}},
     "paired": {arm: {"better", "worse", "tied", "p"}}}

Optionally `"reference"` (the paired reference arm's name) and `"probes"`: per-probe ledger rows
`{"arm", "distance", "forced": 0/1, "residency", "rotary_gap"}`; with them the rotary-gap plot bins single probes
(as PACE's Figure 3) instead of plotting one point per (arm, distance).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

METRICS = ("forced_acc", "gold_nll", "recall", "residency", "rotary_gap", "n")
MATCHED_RESIDENCY = 0.9  # the rotary-gap plot keeps only points at least this resident: residency held ~constant


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _validate(result: dict) -> None:
    if not isinstance(result, dict) or not isinstance(result.get("arms"), dict) or not result["arms"]:
        raise ValueError("result must be a dict with a non-empty 'arms' mapping")
    for arm, rec in result["arms"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("by_distance"), dict):
            raise ValueError(f"result['arms'][{arm!r}] needs a 'by_distance' mapping")
        for d, cell in rec["by_distance"].items():
            missing = [m for m in METRICS if m not in cell]
            if missing:
                raise ValueError(f"result['arms'][{arm!r}]['by_distance'][{d!r}] lacks {missing}")
            int(d)  # distances are integers (JSON keys are strings)


def _distances(result: dict) -> list[str]:
    return sorted({d for rec in result["arms"].values() for d in rec["by_distance"]}, key=int)


def _json_safe(obj):
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _plan_lines(result: dict) -> list[str]:
    """Who made the foresight arms' plan, said plainly (an oracle plan is the generator's own record)."""
    plan = result.get("planner")
    granularity = (result.get("config") or {}).get("blueprint", "facts")
    if not plan:
        return []
    if plan.get("oracle"):
        return [f"Plan: **oracle** (the generator's record of what each probe reads; {granularity} granularity).", ""]
    return [f"Plan: **{plan['name']}** planner, {granularity} granularity — edge recall {plan['edge_recall']:.2f}, "
            f"precision {plan['edge_precision']:.2f} against the oracle (fact probes "
            f"{plan['fact_edge_recall']:.2f} / {plan['fact_edge_precision']:.2f}), "
            f"{plan['planned_tokens_mean']:.0f} planned tokens per session, {plan['parse_failures']} parse failures.",
            ""]


def markdown(result: dict) -> str:
    dists = _distances(result)
    domain = [f"Session domain: **{result['domain']}**.", ""] if result.get("domain") else []
    lines = ["# Long-session benchmark", "", *domain, *_plan_lines(result),
             "## Forced-prefix accuracy (arm × distance D in tokens)", "",
             "| arm | " + " | ".join(f"D={d}" for d in dists) + " | peak resident slots | wall s |",
             "|---|" + "---|" * (len(dists) + 2)]
    for arm, rec in result["arms"].items():
        cells = [_fmt(rec["by_distance"].get(d, {}).get("forced_acc")) for d in dists]
        lines.append(f"| {arm} | " + " | ".join(cells)
                     + f" | {_fmt(rec.get('peak_resident_slots'))} | {_fmt(rec.get('wall_s'), 1)} |")
    lines += ["", "## All metrics", "", "| arm | D | n | forced_acc | gold_nll | recall | residency | rotary_gap |",
              "|---|---|---|---|---|---|---|---|"]
    for arm, rec in result["arms"].items():
        for d in dists:
            c = rec["by_distance"].get(d)
            if c:
                lines.append(f"| {arm} | {d} | {c['n']} | {_fmt(c['forced_acc'])} | {_fmt(c['gold_nll'])} | "
                             f"{_fmt(c['recall'])} | {_fmt(c['residency'])} | {_fmt(c['rotary_gap'], 0)} |")
    per_fact = [(arm, d, c["by_fact"]) for arm, rec in result["arms"].items() for d in dists
                if (c := rec["by_distance"].get(d)) and c.get("by_fact")]
    if per_fact:  # which facts an arm misses, and what it answers instead
        lines += ["", "## Per fact (answered / played; the most frequent wrong answers)", "",
                  "| arm | D | fact | answered | wrong answers (count) |", "|---|---|---|---|---|"]
        for arm, d, facts in per_fact:
            for fact, f in facts.items():
                wrong = ", ".join(f"`{w or '∅'}` ×{k}" for w, k in list(f["misses"].items())[:4])
                lines.append(f"| {arm} | {d} | {fact.split(':', 1)[-1]} | {f['answered']}/{f['n']} | {wrong} |")
    paired = result.get("paired") or {}
    if paired:
        ref = result.get("reference", "the reference arm")
        lines += ["", f"## Paired against {ref} (two-sided sign test, ties excluded)", "",
                  "| arm | better | worse | tied | p |", "|---|---|---|---|---|"]
        for arm, p in paired.items():
            pval = f"{p['p']:.3g}" if _finite(p.get("p")) else "–"
            lines.append(f"| {arm} | {p['better']} | {p['worse']} | {p['tied']} | {pval} |")
    lines += ["", "Plots: `acc_vs_distance.png`, `acc_vs_rotary_gap.png` (points with residency "
              f"≥ {MATCHED_RESIDENCY} only).", ""]
    return "\n".join(lines)


_MARKERS = "osD^v<>pXh*"


def _marker_style(i: int) -> dict:
    """Hollow markers that shrink with the arm's index: arms with the same value at a point (often several at 0)
    show as concentric rings instead of hiding each other. The colour follows the index too, so an arm has the same
    colour in both plots even where the gap plot leaves arms out."""
    return dict(color=f"C{i % 10}", marker=_MARKERS[i % len(_MARKERS)], markersize=max(3.0, 11.0 - i),
                markerfacecolor="none")


def _finish(fig, ax, legend: bool) -> None:
    ax.grid(alpha=0.3)
    if legend:  # outside the axes: inside, it covers points at the right edge (the far distances)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()


def _plot_distance(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    for i, (arm, rec) in enumerate(result["arms"].items()):
        pts = sorted((int(d), c["forced_acc"]) for d, c in rec["by_distance"].items() if _finite(c["forced_acc"]))
        if pts:
            ax.plot(*zip(*pts, strict=True), label=arm, **_marker_style(i))
    ax.set(xlabel="distance D from definitions to probe (tokens)", ylabel="forced-prefix accuracy", ylim=(-0.03, 1.03),
           title="Accuracy vs distance")
    _finish(fig, ax, legend=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gap_points(result: dict) -> dict[str, list[tuple[float, float]]]:
    """arm -> [(rotary gap, accuracy)] at matched residency; per-probe rows are binned by gap when present."""
    out: dict[str, list[tuple[float, float]]] = {}
    rows = result.get("probes")
    if rows:
        edges = [0, 1024, 2048, 4096, 8192, 16384, 32768, float("inf")]
        for arm in result["arms"]:
            mine = [r for r in rows if r["arm"] == arm and _finite(r.get("rotary_gap"))
                    and r.get("residency", 0) >= MATCHED_RESIDENCY]
            for lo, hi in zip(edges, edges[1:], strict=False):
                inbin = [r for r in mine if lo <= r["rotary_gap"] < hi]
                if inbin:
                    gap = sum(r["rotary_gap"] for r in inbin) / len(inbin)
                    out.setdefault(arm, []).append((gap, sum(r["forced"] for r in inbin) / len(inbin)))
        return out
    for arm, rec in result["arms"].items():
        for c in rec["by_distance"].values():
            if _finite(c["rotary_gap"]) and _finite(c["forced_acc"]) and _finite(c["residency"]) \
                    and c["residency"] >= MATCHED_RESIDENCY:
                out.setdefault(arm, []).append((c["rotary_gap"], c["forced_acc"]))
    return out


def _plot_gap(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    points = _gap_points(result)
    for i, arm in enumerate(result["arms"]):
        if arm in points:
            xs, ys = zip(*points[arm], strict=True)
            ax.plot(xs, ys, linestyle="none", label=arm, **_marker_style(i))
    if not points:
        ax.text(0.5, 0.5, f"no point has residency ≥ {MATCHED_RESIDENCY}", ha="center", transform=ax.transAxes)
    ax.set(xlabel="rotary gap: mean query → needed-token distance (positions the model sees)",
           ylabel="forced-prefix accuracy", ylim=(-0.03, 1.03),
           title=f"Accuracy vs rotary gap (residency ≥ {MATCHED_RESIDENCY})")
    _finish(fig, ax, legend=bool(points))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write results.json, report.md, acc_vs_distance.png and acc_vs_rotary_gap.png into `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    _validate(result)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md", "distance_plot": out / "acc_vs_distance.png",
             "gap_plot": out / "acc_vs_rotary_gap.png"}
    paths["json"].write_text(json.dumps(_json_safe(result), indent=2, allow_nan=False) + "\n")
    paths["markdown"].write_text(markdown(result))
    _plot_distance(result, paths["distance_plot"])
    _plot_gap(result, paths["gap_plot"])
    return paths


def flat_metrics(result: dict) -> dict[str, float]:
    """`<arm>.d<D>.<metric>`, `<arm>.peak_resident_slots`, `<arm>.wall_s`, `paired.<arm>.<k>`; finite values only."""
    out: dict[str, float] = {}
    for arm, rec in result["arms"].items():
        for d, cell in rec["by_distance"].items():
            out.update({f"{arm}.d{d}.{m}": cell[m] for m in METRICS if _finite(cell[m])})
        out.update({f"{arm}.{k}": rec[k] for k in ("peak_resident_slots", "wall_s") if _finite(rec.get(k))})
    for arm, p in (result.get("paired") or {}).items():
        out.update({f"paired.{arm}.{k}": p[k] for k in ("better", "worse", "tied", "p") if _finite(p.get(k))})
    return {k: float(v) for k, v in out.items()}


def log_to_mlflow(result: dict, out_dir: str | Path, params: dict) -> str:
    """Log params, flattened metrics and everything in `out_dir` to the active MLflow run, or to a new run in the
    project's store (nested under the pipeline's run inside `steward pipeline run`). Returns the run id."""
    import mlflow

    from kvsteward.runs import stage_run

    _validate(result)
    with stage_run("longsession") as run:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics(flat_metrics(result))
        mlflow.log_artifacts(str(out_dir))
    return run.info.run_id
