"""Packed rows: a whole trace and all its auxiliary calls in one sequence, with the serving engine's exact view.

Per-boundary rows (`synth.traces.dataset.aux_rows`) re-encode the context up to every boundary and renumber positions
after
pre-masking. A packed row encodes the trace once (the *trunk*) and inserts, right before message b, one *branch* per
auxiliary call at boundary b (trigger + JSON target). Four per-token columns say what each token may attend to:

- `segment`: 0 on the trunk, k ≥ 1 on the k-th branch; a branch token sees the trunk and its own branch only, and
  the trunk never sees a branch (the fork is read-only);
- `time`: 2m on the trunk tokens of message m, 2b − 1 on a branch at boundary b (the call happens before step b);
- `expire`: a query sees a trunk key only while its `time` < the key's `expire`. Tokens of a cursor dropped by the
  call at boundary d expire at 2d: the branches at d still see it, step d and everything after do not;
- `position_ids`: trunk tokens keep their position in the unpacked trace; a branch at b continues from the first
  position of message b. Dropped tokens leave gaps, exactly as the engine's `drop` does (positions of the rest and
  the next position are unchanged), so every branch reproduces what the serving fork computes.

Keys that later expire were still visible when the tokens after them were computed, which is what the engine's KV
holds too. `train.data.tree_mask` turns the columns into a 4-D attention mask.
"""

from __future__ import annotations

from kvsteward.synth.rng import rng
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.tokens import IGNORE, PieceTokenizer
from kvsteward.synth.traces.trace import Trace

NEVER = 2**30  # `expire` of a token no call drops
COLUMNS = ("position_ids", "segment", "time", "expire")  # the per-token columns a packed row adds


def packed_row(trace: Trace, ptok: PieceTokenizer, every: int, mask_prob: float, seed: int,
               plan: bool, trigger: str = "ids") -> dict | None:
    """The packed row of `trace` as a dict of the dataset's columns (kind "packed"), or None without any boundary."""
    bounds = hs.boundaries(trace, every)
    if not bounds:
        return None
    contexts, dropped_at = hs.drop_schedule(trace, bounds, rng(seed, trace.task_id, "packed"), mask_prob)
    msgs = trace.messages
    ids, labels, starts = ptok.tokenize(msgs, {i for i, m in enumerate(msgs) if m.get("role") == "assistant"})
    starts.append(len(ids))
    branches = {ctx.boundary: _branches(ptok, trace, ctx, plan, trigger) for ctx in contexts}

    cols: dict[str, list[int]] = {k: [] for k in ("input_ids", "labels", *COLUMNS)}
    calls: list[dict] = []

    def put(tok: list[int], lab: list[int], pos0: int, seg: int, time: int, expire: int) -> None:
        if lab and lab[0] != IGNORE:  # the shifted loss reads token j's label at j − 1: a segment's first token
            raise ValueError("a packed segment must start with an unlabelled token")  # must not carry one
        cols["input_ids"] += tok
        cols["labels"] += lab
        cols["position_ids"] += range(pos0, pos0 + len(tok))
        cols["segment"] += [seg] * len(tok)
        cols["time"] += [time] * len(tok)
        cols["expire"] += [expire] * len(tok)

    for m in range(len(msgs)):
        for kind, ctx, tok, lab, target, text in branches.get(m, []):
            calls.append({"boundary": m, "segment": len(calls) + 1, "kind": kind, "open_cursors": ctx.open_cursors,
                          "masked": ctx.masked, "target": target, "trigger": text})
            put(tok, lab, starts[m], len(calls), 2 * m - 1, NEVER)
        d = dropped_at.get(m)
        put(ids[starts[m]:starts[m + 1]], labels[starts[m]:starts[m + 1]], starts[m], 0, 2 * m,
            NEVER if d is None else 2 * d)
    return {"input_ids": cols.pop("input_ids"), "labels": cols.pop("labels"), "calls": calls,
            "dropped_at": dropped_at, **cols}


def _branches(ptok: PieceTokenizer, trace: Trace, ctx: hs.AuxContext, plan: bool, style: str) -> list[tuple]:
    """(kind, context, tokens, labels, target text, trigger text) of each call at ctx.boundary, tokenized as the
    serving fork appends them after the context it holds (the trace up to the boundary less the dropped cursors)."""
    out = []
    for kind, trigger, target in hs.calls(trace, ctx, plan, style):
        msgs = hs.with_trigger(ctx, trigger, target)
        ids, labels, starts = ptok.tokenize(msgs, {len(msgs) - 1})
        at = starts[len(ctx.messages)]
        out.append((kind, ctx, ids[at:], labels[at:], hs.target_text(target), trigger))
    return out


def call_messages(messages: list[dict], call: dict) -> list[dict]:
    """The message list one packed call stands for (context without the cursors dropped before it, trigger,
    target), as a per-boundary row holds it: what `synth.traces.stats` checks against hindsight."""
    gone = set(call["masked"])
    ctx = [m for i, m in enumerate(messages[:call["boundary"]]) if i not in gone]
    # Rows built before the call recorded its trigger text all used the `ids` layout.
    text = call.get("trigger") or hs.trigger(call["kind"], call["open_cursors"])
    return ctx + [{"role": "user", "content": text},
                  {"role": "assistant", "content": call["target"]}]
