"""Hindsight labels: which cursors are expired at a turn boundary, and the auxiliary examples built from that.

A *turn boundary* b is the position right after a tool response (messages[b-1] is a tool message and b is not the
end): the moment the auxiliary thread forks, before the main thread writes step b. Every `every`-th boundary
(counting tool responses, as SideQuest counts ReAct iterations) yields auxiliary examples.

A cursor c is *expired* at b when no step >= b reads it (its last use is < b). The deletion target at b is exactly
the expired cursors among those still open in the context; the plan target lists, for each open cursor that some
later step reads, those future reader steps.

Pre-masking (SideQuest Algorithm 2): a random subset of the expired cursors is treated as deleted by an earlier
auxiliary call. Their tool messages are *removed* from the context — the engine's drop removes exactly that message's
tokens — so they are no longer open and not part of the target.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from kvsteward.synth.traces.trace import Trace

DELETE_TRIGGER = "Memory management mode"
PLAN_TRIGGER = "Planning mode"


# The deletion trigger's layouts (`delete_trigger`): the dataset records the one its rows use, the adapter the one it
# was trained on, and the serving fork writes that one.
TRIGGER_STYLES = ("ids", "notes", "scores")
NOTE_WORDS = 20  # a reader note's length cap: the statement and what follows it ("Now the other side ...") fit


def check_trigger_style(style: str) -> str:
    if style not in TRIGGER_STYLES:
        raise ValueError(f"trigger style must be one of {', '.join(TRIGGER_STYLES)}, got {style!r}")
    return style


# What the aux thread's trigger follows: the whole session (`full`), or only its first message (`first`: the system
# prompt in synthesized traces; `steward train lora --aux-context first`). Recorded with the adapter, like the trigger.
AUX_CONTEXTS = ("full", "first")


def check_aux_context(context: str, what: str = "aux context") -> str:
    """`context` if known; else a ValueError naming `what` (a CLI passes its flag)."""
    if context not in AUX_CONTEXTS:
        raise ValueError(f"{what} must be one of {', '.join(AUX_CONTEXTS)}, got {context!r}")
    return context


def delete_trigger(open_cursors: list[int], messages: list[dict] | None = None, style: str = "ids") -> str:
    """The deletion trigger message; training and serving must use the same text.

    `ids`: SideQuest's phrase, then the open cursor ids (the choices the decoder admits). Listing them next to the
    answer turns "which ids are open" from a search back through the context into a copy from the line above.
    `notes`: also the task (the first user message) and one line per open cursor with its reader note
    (`cursor_notes`). What decides a deletion (a recap request in the task, a fact stated from a page, a result that
    "looks relevant") otherwise sits hundreds of tokens from the id, and the aux thread reads the main context's K/V
    as the base model wrote them, so linking the two is a multi-hop search; beside the id it is a local pattern.
    `messages` (needed for `notes`): the context, indexed as the cursor ids are (dropped messages included)."""
    ids = ", ".join(str(c) for c in sorted(open_cursors)) or "none"
    if check_trigger_style(style) == "scores":
        if messages is None:
            raise ValueError("the scores trigger needs the context's messages")
        return score_trigger(open_cursors, messages)
    if style == "ids":
        return f"{DELETE_TRIGGER}\nOpen cursors: {ids}"
    if messages is None:
        raise ValueError("the notes trigger needs the context's messages")
    task = next((m["content"] for m in messages if m.get("role") == "user"), "")
    notes = cursor_notes(messages, open_cursors)
    return "\n".join([DELETE_TRIGGER, f"Task: {task}", f"Open cursors: {ids}"] +
                      [f"{c}: {notes[c]}" for c in sorted(open_cursors)])


# The `scores` trigger (a per-response decision in one forward): one line per open response, a header the harness
# takes from the response itself (the call that produced it, its first line; never a label), ending in SLOT_MARK.
# The model's next-token logits at each mark's last token, restricted to ANSWERS (still needed: " yes" / " no"), are
# that response's score; the rows train them with CE there (`synth.traces.dataset`), the fork reads them
# (`serve.manager.scores`). The answers are never written into the context: training and serving see the same text.
SLOT_MARK = " still needed?"
ANSWERS = (" yes", " no")
HEADER_WORDS = 16  # a header's first-line cap; a call's arguments are capped at the same number of words
SCORE_QUESTION = "For each open response: is it still needed for the task?"


def producing_call(messages: list[dict], c: int) -> str:
    """`name(arguments)` of the call whose response is tool message c (the k-th tool message after an assistant
    message answers its k-th call); "" when none is found (an imported trace without calls)."""
    from kvsteward.synth.traces.toolcall import parse_tool_calls

    j = c
    while j > 0 and messages[j - 1].get("role") == "tool":
        j -= 1
    if j == 0 or messages[j - 1].get("role") != "assistant":
        return ""
    try:
        _, calls = parse_tool_calls(messages[j - 1].get("content") or "")
    except ValueError:
        return ""
    if c - j >= len(calls):
        return ""
    call = calls[c - j]
    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in (call.get("arguments") or {}).items())
    return f"{call['name']}({' '.join(args.split()[:HEADER_WORDS])})"


def response_header(messages: list[dict], c: int) -> str:
    """What the `scores` trigger shows of open response c: its call and the first line of its body."""
    from kvsteward.synth.traces.toolcall import cursor_body

    body = cursor_body(messages[c].get("content") or "").strip()
    first = " ".join(body.split("\n", 1)[0].split()[:HEADER_WORDS]) if body else "(empty)"
    call = producing_call(messages, c)
    return f"{call} -> {first}" if call else first


def score_trigger(open_cursors: list[int], messages: list[dict]) -> str:
    """The `scores` trigger: the phrase, the task, the question, then `[c] header | still needed?` per open cursor
    (ascending), one per line. `score_slot_ends` finds the marks again."""
    task = next((m["content"] for m in messages if m.get("role") == "user"), "")
    lines = [DELETE_TRIGGER, f"Task: {task}", SCORE_QUESTION]
    lines += [f"[{c}] {response_header(messages, c)} |{SLOT_MARK}" for c in sorted(open_cursors)]
    return "\n".join(lines)


def score_slot_ends(text: str, open_cursors: list[int]) -> list[int]:
    """Character offsets (in `text`, any text that contains the trigger once) just past each open cursor's SLOT_MARK,
    in ascending cursor order. Raises when a mark is missing (a trigger of another layout)."""
    start = text.find(DELETE_TRIGGER)
    out = []
    for c in sorted(open_cursors):
        line = text.find(f"\n[{c}] ", start)
        end = text.find(SLOT_MARK + "\n", line) if line >= 0 else -1
        last = text.find(SLOT_MARK, line) if line >= 0 else -1
        at = end if end >= 0 else last
        if line < 0 or at < 0:
            raise ValueError(f"no score slot for cursor {c} in the trigger (not a 'scores' trigger?)")
        out.append(at + len(SLOT_MARK))
        start = at
    return out


def cursor_notes(messages: list[dict], open_cursors: list[int]) -> dict[int, str]:
    """Per open cursor, what the agent wrote right after reading it: the text of the first assistant message after
    it (past any other tool responses of the same turn) before its tool call, the first `NOTE_WORDS` words ("not
    read yet" where none follows). Whether a response is still needed shows there (a fact stated from it, a result
    that "looks relevant"), and it is hundreds of tokens from the id in the context; the note puts it beside the id."""
    out = {}
    for c in open_cursors:
        j = c + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        if j == len(messages) or messages[j].get("role") != "assistant":
            out[c] = "not read yet"
            continue
        text = (messages[j].get("content") or "").split("<tool_call>")[0]
        out[c] = " ".join(text.split()[:NOTE_WORDS]) or "(no note)"
    return out


def unread_cursors(messages: list[dict]) -> list[int]:
    """The tool messages at the end of the context (after its last non-tool message): responses the agent has not
    read yet. In a ReAct loop the step right after a boundary reads them, so hindsight never labels them expired and
    deleting one is always harmful: with `keep_unread` the decoder never offers them (they stay in the trigger's
    list, which must match the training rows)."""
    out: list[int] = []
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") != "tool":
            break
        out.append(i)
    return out[::-1]


def boundaries(trace: Trace, every: int) -> list[int]:
    """Boundaries after every `every`-th tool response (the last message never starts a boundary)."""
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    out, turns = [], 0
    for i, m in enumerate(trace.messages[:-1]):
        if m.get("role") == "tool":
            turns += 1
            if turns % every == 0:
                out.append(i + 1)
    return out


def expired(trace: Trace, boundary: int) -> list[int]:
    """Cursors before `boundary` that no step >= boundary reads."""
    last = trace.last_use()
    return sorted(c for c, lu in last.items() if c < boundary and lu < boundary)


def future_readers(trace: Trace, boundary: int) -> dict[int, list[int]]:
    """Cursor (before boundary) → its readers at steps >= boundary, only for cursors with at least one."""
    out = {}
    for c, steps in trace.readers().items():
        fut = [s for s in steps if s >= boundary]
        if c < boundary and fut:
            out[c] = fut
    return out


def delete_target(open_cursors: list[int], trace: Trace, boundary: int) -> dict[str, list[int]]:
    gone = set(expired(trace, boundary))
    return {"del_cursors": sorted(c for c in open_cursors if c in gone)}


def plan_target(open_cursors: list[int], trace: Trace, boundary: int) -> dict[str, list[dict[str, Any]]]:
    fut = future_readers(trace, boundary)
    return {"plan": [{"cursor": c, "readers": fut[c]} for c in sorted(open_cursors) if c in fut]}


def target_text(target: dict) -> str:
    """The exact JSON text the model is trained to emit (json.dumps defaults: `{"del_cursors": [3, 5]}`)."""
    return json.dumps(target)


@dataclass
class AuxContext:
    boundary: int
    messages: list[dict[str, Any]]  # context after pre-masking (without trigger / target)
    open_cursors: list[int]
    masked: list[int]


def aux_context(trace: Trace, boundary: int, r: random.Random, mask_prob: float,
                mask_all: bool = False) -> AuxContext:
    """Context up to `boundary` with each expired cursor removed with probability `mask_prob` (all if mask_all)."""
    if not 0 < boundary <= len(trace.messages):
        raise ValueError(f"boundary {boundary} outside the trace of {len(trace.messages)} messages")
    gone = expired(trace, boundary)
    masked = sorted(c for c in gone if mask_all or r.random() < mask_prob)
    drop = set(masked)
    msgs = [m for i, m in enumerate(trace.messages[:boundary]) if i not in drop]
    open_cursors = [c for c in trace.cursors() if c < boundary and c not in drop]
    return AuxContext(boundary, msgs, open_cursors, masked)


def trigger(kind: str, open_cursors: list[int], messages: list[dict] | None = None, style: str = "ids") -> str:
    """The trigger message of an auxiliary call of `kind` ("delete" | "plan") over `open_cursors`."""
    if kind not in ("delete", "plan"):
        raise ValueError(f"aux call kind must be 'delete' or 'plan', got {kind!r}")
    return delete_trigger(open_cursors, messages, style) if kind == "delete" else PLAN_TRIGGER


def calls(trace: Trace, ctx: AuxContext, plan: bool, style: str = "ids") -> list[tuple[str, str, dict]]:
    """(kind, trigger, target) of each auxiliary call at ctx.boundary: the deletion call, and the plan call if asked."""
    seen = trace.messages[:ctx.boundary]  # indexed as the cursor ids (pre-masked messages included), as served
    out = [("delete", trigger("delete", ctx.open_cursors, seen, style),
            delete_target(ctx.open_cursors, trace, ctx.boundary))]
    if plan:
        out.append(("plan", trigger("plan", ctx.open_cursors), plan_target(ctx.open_cursors, trace, ctx.boundary)))
    return out


def with_trigger(ctx: AuxContext, trigger: str, target: dict) -> list[dict[str, Any]]:
    return ctx.messages + [{"role": "user", "content": trigger}, {"role": "assistant", "content": target_text(target)}]


def drop_schedule(trace: Trace, bounds: list[int], r: random.Random,
                  mask_prob: float) -> tuple[list[AuxContext], dict[int, int]]:
    """One consistent deletion history over all `bounds`, for packed rows (one row per trace, every boundary).

    Walks the boundaries in order, as the serving loop does: at b the context holds every cursor not dropped before
    b; the deletion target is the expired ones among them; after the call each target cursor is dropped with
    probability `mask_prob` (a manager that sometimes defers a deletion), else it stays open and is a target again
    at the next boundary. Unlike `aux_context`'s independent draw per boundary, a cursor dropped at b is gone from
    every later boundary and from every later main-trace step. Returns (context per boundary, cursor → boundary at
    whose call it was dropped).
    """
    dropped_at: dict[int, int] = {}
    contexts = []
    for b in bounds:
        if not 0 < b <= len(trace.messages):
            raise ValueError(f"boundary {b} outside the trace of {len(trace.messages)} messages")
        msgs = [m for i, m in enumerate(trace.messages[:b]) if i not in dropped_at]
        open_cursors = [c for c in trace.cursors() if c < b and c not in dropped_at]
        contexts.append(AuxContext(b, msgs, open_cursors, sorted(dropped_at)))
        for c in delete_target(open_cursors, trace, b)["del_cursors"]:
            if r.random() < mask_prob:
                dropped_at[c] = b
    return contexts, dropped_at
