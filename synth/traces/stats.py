"""`steward synth stats`: counts, lengths, and an independent re-check of every deletion label.

The re-check does not use the annotator's code: it reads the raw traces again, takes each cursor's last reader
straight from the `reads` records, finds the cursors actually open in each row by parsing the row's own messages
(`[cursor N]` tags of the tool messages present), and counts
- a cursor marked for deletion that a step at or after the row's boundary reads (harmful),
- an open cursor whose last use is before the boundary that is not marked (missed),
- a marked cursor that is not open in the row's context (invalid),
- a row whose trigger or target message is not where it must be (the trigger must list exactly the open cursors),
- an aux row whose labelled tokens do not decode to its target (the trainer learns from the tokens, not the text).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from kvsteward.synth.traces.dataset import CARD_JSON, SPLITS

_TAG = re.compile(r"^\[cursor (\d+)\]")


def _last_use_from_raw(trace_file: Path) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    with open(trace_file) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            last = {i: -1 for i, m in enumerate(rec["messages"]) if m["role"] == "tool"}
            for step, cursors in rec["reads"].items():
                for c in cursors:
                    last[int(c)] = max(last.get(int(c), -1), int(step))
            out[rec["task_id"]] = last
    return out


def _lists_open_cursors(trigger: str, open_: list[int]) -> bool:
    """The trigger is one of the two layouts over exactly these open cursors: `ids` (the phrase, the id list) or
    `notes` (the phrase, a task line, the id list, then one note line per open cursor in order)."""
    listed = f"Open cursors: {', '.join(str(c) for c in open_) or 'none'}"
    lines = trigger.split("\n")
    if lines == ["Memory management mode", listed]:
        return True
    k = len(lines) - len(open_)  # note lines hold no newline: count them from the end (a task may span lines)
    return k >= 3 and lines[0] == "Memory management mode" and lines[1].startswith("Task: ") and \
        lines[k - 1] == listed and all(line.startswith(f"{c}: ") for line, c in zip(lines[k:], open_, strict=True))


def delete_row_errors(messages: list[dict], step: int, last: dict[int, int]) -> Counter:
    errs: Counter = Counter()
    open_ = {int(m.group(1)) for msg in messages[:-2] if msg["role"] == "tool"
             for m in [_TAG.match(msg["content"])] if m}
    # the trigger lists exactly the open cursors (spelled out here, not taken from `hindsight.delete_trigger`)
    if len(messages) < 2 or messages[-2].get("role") != "user" or \
            not _lists_open_cursors(messages[-2]["content"], sorted(open_)):
        errs["format"] += 1
        return errs
    try:
        marked = set(json.loads(messages[-1]["content"])["del_cursors"])
    except (json.JSONDecodeError, KeyError, TypeError):
        errs["format"] += 1
        return errs
    for c in marked:
        if c not in open_:
            errs["invalid"] += 1
        elif last.get(c, -1) >= step:
            errs["harmful"] += 1
    for c in open_ - marked:
        if last.get(c, -1) < step:
            errs["missed"] += 1
    return errs


def resolve_traces(ds_dir: Path, traces: str | Path | None) -> Path:
    if traces is None:
        card = ds_dir / CARD_JSON
        if not card.exists():
            raise FileNotFoundError(f"{card} is missing: pass --traces DIR (the raw traces the dataset was built from)")
        traces = json.loads(card.read_text())["source_traces"]
    p = Path(traces)
    p = p / "traces.jsonl" if p.is_dir() else p
    if not p.exists():
        raise FileNotFoundError(f"raw traces {p} not found: pass --traces DIR")
    return p


def dataset_stats(ds_dir: str | Path, traces: str | Path | None = None, check_tokens: bool = True) -> dict[str, Any]:
    """The stats JSON of `steward synth stats`. `check_tokens` also decodes every aux row's labels (needs the
    tokenizer) and counts rows whose labelled tokens do not spell the target exactly."""
    from datasets import load_from_disk

    ds_dir = Path(ds_dir)
    if not (ds_dir / "dataset_dict.json").exists():
        raise FileNotFoundError(f"{ds_dir} is not a saved DatasetDict (made by `steward synth hindsight`)")
    dd = load_from_disk(str(ds_dir))
    last = _last_use_from_raw(resolve_traces(ds_dir, traces))
    kinds: Counter = Counter()
    errs: Counter = Counter()
    lengths, seen = [], set()
    decode = _label_decoder(ds_dir) if check_tokens else None
    for split in SPLITS:
        if split not in dd or len(dd[split]) == 0:  # select_columns fails on an empty split
            continue
        cols = dd[split].select_columns(["task_id", "kind", "step", "messages", "n_tokens", "labels", "target"]
                                        + (["segment"] if "segment" in dd[split].column_names else []))
        for row in cols:
            kinds[row["kind"]] += 1
            lengths.append(row["n_tokens"])
            if row["task_id"] not in last:
                errs["unknown_task"] += 1
                continue
            seen.add(row["task_id"])
            if row["kind"] == "packed":
                errs += _packed_errors(row, last[row["task_id"]], decode)
                continue
            if row["kind"] == "delete":
                errs += delete_row_errors(json.loads(row["messages"]), row["step"], last[row["task_id"]])
            if decode and row["kind"] != "main" and not _labels_spell_target(decode, row["labels"], row["target"]):
                errs["label_tokens"] += 1
    cursors = [len(last[t]) for t in seen]
    return {
        "splits": {s: len(dd[s]) if s in dd else 0 for s in SPLITS},
        "aux_delete": kinds["delete"], "aux_plan": kinds["plan"], "main": kinds["main"], "packed": kinds["packed"],
        "mean_tokens": sum(lengths) / max(len(lengths), 1), "max_tokens": max(lengths, default=0),
        "mean_cursors": sum(cursors) / max(len(cursors), 1),
        "label_errors": sum(errs[k] for k in _ERROR_KINDS),
        "label_error_kinds": {k: errs[k] for k in _ERROR_KINDS},
    }


_ERROR_KINDS = ("harmful", "missed", "invalid", "format", "unknown_task", "label_tokens")


def _packed_errors(row: dict, last: dict[int, int], decode) -> Counter:
    """A packed row's calls, each checked as the per-boundary row it stands for (its context rebuilt from the
    trace and the cursors dropped before it), and each branch's labelled tokens against its target."""
    from kvsteward.synth.traces.packed import call_messages

    errs: Counter = Counter()
    messages = json.loads(row["messages"])
    for call in json.loads(row["target"]):
        if call["kind"] == "delete":
            errs += delete_row_errors(call_messages(messages, call), call["boundary"], last)
        if decode:
            labels = [t for t, s in zip(row["labels"], row["segment"], strict=True) if s == call["segment"]]
            if not _labels_spell_target(decode, labels, call["target"]):
                errs["label_tokens"] += 1
    return errs


def _label_decoder(ds_dir: Path):
    """Tokenizer of the model the dataset was tokenized with (from the card), to read the labelled tokens back."""
    from kvsteward.models import load_tokenizer

    card = ds_dir / CARD_JSON
    model = json.loads(card.read_text())["config"]["model"] if card.exists() else "smollm2"
    tok = load_tokenizer(model)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _labels_spell_target(decode, labels: list[int], target: str) -> bool:
    """The labelled tokens decode to exactly the target JSON (plus only the end-of-turn special token)."""
    return decode([t for t in labels if t != -100]).strip() == target
