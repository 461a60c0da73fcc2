"""The op history a request carries to SGLang, and what SGLang must compute for it. No sglang import.

A request to SGLang's `/generate` (or `sgl.Engine.generate`) carries the conversation in the grammar of
`kvsteward.serve.engine.ops` (AKV §4.1), with messages as token ids:

    custom_params = {"kvsteward": {"messages": [[ids of message 0], [ids of message 1], ...],
                                   "cache": {"drop": {"<i>": [j, ...]}, "reposition": [i, ...]}}}

or the same object as JSON in `extra_key = "kvsteward:" + json` (for clients that can set `extra_key` but not
`custom_params`). `input_ids` must be the *physical* token sequence: the tokens still resident after every op, in
row order (`SglangRequest.physical_ids`), and the history must end with appended tokens (the generation prompt)
after its last op (SGLang recomputes at least the last token).

Positions. SGLang computes token i of a request's KV row at position i (`ForwardBatch.init_new`). AKV's ops:
- `reposition` compacts the survivors to positions 0..r-1 (next position r) — position = row index again;
- `drop` removes tokens from attention but keeps every survivor's position *and the next position*: after d tokens
  left the row, row index i is at position i + d. Every history therefore has a **position offset**
  (`SglangRequest.position_offset`: tokens dropped since the last reposition) that SGLang must add to the position
  of every token it computes for the request (prefill and decode). The tree records it on its op nodes and sets it
  on the request (`req.kvsteward_position_offset`); a `HookRegistry` hook on `ForwardBatch.init_new`
  (`kvsteward.serve.sglang.positions`) adds it to the forward batch's positions.

The history becomes token-level elements, the key of the op-aware tree (`kvsteward.serve.sglang.tree`):

    ("tokens", (id, ...))      appended tokens (consecutive messages merged: SGLang keys KV by tokens only)
    ("drop", (i, ...))         logical token indices that leave attention
    ("reposition",)            survivors move to positions 0..r-1
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvsteward.serve.engine.ops import OpsError, build_ops, message_ranges, parse_cache

FIELD = "kvsteward"
EXTRA_KEY_PREFIX = "kvsteward:"

Element = tuple


@dataclass(frozen=True)
class SglangRequest:
    """A parsed op history: its elements, the physical ids SGLang must be sent, and the state's identity."""

    elements: tuple[Element, ...]
    physical_ids: tuple[int, ...]
    namespace: str | None  # the extra_key left for SGLang's own namespacing (None when it carried the ops)
    positions: tuple[int, ...] = ()  # the position of each physical token (AKV semantics)
    next_position: int = 0  # where the next appended token goes

    @property
    def position_offset(self) -> int:
        """Position minus row index of every token appended after the history: tokens dropped since the last
        reposition (0 for histories without a pending drop)."""
        return self.next_position - len(self.physical_ids)

    @property
    def history_key(self) -> str:
        """sha256 of (namespace, elements): two requests share state exactly as far as their elements agree."""
        blob = json.dumps([self.namespace, [list(e[:1]) + [list(x) for x in e[1:]] for e in self.elements]],
                          separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _token_list(x: Any, where: str) -> tuple[int, ...]:
    if not isinstance(x, list) or not x:
        raise OpsError(f"{where} must be a non-empty list of token ids", where)
    for t in x:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise OpsError(f"{where} holds {t!r}, not a token id (integer >= 0)", where)
    return tuple(x)


def elements_from_messages(messages: list[tuple[int, ...]], cache: Any) -> tuple[Element, ...]:
    """Token-level elements of the message grammar: serve/engine/ops.py's `build_ops`, with drops of messages turned
    into drops of their logical tokens and consecutive appends merged."""
    spec = parse_cache(cache, len(messages))
    ranges = message_ranges([list(m) for m in messages])
    out: list[Element] = []
    for op in build_ops([list(m) for m in messages], ["message"] * len(messages), spec):
        if op[0] == "append":
            if out and out[-1][0] == "tokens":
                out[-1] = ("tokens", out[-1][1] + tuple(op[2]))
            else:
                out.append(("tokens", tuple(op[2])))
        elif op[0] == "drop":
            out.append(("drop", tuple(t for j in op[1] for t in range(*ranges[j]))))
        else:
            out.append(("reposition",))
    return tuple(out)


def layout(elements: tuple[Element, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(physical ids, their positions, next position) after all elements, with AKV's position rules: appended
    tokens take the next positions; a drop keeps every survivor's position and the next position; a reposition moves
    survivors to 0..r-1 and the next position to r. Refuses histories SGLang cannot serve."""
    row: list[tuple[int, int, int]] = []  # (logical index, token, position)
    n_logical = 0
    next_pos = 0
    for k, e in enumerate(elements):
        if e[0] == "tokens":
            row.extend((n_logical + i, t, next_pos + i) for i, t in enumerate(e[1]))
            n_logical += len(e[1])
            next_pos += len(e[1])
        elif e[0] == "drop":
            gone = set(e[1])
            row = [x for x in row if x[0] not in gone]
        elif e[0] == "reposition":
            if not row:
                raise OpsError(f"element {k}: reposition of an empty cache (everything dropped)", "cache")
            row = [(lg, t, i) for i, (lg, t, _) in enumerate(row)]
            next_pos = len(row)
        else:
            raise OpsError(f"element {k}: unknown op {e[0]!r}", "cache")
    if not elements or elements[-1][0] != "tokens":
        raise OpsError("the history must end with appended tokens after its last op (the generation prompt): "
                       "SGLang recomputes at least the last token of a request", "messages")
    return tuple(t for _, t, _ in row), tuple(p for _, _, p in row), next_pos


def physical_ids(elements: tuple[Element, ...]) -> tuple[int, ...]:
    """Resident tokens in row order after all elements; refuses histories SGLang cannot serve."""
    return layout(elements)[0]


def parse_spec(spec: Any, namespace: str | None) -> SglangRequest:
    if not isinstance(spec, dict):
        raise OpsError(f"{FIELD} must be an object {{'messages': [[ids], ...], 'cache': {{...}}}}", FIELD)
    unknown = set(spec) - {"messages", "cache"}
    if unknown:
        raise OpsError(f"{FIELD} has unknown field(s) {sorted(unknown)}: only 'messages' and 'cache'", FIELD)
    raw = spec.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpsError(f"{FIELD}.messages must be a non-empty list of token-id lists", f"{FIELD}.messages")
    messages = [_token_list(m, f"{FIELD}.messages[{i}]") for i, m in enumerate(raw)]
    elements = elements_from_messages(messages, spec.get("cache"))
    ids, positions, next_position = layout(elements)
    return SglangRequest(elements=elements, physical_ids=ids, namespace=namespace, positions=positions,
                         next_position=next_position)


def parse_request(custom_params: Any, extra_key: str | None) -> SglangRequest | None:
    """The op history of a request, from `custom_params["kvsteward"]` or a `kvsteward:`-prefixed `extra_key`;
    None when it carries none (the request is a plain token request). Raises OpsError on a malformed history."""
    spec = custom_params.get(FIELD) if isinstance(custom_params, dict) else None
    namespace = extra_key
    if isinstance(extra_key, str) and extra_key.startswith(EXTRA_KEY_PREFIX):
        namespace = None  # the extra_key was only the carrier: sharing must not be split by it
        if spec is None:
            try:
                spec = json.loads(extra_key[len(EXTRA_KEY_PREFIX):])
            except json.JSONDecodeError as e:
                raise OpsError(f"extra_key after {EXTRA_KEY_PREFIX!r} is not JSON: {e}", "extra_key") from e
    if spec is None:
        return None
    return parse_spec(spec, namespace)


def request_fields(messages: list[list[int]], cache: dict | None = None, via: str = "custom_params") -> dict:
    """The `/generate` fields for a conversation (message token ids) and its cache ops: `input_ids` (physical) plus
    the history in `sampling_params.custom_params` (via="custom_params") or in `extra_key` (via="extra_key")."""
    spec = {"messages": [list(m) for m in messages], "cache": cache or {}}
    parsed = parse_spec(spec, None)
    if via == "custom_params":
        return {"input_ids": list(parsed.physical_ids), "sampling_params": {"custom_params": {FIELD: spec}}}
    if via == "extra_key":
        return {"input_ids": list(parsed.physical_ids),
                "extra_key": EXTRA_KEY_PREFIX + json.dumps(spec, separators=(",", ":"))}
    raise ValueError(f"via must be 'custom_params' or 'extra_key', got {via!r}")
