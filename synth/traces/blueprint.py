"""Blueprints in the engine's format, and the compact plan target the model learns.

Engine blueprint: a JSON list of `{"span": [start, end], "readers": [step, ...]}` where span is the half-open range of
logical token indices of one tool response (its whole message piece, as `message_token_ids` cuts it) and readers are
the steps (message indices) that read it, ascending. Cursors nothing reads are left out (no foresight bonus).

Plan target (what the model emits after `Planning mode`): `{"plan": [{"cursor": 7, "readers": [12, 15]}]}` — keyed
by cursor id (= message index of the tool response), readers are future steps only. `plan_to_blueprint` turns it
into the engine format given the session's message token offsets.
"""

from __future__ import annotations

import json
from typing import Any

from kvsteward.synth.traces.tokens import PieceTokenizer, offsets
from kvsteward.synth.traces.trace import Trace


def blueprint_from_reads(reads: dict[int, list[int]], cursors: list[int], starts: list[int]) -> list[dict[str, Any]]:
    """`starts` = token offset of every message plus the total at the end (see `tokens.offsets`)."""
    readers: dict[int, list[int]] = {c: [] for c in cursors}
    for step, cs in reads.items():
        for c in cs:
            if c not in readers:
                raise ValueError(f"step {step} reads {c}, which is not a tool response")
            readers[c].append(step)
    return [{"span": [starts[c], starts[c + 1]], "readers": sorted(set(rs))} for c, rs in sorted(readers.items()) if rs]


def oracle_blueprint(trace: Trace, tokenizer) -> list[dict[str, Any]]:
    ptok = tokenizer if isinstance(tokenizer, PieceTokenizer) else PieceTokenizer(tokenizer)
    return blueprint_from_reads(trace.reads, trace.cursors(), offsets(ptok.pieces(trace.messages)))


def plan_to_blueprint(plan: dict[str, Any] | str, starts: list[int]) -> list[dict[str, Any]]:
    """Engine blueprint from a plan target; refuses unknown cursors with a clear error."""
    obj = json.loads(plan) if isinstance(plan, str) else plan
    if not isinstance(obj, dict) or not isinstance(obj.get("plan"), list):
        raise ValueError('a plan must be {"plan": [{"cursor": int, "readers": [int, ...]}, ...]}')
    out = []
    for item in obj["plan"]:
        c = int(item["cursor"])
        if not 0 <= c < len(starts) - 1:
            raise ValueError(f"plan names cursor {c}, outside the session's {len(starts) - 1} messages")
        out.append({"span": [starts[c], starts[c + 1]], "readers": sorted({int(s) for s in item["readers"]})})
    return sorted(out, key=lambda d: d["span"][0])


def validate_blueprint(bp: Any, n_tokens: int) -> None:
    if not isinstance(bp, list):
        raise ValueError("a blueprint must be a JSON list")
    for i, item in enumerate(bp):
        span = item.get("span") if isinstance(item, dict) else None
        if not (isinstance(span, list) and len(span) == 2 and 0 <= span[0] < span[1] <= n_tokens):
            raise ValueError(f"blueprint item {i}: span must be [start, end) within 0..{n_tokens}, got {span}")
        if not isinstance(item.get("readers"), list) or not all(isinstance(s, int) for s in item["readers"]):
            raise ValueError(f"blueprint item {i}: readers must be a list of step indices")
