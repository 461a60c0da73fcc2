"""Deletion decisions: the unit the shortcut audit, its baselines and the evaluation's non-model arms all score.

A decision is (trace, boundary b, open cursor c that the agent has already read); its label is "delete" iff c is
expired at b (no step >= b reads it: `synth.traces.hindsight.expired`). The unread open cursors (the tool messages at
the
end of the context, `hindsight.unread_cursors`) are never decisions: the next step reads them, so every manager
keeps them (the serving decoder never offers them).

Each decision carries what a cheap baseline may look at — the task (first user message), the cursor's body, the
agent's note after it (`hindsight.cursor_notes`, as the `notes` trigger shows it), the tool call that produced it,
how many agent steps ago it arrived, its recency rank among the read open cursors and its structural features
(`synth.traces.structure`: identifiers introduced and followed, overlaps with the task and the other responses) — so a
surface rule that recovers the labels shows up as a baseline that scores well (`synth.traces.audit`).

Two sources, which agree on the same boundary: `decisions_at` over a visible context indexed as the cursor ids (what
`eval.manager.evaluate.replay` hands its decision function), and `decisions_from_split` over a hindsight dataset's
`delete`
rows (pre-masked contexts, rebuilt to that indexing from the `[cursor N]` tags and the row's `masked_cursors`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kvsteward.synth.traces.hindsight import boundaries, cursor_notes, expired, unread_cursors
from kvsteward.synth.traces.structure import structure_features
from kvsteward.synth.traces.toolcall import cursor_body, cursor_content, cursor_id, parse_tool_calls
from kvsteward.synth.traces.trace import Trace

# What a masked (pre-deleted) tool message is replaced with when a row's context is re-indexed: it only holds the
# position, so that call indices and step counts come out as in the full trace; nothing ever reads its text.
MASKED_BODY = "(deleted)"
ROW_COLUMNS = ("kind", "task_id", "step", "messages", "open_cursors", "masked_cursors", "target")


class DecisionError(ValueError):
    """A dataset or context the decisions cannot be read from (packed rows, inconsistent cursor tags)."""


@dataclass(frozen=True)
class Decision:
    """One (trace, boundary, read open cursor) deletion decision and the features a baseline may use."""

    trace_id: str
    env: str
    boundary: int
    cursor: int
    label: bool | None  # True: expired at the boundary (delete); None when unknown (serving)
    cue: str  # the generator's reason for this cursor ("" when the trace has none)
    task: str  # the first user message
    body: str  # the tool response without its `[cursor N]` tag
    note: str  # what the agent wrote right after reading it (`cursor_notes`)
    call: str  # the producing tool call: name + JSON arguments ("" when none precedes it)
    steps_since: int  # assistant messages between the cursor and the boundary
    recency: int  # 0 = the most recent read open cursor, 1 = the one before, ...
    structure: tuple[float, ...] = ()  # `synth.traces.structure.FEATURES`: its place in the agent's visible progress
    # a per-response adapter's P(no: not needed) for this cursor at this boundary (`eval.manager.stack`), the
    # `stack` rule's one model feature; None where no model read the context
    model_score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _task(messages: list[dict]) -> str:
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


def producing_call(messages: list[dict], cursor: int) -> str:
    """`name {arguments}` of the call whose response is message `cursor`: the assistant message before it (past the
    other responses of the same turn), its k-th call for the k-th response of the turn (the last call when fewer)."""
    a = cursor - 1
    while a >= 0 and messages[a].get("role") == "tool":
        a -= 1
    if a < 0 or messages[a].get("role") != "assistant":
        return ""
    try:
        _, calls = parse_tool_calls(messages[a].get("content") or "")
    except ValueError:  # a malformed call block: no call to show (the note and the body still are)
        return ""
    if not calls:
        return ""
    call = calls[min(cursor - a - 1, len(calls) - 1)]
    return f"{call['name']} {json.dumps(call.get('arguments', {}), sort_keys=True, ensure_ascii=False)}"


def decisions_at(messages: list[dict], open_cursors: Iterable[int], boundary: int,
                 label_fn: Callable[[int], bool] | None = None, trace_id: str = "", env: str = "",
                 cues: dict[int, str] | None = None) -> list[Decision]:
    """The decisions at `boundary` over the read cursors among `open_cursors`, oldest first.

    `messages` is the context indexed as the cursor ids (message i is cursor i; deleted messages included, as the
    replay passes them), at least `boundary` long; only `messages[:boundary]` is read. `label_fn(cursor)` gives the
    label (None: labels unknown)."""
    seen = messages[:boundary]
    unread = set(unread_cursors(seen))
    open_cursors = set(open_cursors)
    read = sorted(c for c in open_cursors if c not in unread)
    for c in read:
        if not 0 <= c < boundary or seen[c].get("role") != "tool":
            raise DecisionError(f"{trace_id or 'context'}: open cursor {c} is not a tool message before {boundary}")
    notes = cursor_notes(seen, read)
    task = _task(seen)
    cues = cues or {}
    assistant_after = _assistant_suffix_counts(seen)
    steps = {c: assistant_after[c + 1] for c in read}
    structure = structure_features(seen, open_cursors, read, task, steps)
    return [Decision(trace_id=trace_id, env=env, boundary=boundary, cursor=c,
                     label=None if label_fn is None else bool(label_fn(c)), cue=cues.get(c, ""), task=task,
                     body=cursor_body(seen[c].get("content") or ""), note=notes[c], call=producing_call(seen, c),
                     steps_since=steps[c], recency=len(read) - 1 - k, structure=structure[c])
            for k, c in enumerate(read)]


def _assistant_suffix_counts(messages: list[dict]) -> list[int]:
    """out[i] = assistant messages in messages[i:] (out[len] = 0)."""
    out = [0] * (len(messages) + 1)
    for i in range(len(messages) - 1, -1, -1):
        out[i] = out[i + 1] + (messages[i].get("role") == "assistant")
    return out


def decisions_from_trace(trace: Trace, every: int) -> list[Decision]:
    """Every decision of `trace` at its `every`-th boundaries with nothing deleted before (all earlier cursors
    open), labelled by hindsight: the no-deletion-history counterpart of a dataset's rows."""
    out = []
    for b in boundaries(trace, every):
        gone = set(expired(trace, b))
        out += decisions_at(trace.messages, [c for c in trace.cursors() if c < b], b, gone.__contains__,
                            trace.task_id, trace.env, trace.cues)
    return out


def indexed_context(context: list[dict], boundary: int, masked: Iterable[int], where: str = "row") -> list[dict]:
    """A pre-masked context re-indexed as the cursor ids: `boundary` messages, the masked tool messages put back as
    placeholders. Pre-masking removes only tool messages, so the kept ones fill the other positions in order; each
    kept tool message's `[cursor N]` tag must then name its own position."""
    masked = set(masked)
    slots = [i for i in range(boundary) if i not in masked]
    if len(slots) != len(context):
        raise DecisionError(f"{where}: {len(context)} context messages, but boundary {boundary} less "
                            f"{len(masked)} masked cursors leaves {len(slots)} positions")
    out: list[dict] = [{"role": "tool", "content": cursor_content(i, MASKED_BODY)} for i in range(boundary)]
    for pos, m in zip(slots, context, strict=True):
        if m.get("role") == "tool" and cursor_id(m.get("content") or "") != pos:
            raise DecisionError(f"{where}: the tool message at position {pos} is tagged "
                                f"[cursor {cursor_id(m.get('content') or '')}]")
        out[pos] = m
    return out


def row_decisions(row: dict[str, Any]) -> list[Decision]:
    """The decisions of one `delete` row: its context re-indexed (`indexed_context`), labels from its target."""
    msgs = json.loads(row["messages"])
    where = f"{row['task_id']} at {row['step']}"
    # a list-decoder row ends with the trigger and the assistant's target; a `scores` row with the trigger only
    # (its labels sit at the trigger's slots; the target column holds the same deletion set)
    tail = 2 if msgs and msgs[-1].get("role") == "assistant" else 1
    if len(msgs) < tail + 1:
        raise DecisionError(f"{where}: a delete row needs its context and trigger messages")
    context = indexed_context(msgs[:-tail], int(row["step"]), row["masked_cursors"], where)
    target = set(json.loads(row["target"])["del_cursors"])
    cues = {int(k): v for k, v in json.loads(row.get("cues") or "{}").items()}
    out = decisions_at(context, row["open_cursors"], int(row["step"]), target.__contains__, row["task_id"],
                       row.get("env") or "", cues)
    if stray := target - set(row["open_cursors"]):  # (an unread target is no decision: every arm keeps it)
        raise DecisionError(f"{where}: target cursors {sorted(stray)} are not open")
    return out


def decisions_from_split(ds_split) -> list[Decision]:
    """Every decision of a hindsight split's `delete` rows (a `datasets.Dataset`, or a list of row dicts), in row
    order. Packed rows hold many calls and a deletion history each: refused (build without `--pack`)."""
    rows = ds_split if isinstance(ds_split, list) else None
    kinds = [r["kind"] for r in rows] if rows is not None else (
        ds_split["kind"] if "kind" in ds_split.column_names else [])
    if "packed" in kinds:
        raise DecisionError("packed dataset: its rows hold every call of a trace at once; the audit reads "
                            "per-boundary `delete` rows (rebuild with `steward synth hindsight` without --pack)")
    keep = [i for i, k in enumerate(kinds) if k == "delete"]
    if rows is not None:
        selected: Iterable[dict] = (rows[i] for i in keep)
    else:
        missing = [c for c in ROW_COLUMNS if c not in ds_split.column_names]
        if missing:
            raise DecisionError(f"the split lacks the hindsight columns {missing} (has {ds_split.column_names})")
        cols = list(ROW_COLUMNS) + [c for c in ("env", "cues") if c in ds_split.column_names]
        selected = ds_split.select(keep).select_columns(cols) if keep else []
    return [d for r in selected for d in row_decisions(r)]


def by_boundary(decisions: Iterable[Decision]) -> dict[tuple[str, int], list[Decision]]:
    """Decisions grouped by (trace id, boundary), in first-seen order: one group is one manager call."""
    out: dict[tuple[str, int], list[Decision]] = {}
    for d in decisions:
        out.setdefault((d.trace_id, d.boundary), []).append(d)
    return out
