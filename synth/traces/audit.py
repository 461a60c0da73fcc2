"""The shortcut audit (`steward synth audit DS`): can a cheap surface rule recover a dataset's hindsight labels?

A learned manager is only worth training on labels that need reading: if a rule over positions or a bag of words
over the notes reaches the oracle, a model can score well by learning that rule. The audit fits every baseline of
`synth.traces.baselines` on the train split's deletion decisions (`synth.traces.decisions`), scores them on the
validation split,
and flags each one whose validation F1 reaches `FLAG_F1` ("labels recoverable by a surface rule"). It reports the
numbers overall, per environment and per cue (when the traces carry cues), records them as `audit` in the dataset's
card.json and README.md, and saves the fitted baselines under `DS/baselines/` for the evaluation's non-model arms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsteward.synth.traces import baselines as bl
from kvsteward.synth.traces.decisions import Decision, DecisionError, decisions_from_split

FLAG_F1 = 0.95
FLAG_MESSAGE = "labels recoverable by a surface rule"
BASELINES_DIR = "baselines"
METRIC_KEYS = ("f1", "precision", "recall", "harmful_rate", "harmful_rate_ci95", "deleted", "n_decisions", "expired",
               "accuracy")
# per group, what the breakdown tables show: F1 per environment; accuracy per cue, since many cues label every one
# of their cursors "keep" (a recap fact, a pending list), where F1 is 0 or undefined whatever a rule does
GROUPS = (("environment", "by_env", "f1"), ("cue", "by_cue", "accuracy"))
NO_CUE = "(none)"


class AuditError(ValueError):
    """A dataset the audit cannot run on: missing, not a DatasetDict, packed, or without train / validation
    decisions."""


def load_dataset(path: str | Path):
    """The DatasetDict saved at `path` (`steward synth hindsight`), or an AuditError saying why not."""
    from datasets import Dataset, load_from_disk

    path = Path(path).expanduser()
    if not path.is_dir():
        raise AuditError(f"dataset folder {path} does not exist (make it with `steward synth hindsight`)")
    try:
        dd = load_from_disk(str(path))
    except FileNotFoundError as e:
        raise AuditError(f"{path} is not a saved DatasetDict ({e})") from e
    if isinstance(dd, Dataset) or "train" not in dd or "validation" not in dd:
        raise AuditError(f"{path} must hold a DatasetDict with train and validation splits")
    return dd


def split_decisions(dd) -> tuple[list[Decision], list[Decision]]:
    """(train, validation) decisions of a DatasetDict; packed datasets are refused (DecisionError → AuditError)."""
    try:
        return decisions_from_split(dd["train"]), decisions_from_split(dd["validation"])
    except DecisionError as e:
        raise AuditError(str(e)) from e


def evaluate(fitted: dict[str, bl.Baseline], decisions: Sequence[Decision], point: str = "f1") -> dict[str, dict]:
    """Per baseline, the pooled metrics (`baselines.metrics`) of its deletions at `point` over `decisions`."""
    labels = [bool(d.label) for d in decisions]
    return {n: bl.metrics(labels, b.predict(decisions, point)) for n, b in fitted.items()}


def _grouped(fitted: dict[str, bl.Baseline], decisions: Sequence[Decision], key) -> dict[str, dict]:
    groups: dict[str, list[Decision]] = {}
    for d in decisions:
        groups.setdefault(key(d), []).append(d)
    return {g: {n: _public(m) for n, m in evaluate(fitted, ds).items()} for g, ds in sorted(groups.items())}


def _public(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m[k] for k in METRIC_KEYS}


def _baseline_entry(b: bl.Baseline, val: dict[str, Any], safe: dict[str, Any]) -> dict[str, Any]:
    """A baseline's audit record: validation metrics at its F1 point, its setting and train F1, and the same at the
    safe point (None when no setting kept train's harmful deletions under the cap)."""
    f1_point, safe_point = b.points["f1"], b.points["safe"]
    return {**_public(val), "setting": f1_point["setting"], "train_f1": f1_point["train"]["f1"],
            "safe": None if safe_point is None else {**_public(safe), "setting": safe_point["setting"],
                                                     "train_f1": safe_point["train"]["f1"],
                                                     "train_harmful_rate": safe_point["train"]["harmful_rate"]}}


def flags(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each baseline whose validation F1 reaches FLAG_F1: overall, and per environment when there are several."""
    out = [{"baseline": n, "env": None, "f1": m["f1"], "message": FLAG_MESSAGE}
           for n, m in result["baselines"].items() if (m["f1"] or 0) >= FLAG_F1]
    if len(result["by_env"]) > 1:
        out += [{"baseline": n, "env": e, "f1": m["f1"], "message": FLAG_MESSAGE}
                for e, per in result["by_env"].items() for n, m in per.items() if (m["f1"] or 0) >= FLAG_F1]
    return out


def audit_decisions(train: Sequence[Decision], val: Sequence[Decision]) -> tuple[dict[str, Any], dict]:
    """(audit result, fitted baselines): fit on `train`, score on `val`."""
    if not train:
        raise AuditError("the train split has no deletion decisions (no delete row with a read open cursor)")
    if not val:
        raise AuditError("the validation split has no deletion decisions (no delete row with a read open cursor)")
    t0 = time.perf_counter()
    fitted = bl.fit_all(train)
    at_f1, at_safe = evaluate(fitted, val), evaluate(fitted, val, "safe")
    result: dict[str, Any] = {
        "baselines": {n: _baseline_entry(b, at_f1[n], at_safe[n]) for n, b in fitted.items()},
        "oracle_f1": 1.0,  # the hindsight labels themselves
        "n_decisions": len(val), "n_train_decisions": len(train),
        "positive_rate": sum(bool(d.label) for d in val) / len(val),
        "by_env": _grouped(fitted, val, lambda d: d.env or "unknown"),
    }
    if any(d.cue for d in val):
        result["by_cue"] = _grouped(fitted, val, lambda d: d.cue or NO_CUE)
    result["flags"] = flags(result)
    result.update({"flag_f1": FLAG_F1, "safe_harmful": bl.SAFE_HARMFUL,
                   "wall_s": round(time.perf_counter() - t0, 2)})
    return result, fitted


def audit_dataset(dd) -> tuple[dict[str, Any], dict]:
    """`audit_decisions` over a DatasetDict's train and validation splits."""
    return audit_decisions(*split_decisions(dd))


def write_audit(path: str | Path, result: dict[str, Any], fitted: dict[str, bl.Baseline]) -> dict[str, Any]:
    """Record `result` as `audit` in path/card.json and path/README.md; save the fitted baselines under
    path/baselines/. Returns the updated card."""
    from kvsteward.synth.traces.dataset import CARD_JSON, CARD_MD, card_markdown

    path = Path(path)
    card_file = path / CARD_JSON
    card = json.loads(card_file.read_text()) if card_file.is_file() else {}
    card["audit"] = result
    card_file.write_text(json.dumps(card, indent=2))
    full = "label_sources" in card  # a card written by `steward synth hindsight`, else only the audit section
    (path / CARD_MD).write_text(card_markdown(card) if full else audit_markdown(result) + "\n")
    bl.save_baselines(fitted, path / BASELINES_DIR)
    return card


def run_audit(path: str | Path, write: bool = True) -> dict[str, Any]:
    """The audit of the dataset saved at `path`, recorded there unless `write` is False."""
    result, fitted = audit_dataset(load_dataset(path))
    if write:
        write_audit(path, result, fitted)
    return result


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def num_text(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def setting_text(setting: dict[str, Any] | None) -> str:
    """A setting in a table cell: `K=3`, `C=0.03, threshold=0.41`, `–` when there is none."""
    if not setting:
        return "–"
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items())


def table_rows(baselines: dict[str, dict[str, Any]]) -> list[list[str]]:
    """[name, setting, F1, precision, recall, harmful rate (95 % CI), deleted / n] per baseline, as text."""
    rows = []
    for n, m in baselines.items():
        lo, hi = m["harmful_rate_ci95"]
        rows.append([n, setting_text(m.get("setting")), *(num_text(m[k]) for k in ("f1", "precision", "recall")),
                     f"{_pct(m['harmful_rate'])} ({lo:.1%}–{hi:.1%})", f"{m['deleted']} / {m['n_decisions']}"])
    return rows


HEADER = ["baseline", "setting (train)", "F1", "precision", "recall", "harmful (95% CI)", "deleted / decisions"]


def _md_table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] + ["| " + " | ".join(r) + " |"
                                                                            for r in rows]


def shown(a: dict[str, Any], key: str) -> bool:
    """Whether a breakdown is worth a table: several environments, or any cue."""
    groups = a.get(key) or {}
    return len(groups) > 1 or (key == "by_cue" and bool(groups))


def group_table(a: dict[str, Any], key: str, measure: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a breakdown: group, decisions, share expired, then `measure` per baseline."""
    header = [key.removeprefix("by_"), "n", "expired", *a["baselines"]]
    rows = []
    for g, per in a[key].items():
        first = next(iter(per.values()))
        rows.append([g, str(first["n_decisions"]), _pct(_share(first["expired"], first["n_decisions"])),
                     *(num_text(m[measure]) for m in per.values())])
    return header, rows


def _share(k: int, n: int) -> float | None:
    return k / n if n else None


def audit_markdown(a: dict[str, Any]) -> str:
    """The README's "Audit" section: the validation table, the flags, per environment and per cue."""
    lines = ["## Audit", "",
             f"Cheap non-model baselines fitted on the train split's {a['n_train_decisions']} deletion decisions, "
             f"scored on the validation split's {a['n_decisions']} ({a['positive_rate']:.1%} expired); oracle F1 "
             f"{a['oracle_f1']:.1f}. Settings chosen on train by F1 (`steward synth audit`; fitted baselines in "
             f"`{BASELINES_DIR}/`).", ""] + _md_table(table_rows(a["baselines"])) + [""]
    if a["flags"]:
        lines += [f"**Flagged** (validation F1 ≥ {a['flag_f1']}: {FLAG_MESSAGE}): " + ", ".join(
            f"`{f['baseline']}`" + (f" on {f['env']}" if f["env"] else "") + f" ({f['f1']:.3f})" for f in a["flags"])
            + ".", ""]
    else:
        lines += [f"No baseline reaches validation F1 {a['flag_f1']}.", ""]
    for title, key, measure in GROUPS:
        if shown(a, key):
            header, rows = group_table(a, key, measure)
            lines += [f"{measure.capitalize() if measure != 'f1' else 'F1'} by {title}:", "",
                      "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    return "\n".join(lines).rstrip()
