"""`steward report RUN_DIR`: one page for a pipeline run — RUN_DIR/report.html and its PNGs, logged to the run's
MLflow parent run.

What it reads: the stage records (`stage.json`) of the run's latest `steward pipeline run` (RUN_DIR/pipeline.json
names them; without it, the newest finished folder of each stage name). What it draws, each figure only when its
stage is there:

- `accuracy_vs_distance.png`: long-session forced-prefix accuracy per arm against the definition → probe distance
  (95 % Wilson intervals over the probes of each cell);
- `resident_kv.png`: resident KV (MiB, and slots) against session length per arm (the `residency` stage, else the
  long-session stage's own plays);
- `manager_arms.png`: every manager arm's deletion F1 and harmful rate on each test set, the served manager
  marked (F1: 95 % bootstrap over the decisions; harmful rate: Wilson over the deletions);
- `serving.png`: the `steward serve` round trip, the same conversation served with its whole cache and after a
  drop + reposition: prompt tokens, resident tokens, next position, latency.

Every PNG carries the numbers it plots as JSON in its `kvsteward` text chunk (`figure_data(path)` reads it back), so
a test (or a reader) can check a figure against the run without reading pixels.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from pathlib import Path

PNG_KEY = "kvsteward"
FIGURES = ("accuracy_vs_distance", "resident_kv", "manager_arms", "serving")
TEST_SETS = {"manager": "in-distribution test split", "heldout": "held-out environment",
             "manager_imported": "imported trace file"}
ARM_LABELS = {"adapter": "LoRA manager", "base": "base model", "delete_all_read": "delete all read",
              "keep_last_k": "keep last K", "text_classifier": "bag of words", "lexical_overlap": "lexical overlap",
              "structure": "structure (trees)", "attention_mass": "attention mass"}


# ---------------------------------------------------------------------------------------------------------- inputs

def load_run(run_dir: Path) -> dict[str, dict]:
    """{stage name: its stage.json record} for the run's latest pipeline (RUN_DIR/pipeline.json), else the newest
    finished folder of each stage name."""
    run_dir = Path(run_dir)
    index = run_dir / "pipeline.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("stages", {})
        out = {}
        for name, d in names.items():
            f = Path(d) / "stage.json"
            if not f.is_absolute():
                f = run_dir / f
            if f.is_file():
                out[name] = json.loads(f.read_text())
        if out:
            return out
    newest: dict[str, tuple[float, dict]] = {}
    for f in run_dir.glob("*/stage.json"):
        rec = json.loads(f.read_text())
        name = rec.get("stage") or f.parent.name.rsplit("-", 1)[0]
        if name not in newest or f.stat().st_mtime > newest[name][0]:
            newest[name] = (f.stat().st_mtime, rec)
    return {k: v for k, (_, v) in newest.items()}


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def wilson(k: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    """95 % Wilson interval of k / n ((0, 1) for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(max(p * (1 - p) / n + z2 / (4 * n * n), 0.0)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def f1_interval(tp: int, fp: int, fn: int, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of F1 = 2tp / (2tp + fp + fn), resampling the decisions (tp / fp / fn outcomes; the
    correlation of decisions within a trace is ignored, so the interval is if anything too narrow)."""
    n = tp + fp + fn
    if n == 0:
        return 0.0, 1.0
    import numpy as np

    draws_ = np.random.default_rng(seed).multinomial(n, [tp / n, fp / n, fn / n], size=draws)
    a, b, c = draws_[:, 0], draws_[:, 1], draws_[:, 2]
    den = 2 * a + b + c
    vals = sorted(np.where(den > 0, 2 * a / np.maximum(den, 1), 0.0).tolist())
    return vals[int(0.025 * (draws - 1))], vals[int(0.975 * (draws - 1))]


def manager_rows(result: dict, served: str = "adapter") -> list[dict]:
    """One row per arm of a `steward eval manager --json` result: F1 and harmful rate with their intervals;
    `served`: the arm the run serves (the `choose` stage's winner; the adapter without one), marked and labelled."""
    arms = result.get("arms") or [a for a in ("base", "adapter") if a in result]
    rows = []
    for arm in arms:
        rec = result.get(arm)
        if not isinstance(rec, dict):
            continue
        deleted, harmful = int(rec.get("deleted") or 0), int(rec.get("harmful") or 0)
        p, r = _num(rec.get("precision")), _num(rec.get("recall"))
        tp = round(p * deleted) if p is not None else deleted - harmful
        fn = round(tp / r - tp) if r else 0
        fp = deleted - tp
        f1 = _num(rec.get("f1")) or 0.0
        lo, hi = f1_interval(tp, fp, fn) if (tp + fp + fn) else (0.0, 1.0)
        ci = rec.get("harmful_rate_ci95") or list(wilson(harmful, deleted))
        label = ARM_LABELS.get(arm, arm) + (" (served)" if arm == served else "")
        rows.append({"arm": arm, "label": label, "served": arm == served, "f1": f1,
                     "f1_ci95": [lo, hi], "harmful_rate": _num(rec.get("harmful_rate")), "harmful_rate_ci95": ci,
                     "deleted": deleted, "harmful": harmful, "tp": tp, "fp": fp, "fn": fn,
                     "precision": p, "recall": r})
    return rows


def longsession_rows(result: dict) -> list[dict]:
    rows = []
    for arm, rec in (result.get("arms") or {}).items():
        for d, cell in sorted(rec.get("by_distance", {}).items(), key=lambda kv: int(kv[0])):
            n = int(cell.get("n") or 0)
            acc = _num(cell.get("forced_acc"))
            lo, hi = wilson((acc or 0.0) * n, n)
            rows.append({"arm": arm, "distance": int(d), "forced_acc": acc, "n": n, "ci95": [lo, hi],
                         "residency": _num(cell.get("residency")), "rotary_gap": _num(cell.get("rotary_gap"))})
    return rows


# --------------------------------------------------------------------------------------------------------- figures

def _save(fig, path: Path, data) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={PNG_KEY: json.dumps(data)})
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure_data(path: Path):
    """The numbers a figure of this module plots (its PNG's `kvsteward` text chunk)."""
    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.text[PNG_KEY])


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _accuracy_panel(ax, rows: list[dict], title: str) -> None:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    labelled: set[tuple[int, str]] = set()  # one label per (distance, value): equal values of several arms overlap
    for i, arm in enumerate(arms):
        mine = [r for r in rows if r["arm"] == arm and r["forced_acc"] is not None]
        xs = [r["distance"] for r in mine]
        ys = [r["forced_acc"] for r in mine]
        err = [[max(0.0, y - r["ci95"][0]) for y, r in zip(ys, mine, strict=True)],
               [max(0.0, r["ci95"][1] - y) for y, r in zip(ys, mine, strict=True)]]
        jittered = [x * (1 + 0.015 * (i - len(arms) / 2)) for x in xs]
        ax.errorbar(jittered, ys, yerr=err, marker="os^vDP*"[i % 7], capsize=3, label=arm)
        for x0, x, y in zip(xs, jittered, ys, strict=True):
            if (x0, f"{y:.2f}") not in labelled:
                labelled.add((x0, f"{y:.2f}"))
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    dists = sorted({r["distance"] for r in rows})
    if len(dists) > 1:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    elif dists:
        ax.set_xlim(dists[0] * 0.94, dists[0] * 1.06)
    ax.set_xticks(dists)
    ax.set_xticklabels([str(d) for d in dists])
    ax.set_ylim(-0.05, 1.1)
    ax.set_xlabel("distance from the definitions to the probe (tokens)")
    ax.set_ylabel("forced-prefix accuracy (95 % Wilson)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _ls_title(ls: dict, what: str) -> str:
    cfg = ls.get("config") or {}
    return f"{what}: B={cfg.get('budget', '?')}, H={cfg.get('chunk', '?')}, L={cfg.get('limit', '?')}"


def plot_accuracy(ls: dict | None, path: Path, reference: dict | None = None) -> dict:
    """Accuracy vs distance per arm: this run's long session, and beside it the shipped 8K reference (if given)."""
    plt = _plt()
    panels = [(k, v) for k, v in (("run", ls), ("reference", reference)) if v and v.get("arms")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.0), squeeze=False)
    data = {}
    for ax, (key, result) in zip(axes[0], panels, strict=True):
        data[key] = longsession_rows(result)
        what = ("this run" if key == "run" else "shipped 8K reference (not run by the demo)")
        _accuracy_panel(ax, data[key], _ls_title(result, what))
    _save(fig, path, data)
    return data


def residency_of_longsession(result: dict | None) -> dict | None:
    """The residency record (`steward pipeline residency`'s shape) from a long-session result's own plays: each
    arm's `resident_series` (one session per arm), its peak and the run's B, H, L."""
    arms = (result or {}).get("arms") or {}
    series = {a: rec["resident_series"]["points"] for a, rec in arms.items() if rec.get("resident_series")}
    if not series:
        return None
    cfg = result.get("config") or {}
    return {"series": series, "peak_resident": {a: arms[a].get("peak_resident_slots") for a in series},
            "budget": cfg.get("budget"), "chunk": cfg.get("chunk"), "limit": cfg.get("limit"),
            "session": next(iter(arms[a]["resident_series"]["session"] for a in series))}


def plot_residency(res: dict, path: Path) -> dict:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    series = res.get("series") or {}
    data = {}
    for arm, pts in series.items():
        xs = [p["tokens"] for p in pts]
        ys = [p["kv_bytes"] / 2**20 for p in pts]
        peak = (res.get("peak_resident") or {}).get(arm, max(p["resident"] for p in pts))
        ax.plot(xs, ys, marker=".", label=f"{arm} (engine peak {peak} slots)")
        data[arm] = [{"tokens": p["tokens"], "resident": p["resident"], "kv_mib": p["kv_bytes"] / 2**20}
                     for p in pts]
    ax.set_xlabel("session length (tokens appended)")
    ax.set_ylabel("resident KV after each message (MiB)")
    ax.set_title(f"Resident KV vs session length (B={res.get('budget')}, H={res.get('chunk')}, "
                 f"L={res.get('limit')})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, data)
    return data


def plot_manager(sets: dict[str, list[dict]], path: Path) -> dict:
    plt = _plt()
    fig, axes = plt.subplots(len(sets), 2, figsize=(9.0, 1.0 + 0.42 * sum(len(r) for r in sets.values())
                                                                + 0.5 * len(sets)), squeeze=False)
    for (name, rows), (a_f1, a_h) in zip(sets.items(), axes, strict=True):
        labels = [r["label"] for r in rows]
        ys = list(range(len(rows)))[::-1]
        for ax, key, title in ((a_f1, "f1", "deletion F1 (higher is better)"),
                               (a_h, "harmful_rate", "harmful rate (lower is better)")):
            vals = [r[key] if r[key] is not None else float("nan") for r in rows]
            lo = [max(0.0, v - r[f"{key}_ci95"][0]) if v == v else 0 for v, r in zip(vals, rows, strict=True)]
            hi = [max(0.0, r[f"{key}_ci95"][1] - v) if v == v else 0 for v, r in zip(vals, rows, strict=True)]
            colors = ["#d62728" if r["served"] else "#7f7f7f" for r in rows]
            ax.barh(ys, [0 if v != v else v for v in vals], xerr=[lo, hi], color=colors, capsize=3, alpha=0.85)
            for y, v in zip(ys, vals, strict=True):
                ax.text(0.01, y, "n/a" if v != v else f"{v:.2f}", va="center", fontsize=7, color="white")
            ax.set_yticks(ys)
            ax.set_yticklabels(labels if ax is a_f1 else [""] * len(rows), fontsize=8)
            ax.set_xlim(0, 1)
            ax.set_title(f"{TEST_SETS.get(name, name)}: {title}", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
    _save(fig, path, sets)
    return sets


def plot_serving(serve: dict, path: Path) -> dict:
    plt = _plt()
    turns = serve.get("turns") or []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.0, 3.6), gridspec_kw={"width_ratios": [3, 1.2]})
    keys = (("prompt_tokens", "prompt tokens"), ("resident_tokens", "resident KV tokens"),
            ("next_position", "next position"), ("reused_tokens", "reused from cache"))
    width = 0.8 / max(len(turns), 1)
    for i, t in enumerate(turns):
        vals = [t.get(k) or 0 for k, _ in keys]
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, vals, width=width, label=t["name"])
        for x, v in zip(xs, vals, strict=True):
            ax.text(x, v, str(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + width * (len(turns) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([k[1] for k in keys], fontsize=8)
    ax.set_title("steward serve: the same conversation, whole cache vs drop + reposition", fontsize=9)
    ax.legend(fontsize=7)
    ax2.bar(range(len(turns)), [t.get("latency_s") or 0 for t in turns], color="#1f77b4")
    for i, t in enumerate(turns):
        ax2.text(i, t.get("latency_s") or 0, f"{t.get('latency_s') or 0:.2f}s", ha="center", va="bottom",
                 fontsize=7)
    ax2.set_xticks(range(len(turns)))
    ax2.set_xticklabels([t["name"] for t in turns], fontsize=7, rotation=20)
    ax2.set_title("latency (s)", fontsize=9)
    data = [{k: t.get(k) for k in ("name", "prompt_tokens", "resident_tokens", "next_position", "reused_tokens",
                                    "latency_s", "prefix_match")} for t in turns]
    _save(fig, path, data)
    return {"turns": data}


# ------------------------------------------------------------------------------------------------------------ page

def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(c) -> str:
    if c is None:
        return "–"
    if isinstance(c, float):
        return "–" if not math.isfinite(c) else (f"{c:.3g}" if abs(c) < 1e-3 and c else f"{c:.3f}")
    return str(c)


def _img(path: Path, alt: str) -> str:
    b64 = base64.b64encode(path.read_bytes()).decode()
    return (f'<p><a href="{html.escape(path.name)}"><img src="data:image/png;base64,{b64}" alt="{html.escape(alt)}" '
            f'style="max-width:100%"></a></p>')


def _ci(c) -> str:
    return "–" if not c else f"[{c[0]:.2f}, {c[1]:.2f}]"


def _paired(p: dict | None) -> str:
    if not p:
        return "–"
    return f"{p.get('better')} / {p.get('worse')} (p={p.get('p', float('nan')):.2g})"


def _reference() -> dict | None:
    """The shipped 8K long-session reference (`pipelines/reference.py`), None if it is not there."""
    from kvsteward.pipelines import reference

    return reference.load() if reference.ARTIFACT.is_file() else None


CSS = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;"
       "font-size:13px;text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}"
       ".note{color:#555;font-size:13px}code{background:#f3f3f3;padding:0 3px}")


def build_report(run_dir: Path, mlflow_log: bool = True) -> dict:
    """Write RUN_DIR/report.html and its PNGs; returns {"html", "figures": {name: path}, "mlflow_run_id"}."""
    run_dir = Path(run_dir)
    recs = load_run(run_dir)
    if not recs:
        raise ValueError(f"{run_dir} holds no finished pipeline stage (no */stage.json)")
    index = json.loads((run_dir / "pipeline.json").read_text()) if (run_dir / "pipeline.json").is_file() else {}
    res = {k: (v.get("result") or {}) for k, v in recs.items()}
    figures: dict[str, Path] = {}
    parts = [f"<h1>kvsteward run: {html.escape(str(run_dir))}</h1>",
             f"<p class=note>Built {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from {len(recs)} finished stages"
             + (f"; MLflow parent run <code>{html.escape(index['mlflow_run_id'])}</code>"
                if index.get("mlflow_run_id") else "") + ".</p>"]

    eng = res.get("engine")
    if eng:
        ops = eng.get("op_max_abs_logit_err") or {}
        steps = eng.get("renumber_steps", 500)
        rerot = eng.get("rerotation_max_abs_err") or {}
        rows = [["generate() equivalence", json.dumps(eng.get("generate_equivalence"))],
                *[[f"{k} vs the reference replay on transformers' cache, max |Δlogit|", v] for k, v in ops.items()],
                [f"fp32 re-rotation vs the float64 truth, max |err| over {len(rerot)} RoPE types × layouts",
                 max(rerot.values()) if rerot else None],
                ["bf16 re-rotation, max error in ulps", eng.get("rerotation_bf16_max_ulp")],
                [f"{steps} bf16 renumbers from the fp32 reference key, max |err|",
                 eng.get("renumber_max_abs_err", eng.get("renumber_500_max_abs_err"))],
                [f"{steps} chained bf16 renumbers (what the engine never does), max |err|",
                 eng.get("renumber_chained_max_abs_err", eng.get("renumber_500_chained_max_abs_err"))],
                [f"budget run: peak resident slots over {eng.get('budget_tokens')} tokens (B={eng.get('budget')}, "
                 f"H={eng.get('chunk')})", eng.get("budget_peak_slots")]]
        parts += ["<h2>Engine exactness self-check</h2>", _table(["check", "result"], rows)]

    ls = res.get("longsession")
    ref = _reference()
    if (ls and ls.get("arms")) or ref:
        figures["accuracy_vs_distance"] = run_dir / "accuracy_vs_distance.png"
        data = plot_accuracy(ls, figures["accuracy_vs_distance"], ref)
        parts += ["<h2>Long session: who still answers</h2>",
                  "<p class=note>Forced-prefix accuracy on fact probes whose definitions sit D tokens back; every "
                  "arm of a panel plays the same sessions (budget B, chunk H, position limit L of the bounded arms; "
                  "the full arm keeps everything). Intervals: 95 % Wilson over the probes of a cell.</p>",
                  _img(figures["accuracy_vs_distance"], "accuracy vs distance")]
        for key, result in (("run", ls), ("reference", ref)):
            if key not in data:
                continue
            if key == "reference":
                parts += ["<h3>Shipped reference: 8K sessions, 30 probes per cell (not run by this demo)</h3>",
                          f"<p class=note>From <code>{html.escape(ref['source'])}</code> (sha256 "
                          f"{ref['source_sha256'][:12]}…), measured {html.escape(ref['measured'])}. Reproduce with "
                          f"one command ({html.escape(ref['wall'])}):<br><code>{html.escape(ref['command'])}</code>"
                          f"<br>Inputs: model GGUF sha256 {ref['inputs']['model_gguf']['sha256'][:16]}…, sessions "
                          f"sha256 {ref['inputs']['sessions']['sha256'][:16]}… "
                          f"(<code>pipelines/reference/longsession-8k.json</code>).</p>"]
            else:
                parts += [f"<h3>This run ({html.escape(_ls_title(result, 'live'))})</h3>"]
            parts += [_table(["arm", "D", "accuracy", "95 % CI", "probes", "residency", "rotary gap"],
                             [[r["arm"], r["distance"], r["forced_acc"], _ci(r["ci95"]), r["n"], r["residency"],
                               r["rotary_gap"]] for r in data[key]]),
                      _table(["arm", "peak resident slots", "wall s",
                              f"vs {result.get('reference', 'h2o')}: better / worse (p)"],
                             [[a, rec.get("peak_resident_slots"), rec.get("wall_s"),
                               _paired((result.get("paired") or {}).get(a))] for a, rec in result["arms"].items()])]

    resid = res.get("residency") or residency_of_longsession(ls)
    if resid and resid.get("series"):
        figures["resident_kv"] = run_dir / "resident_kv.png"
        data = plot_residency(resid, figures["resident_kv"])
        parts += ["<h2>Resident KV vs session length</h2>",
                  "<p class=note>Measured after every chunk of the same session: the full cache grows with the "
                  "session, the budgeted arms stay flat at B + H slots.</p>",
                  _img(figures["resident_kv"], "resident KV vs session length"),
                  _table(["arm", "at tokens", "resident slots", "resident KV MiB"],
                         [[a, pts[-1]["tokens"], pts[-1]["resident"], pts[-1]["kv_mib"]] for a, pts in data.items()])]

    choice = res.get("choose") or {}
    served = choice.get("choice") or "adapter"
    sets = {name: manager_rows(res[name], served) for name in TEST_SETS if res.get(name)}
    sets = {k: v for k, v in sets.items() if v}
    if sets:
        figures["manager_arms"] = run_dir / "manager_arms.png"
        plot_manager(sets, figures["manager_arms"])
        train = res.get("train") or {}
        cal = res.get("calibrate") or {}
        chosen = cal.get("chosen") or cal.get("choice") or {}
        rule = (" (" + html.escape(json.dumps(chosen)) + ")") if chosen else ""
        if choice:
            what = (f"the manager chosen on validation traces: <b>{html.escape(ARM_LABELS.get(served, served))}</b> "
                    f"({html.escape(choice.get('reason', ''))}), what <code>steward serve --manager "
                    f"{html.escape(str(choice.get('manager_dir', 'DIR')))}</code> serves. The LoRA adapter this "
                    "run trained" + (f" ({train.get('steps', train.get('max_steps', '?'))} steps)" if train else "")
                    + f" ran with the decode rule chosen on the same traces{rule}")
        else:
            what = ("the LoRA adapter this run trained"
                    + (f" ({train.get('steps', train.get('max_steps', '?'))} steps)" if train else "")
                    + f", with the decode rule chosen on validation traces{rule}: what "
                      "<code>steward serve --adapter</code> loads")
        parts += ["<h2>Memory managers: the served manager beside the others</h2>",
                  "<p class=note>Every arm decides at the same boundaries of the same traces. The served manager "
                  f"(red) is {what}. F1: 95 % bootstrap over decisions; harmful rate (deleted responses a later "
                  "step reads): 95 % Wilson over deletions.</p>",
                  _img(figures["manager_arms"], "manager arms")]
        for name, rows in sets.items():
            parts += [f"<h3>{html.escape(TEST_SETS[name])} ({res[name].get('n_traces', '?')} traces)</h3>",
                      _table(["arm", "F1", "F1 95 % CI", "harmful rate", "harmful 95 % CI", "deleted", "harmful"],
                             [[r["label"], r["f1"], _ci(r["f1_ci95"]), r["harmful_rate"], _ci(r["harmful_rate_ci95"]),
                               r["deleted"], r["harmful"]] for r in rows])]
    audit = (res.get("hindsight") or {}).get("audit")
    if audit and audit.get("baselines"):
        parts += ["<h3>Shortcut audit (validation, fitted on the environment itself)</h3>",
                  _table(["baseline", "F1"], [[k, (v or {}).get("f1")] for k, v in audit["baselines"].items()])]

    serve = res.get("serve")
    if serve and serve.get("turns"):
        figures["serving"] = run_dir / "serving.png"
        plot_serving(serve, figures["serving"])
        parts += ["<h2>Serving: one round trip through <code>steward serve</code></h2>",
                  f"<p class=note>OpenAI client against <code>{html.escape(str(serve.get('command', '')))}</code>."
                  "</p>", _img(figures["serving"], "serving comparison"),
                  _table(["request", "cache ops", "prompt tokens", "reused", "resident", "next position", "match",
                          "latency s", "reply"],
                         [[t["name"], json.dumps(t.get("cache") or {}), t.get("prompt_tokens"), t.get("reused_tokens"),
                           t.get("resident_tokens"), t.get("next_position"), t.get("prefix_match"),
                           t.get("latency_s"), (t.get("reply") or "")[:80]] for t in serve["turns"]])]

    stage_rows = [[name, "cached" if rec.get("cached") else _cell(rec.get("wall_s")), rec.get("dir", "")]
                  for name, rec in recs.items()]
    parts += ["<h2>Stages</h2>", _table(["stage", "wall s (when it ran)", "folder"],
                                        [[n, _cell(recs[n].get("wall_s")), recs[n].get("dir", "")] for n in recs]
                                        if stage_rows else [])]
    out = run_dir / "report.html"
    out.write_text("<!doctype html><html><head><meta charset=utf-8><title>kvsteward run report</title>"
                   f"<style>{CSS}</style></head><body>" + "\n".join(parts) + "</body></html>\n")
    run_id = _log_mlflow(index.get("mlflow_run_id"), out, figures) if mlflow_log else None
    return {"html": out, "figures": figures, "mlflow_run_id": run_id}


def _log_mlflow(run_id: str | None, page: Path, figures: dict[str, Path]) -> str | None:
    """The page and its PNGs as artifacts of the pipeline's parent run (under `report/`)."""
    if not run_id:
        return None
    import mlflow

    from kvsteward.train.tracking import ensure_tracking

    ensure_tracking()
    client = mlflow.MlflowClient()
    client.log_artifact(run_id, str(page), "report")
    for p in figures.values():
        client.log_artifact(run_id, str(p), "report")
    return run_id
