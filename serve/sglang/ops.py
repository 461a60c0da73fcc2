"""The op history a request carries to SGLang, and what SGLang must compute for it. No sglang import.

A request to SGLang's `/generate` (or `sgl.Engine.generate`) carries the conversation in the grammar of
`kvsteward.serve.engine.ops` (AKV §4.1), with messages as token ids, as **one JSON string**:

    sampling_params.custom_params = {"kvsteward": '{"v": 1, "messages": [[ids of message 0], ...],
                                                    "cache": {"drop": {"<i>": [j, ...]}, "reposition": [i, ...]}}'}

A string because sglang declares `custom_params` values as scalars, lists of scalars or dicts of scalars ("must
survive msgpack IPC", `sampling_params.CustomParamValue`): nested lists fail `msgspec` validation under
`SGLANG_USE_PICKLE_IPC=0`, and a string travels unchanged under both IPC modes. The same JSON may instead follow
`extra_key = "kvsteward:"` (clients that can set `extra_key` but not `custom_params`). A dict in `custom_params`
(the pre-0.5.21 form) is still read, under pickle IPC only.

**Compact form: a turn sends only what is new.** A history is identified, message by message, by a chained key
(`chain_key`): K(0) = `ROOT_KEY`, K(i+1) = H(K(i), the ops at the boundary after message i-1, the tokens of message
i) — so K(n) names messages[:n] and every op between them (not the ops right after message n-1: those belong to the
next request). The server remembers the parsed state of every history it served, by its key (`HistoryStore`,
least recently used out). A request may then send

    {"v": 1, "base": K(n), "n": n, "messages": [[ids of message n], ...], "cache": {ops at boundaries >= n-1}}

and the server continues from the remembered state: the parse costs the new messages and the new ops, not the whole
conversation (`HistoryStore.resolve`). A base the server does not know (evicted, or a restarted server) makes the
request a refused one: it is served as plain tokens and counted (`stats["refused"]`, `stats["unknown_base"]`).
`SglangHistory` is the client side: the full form on a conversation's first request, the compact one after.

`input_ids` must be the *physical* token sequence: the tokens still resident after every op, in row order
(`SglangRequest.physical_ids`), and the history must end with appended tokens (the generation prompt) after its
last op (SGLang recomputes at least the last token).

Positions. SGLang computes token i of a request's KV row at position i (`ForwardBatch.init_new`). AKV's ops:
- `reposition` compacts the survivors to positions 0..r-1 (next position r) — position = row index again;
- `drop` removes tokens from attention but keeps every survivor's position *and the next position*: after d tokens
  left the row, row index i is at position i + d. Every history therefore has a **position offset**
  (`SglangRequest.position_offset`: tokens dropped since the last reposition) that SGLang must add to the position
  of every token it computes for the request (prefill and decode). The tree records it on its op nodes and sets it
  on the request (`req.kvsteward_position_offset`); a `HookRegistry` hook on `ForwardBatch.init_new`
  (`kvsteward.serve.sglang.positions`) adds it to the forward batch's positions.

The history becomes token-level elements, the key of the op-aware tree (`kvsteward.serve.sglang.tree`):

    ("tokens", array('q', [id, ...]))   appended tokens (consecutive messages merged: SGLang keys KV by tokens only)
    ("drop", (i, ...))                  logical token indices that leave attention
    ("reposition",)                     survivors move to positions 0..r-1
"""

from __future__ import annotations

import copy
import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from kvsteward.serve.engine.ops import CacheSpec, OpsError, parse_cache

FIELD = "kvsteward"
EXTRA_KEY_PREFIX = "kvsteward:"
VERSION = 1
ROOT_KEY = "kvsteward-v1"
# what the tree does when an op follows a state it no longer holds whole (evicted under memory pressure):
# "reprefill" serves the physical ids as plain tokens (counted, not the engine's state); "refuse" aborts the request
# before any work with `MISS_ERR_TYPE` and the logical length of the pre-op state to re-send (`generate_exact`)
MISS_MODES = ("reprefill", "refuse")
MISS_ERR_TYPE = "kvsteward_miss"
MISS_TOKENS = "kvsteward_pre_op_tokens"

Element = tuple
_EMPTY = torch.empty(0, dtype=torch.int64)


def _tensor(tokens: array) -> torch.Tensor:
    return torch.frombuffer(tokens, dtype=torch.int64).clone() if len(tokens) else _EMPTY


def _array(t: torch.Tensor) -> array:
    out = array("q")
    out.frombytes(t.to(torch.int64).contiguous().numpy().tobytes())
    return out


def _boundary_json(spec: CacheSpec, i: int) -> str:
    """Canonical text of the ops at the boundary after message i ("" when there are none)."""
    drop, rep = spec.drop.get(i), i in spec.reposition
    if drop is None and not rep:
        return ""
    return json.dumps([list(drop or ()), rep], separators=(",", ":"))


def chain_key(prev: str, boundary_ops: str, tokens: array) -> str:
    """K(i+1) from K(i): the ops at the boundary right before message i (`_boundary_json`) and its tokens."""
    h = hashlib.sha256(prev.encode())
    h.update(b"|" + boundary_ops.encode() + b"|")
    h.update(tokens.tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class HistoryState:
    """The parsed state after messages[:n] (and the ops between them, not those right after message n-1)."""

    key: str
    n: int
    starts: array  # logical start of each message, n + 1 entries (the last: logical tokens so far)
    elements: tuple[Element, ...]
    logical: torch.Tensor  # the KV row: logical index of each resident token
    tokens: torch.Tensor  # ... its token id
    positions: torch.Tensor  # ... its position
    next_position: int
    dropped: frozenset[int]  # messages dropped so far
    drops: tuple[tuple[int, tuple[int, ...]], ...] = ()  # every drop (boundary, messages), for `cache_json`
    repositions: tuple[int, ...] = ()
    # per op element: (chained key of the elements up to and including it, elements after it, logical tokens
    # before it). The tree remembers the op node of each key, so a walk starts at the deepest one it knows.
    op_chain: tuple[tuple[str, int, int], ...] = ()

    @property
    def size(self) -> int:
        return int(self.starts[-1]) if len(self.starts) else 0

    def cache_json(self) -> dict:
        """Every op of this history in the full form's `cache` field."""
        return {"drop": {str(i): list(js) for i, js in self.drops}, "reposition": list(self.repositions)}

    def extend(self, messages: list[array], cache: Any) -> HistoryState:
        """The state after `messages` appended, with `cache`'s ops (boundaries >= n-1: the new ones only)."""
        return self.extend_with_penultimate(messages, cache)[0]

    def extend_with_penultimate(self, messages: list[array], cache: Any) -> tuple[HistoryState, HistoryState | None]:
        """`extend`, and the state before the last new message (and before the ops right ahead of it), or None when
        only one message is new: what a next turn continues when it rewrites the last message (the generation
        prompt becomes the whole assistant reply)."""
        n_total = self.n + len(messages)
        spec = parse_cache(cache, n_total, first=self.n, dropped=self.dropped)
        elements = list(self.elements)
        starts = array("q", self.starts)
        logical, tokens, positions, next_pos = self.logical, self.tokens, self.positions, self.next_position
        dropped = set(self.dropped)
        drops, reps = list(self.drops), list(self.repositions)
        op_chain = list(self.op_chain)
        key = self.key

        def add_op(element: Element) -> None:
            prev = op_chain[-1][0] if op_chain else "ops-v1"
            h = hashlib.sha256(prev.encode())
            if elements and elements[-1][0] == "tokens":
                h.update(b"t" + elements[-1][1].tobytes())
            h.update(element[0].encode() + (array("q", element[1]).tobytes() if len(element) > 1 else b""))
            elements.append(element)
            op_chain.append((h.hexdigest()[:32], len(elements), int(starts[-1])))

        def apply_boundary(i: int) -> None:
            nonlocal logical, tokens, positions, next_pos
            if i in spec.drop:
                gone_msgs = spec.drop[i]
                gone = tuple(t for j in gone_msgs for t in range(starts[j], starts[j + 1]))
                add_op(("drop", gone))
                keep = ~torch.isin(logical, torch.tensor(gone, dtype=torch.int64))
                logical, tokens, positions = logical[keep], tokens[keep], positions[keep]
                dropped.update(gone_msgs)
                drops.append((i, gone_msgs))
            if i in spec.reposition:
                if logical.numel() == 0:
                    raise OpsError(f"reposition after message {i} of an empty cache (everything dropped)", "cache")
                add_op(("reposition",))
                positions = torch.arange(logical.numel(), dtype=torch.int64)
                next_pos = logical.numel()
                reps.append(i)

        penultimate = None
        for k, msg in enumerate(messages):
            i = self.n + k
            if k == len(messages) - 1 and k > 0:
                penultimate = HistoryState(key=key, n=i, starts=array("q", starts), elements=tuple(elements),
                                           logical=logical, tokens=tokens, positions=positions,
                                           next_position=next_pos, dropped=frozenset(dropped), drops=tuple(drops),
                                           repositions=tuple(reps), op_chain=tuple(op_chain))
            if i > 0:
                apply_boundary(i - 1)
            if not len(msg):
                raise OpsError(f"{FIELD}.messages: message {i} is empty", f"{FIELD}.messages")
            key = chain_key(key, _boundary_json(spec, i - 1) if i > 0 else "", msg)
            start = starts[-1]
            if elements and elements[-1][0] == "tokens":
                elements[-1] = ("tokens", elements[-1][1] + msg)
            else:
                elements.append(("tokens", array("q", msg)))
            new = _tensor(msg)
            logical = torch.cat([logical, start + torch.arange(len(msg), dtype=torch.int64)])
            tokens = torch.cat([tokens, new])
            positions = torch.cat([positions, next_pos + torch.arange(len(msg), dtype=torch.int64)])
            next_pos += len(msg)
            starts.append(start + len(msg))
        if spec.boundaries() and max(spec.boundaries()) >= n_total - 1:
            raise OpsError("the history must end with appended tokens after its last op (the generation prompt): "
                           "SGLang recomputes at least the last token of a request", "messages")
        return HistoryState(key=key, n=n_total, starts=starts, elements=tuple(elements), logical=logical,
                            tokens=tokens, positions=positions, next_position=next_pos,
                            dropped=frozenset(dropped), drops=tuple(drops), repositions=tuple(reps),
                            op_chain=tuple(op_chain)), penultimate


ROOT = HistoryState(key=ROOT_KEY, n=0, starts=array("q", [0]), elements=(), logical=_EMPTY, tokens=_EMPTY,
                    positions=_EMPTY, next_position=0, dropped=frozenset())


@dataclass(frozen=True)
class SglangRequest:
    """A parsed op history: its elements, the physical ids SGLang must be sent, and the state's identity."""

    elements: tuple[Element, ...]
    physical_ids: array
    namespace: str | None  # the extra_key left for SGLang's own namespacing (None when it carried the ops)
    position_tensor: torch.Tensor = _EMPTY  # the position of each physical token (AKV semantics)
    next_position: int = 0  # where the next appended token goes
    key: str = ROOT_KEY  # the chained key of the whole history (`chain_key`)
    last_message_len: int = 0  # tokens of the last message (an aux fork's trigger: computed with the adapter)
    op_chain: tuple[tuple[str, int, int], ...] = ()  # `HistoryState.op_chain`
    refuse_miss: bool = False  # `miss: "refuse"`: a pre-op state the tree lacks is refused, not re-prefilled
    # the state this request leaves is held until an op request continues it: "budget" (`hold: true`, within the
    # tree's hold budget), "always" (a rebuild, whose request was refused once already), "" (not held)
    hold: str = ""

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(self.position_tensor.tolist())

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

    @classmethod
    def of(cls, state: HistoryState, namespace: str | None, refuse_miss: bool = False,
           hold: str = "") -> SglangRequest:
        if not state.elements or state.elements[-1][0] != "tokens":
            raise OpsError("the history must end with appended tokens after its last op (the generation prompt)",
                           "messages")
        return cls(elements=state.elements, physical_ids=_array(state.tokens), namespace=namespace,
                   position_tensor=state.positions, next_position=state.next_position, key=state.key,
                   last_message_len=int(state.starts[-1] - state.starts[-2]), op_chain=state.op_chain,
                   refuse_miss=refuse_miss, hold=hold)


class HistoryStore:
    """Parsed histories by chained key, least recently used out beyond `max_entries` or `max_tokens` (their
    logical tokens, all entries together). What lets a request send only its new messages."""

    def __init__(self, max_entries: int = 1024, max_tokens: int = 2_000_000):
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._states: OrderedDict[str, HistoryState] = OrderedDict()
        self._tokens = 0
        self.stats = {"hits": 0, "misses": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: str) -> bool:
        return key in self._states

    def get(self, key: str) -> HistoryState | None:
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, state: HistoryState) -> None:
        if state.key in self._states:
            self._states.move_to_end(state.key)
            return
        self._states[state.key] = state
        self._tokens += state.size
        while len(self._states) > self.max_entries or (self._tokens > self.max_tokens and len(self._states) > 1):
            _, old = self._states.popitem(last=False)
            self._tokens -= old.size
            self.stats["evicted"] += 1

    def resolve(self, spec: dict) -> HistoryState:
        """The state a (full or compact) spec names: its base state extended by its messages and ops."""
        base_key = spec.get("base")
        if base_key is None:
            base = ROOT
        else:
            base = self.get(base_key)
            if base is None:
                self.stats["misses"] += 1
                raise OpsError(f"{FIELD}.base {base_key!r} is not a history this server remembers (evicted, or the "
                               "server restarted): send the full history", f"{FIELD}.base")
            self.stats["hits"] += 1
            if spec.get("n") != base.n:
                raise OpsError(f"{FIELD}.n = {spec.get('n')!r} but base {base_key!r} holds {base.n} messages",
                               f"{FIELD}.n")
        messages = [_token_array(m, f"{FIELD}.messages[{i}]") for i, m in enumerate(spec["messages"])]
        state, penultimate = base.extend_with_penultimate(messages, spec.get("cache"))
        if penultimate is not None:  # a next turn may rewrite the last message (generation prompt -> reply)
            self.put(penultimate)
        self.put(state)
        return state


def _token_array(x: Any, where: str) -> array:
    if not isinstance(x, list) or not x:
        raise OpsError(f"{where} must be a non-empty list of token ids", where)
    for t in x:  # new messages only: a continued history is not re-checked
        if type(t) is not int or t < 0:
            raise OpsError(f"{where} holds {t!r}, not a token id (integer >= 0)", where)
    return array("q", x)


def _check_spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise OpsError(f"{FIELD} must be an object {{'messages': [[ids], ...], 'cache': {{...}}}}", FIELD)
    unknown = set(spec) - {"v", "messages", "cache", "base", "n", "miss", "hold"}
    if unknown:
        raise OpsError(f"{FIELD} has unknown field(s) {sorted(unknown)}: only 'v', 'messages', 'cache', 'base', "
                       "'n', 'miss', 'hold'", FIELD)
    if spec.get("hold", False) not in (True, False, "always"):
        raise OpsError(f"{FIELD}.hold = {spec.get('hold')!r}: true, false or \"always\"", f"{FIELD}.hold")
    if spec.get("miss", MISS_MODES[0]) not in MISS_MODES:
        raise OpsError(f"{FIELD}.miss = {spec.get('miss')!r}: one of {list(MISS_MODES)}", f"{FIELD}.miss")
    if spec.get("v", VERSION) != VERSION:
        raise OpsError(f"{FIELD}.v = {spec.get('v')!r}: this plugin reads version {VERSION}", f"{FIELD}.v")
    raw = spec.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpsError(f"{FIELD}.messages must be a non-empty list of token-id lists", f"{FIELD}.messages")
    if ("base" in spec) != ("n" in spec):
        raise OpsError(f"{FIELD}: 'base' and 'n' go together (the key and length of the history continued)", FIELD)
    return spec


def decode_spec(value: Any) -> dict:
    """The spec object of a `custom_params["kvsteward"]` value (a JSON string, or a dict under pickle IPC)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise OpsError(f"{FIELD} is not JSON: {e}", FIELD) from e
    return _check_spec(value)


def parse_spec(spec: Any, namespace: str | None, store: HistoryStore | None = None) -> SglangRequest:
    spec = decode_spec(spec)
    if store is None:
        if "base" in spec:
            raise OpsError(f"{FIELD}.base needs the server's history store", f"{FIELD}.base")
        store = HistoryStore(max_entries=1)
    return SglangRequest.of(store.resolve(spec), namespace, refuse_miss=spec.get("miss") == "refuse",
                            hold={True: "budget", "always": "always"}.get(spec.get("hold", False), ""))


def split_extra_key(extra_key: str | None, lora_id: str | None) -> str | None:
    """The client's `extra_key`: sglang appends a LoRA request's adapter id to it (`Req.__init__`)."""
    if lora_id and isinstance(extra_key, str) and extra_key.endswith(lora_id):
        extra_key = extra_key[: len(extra_key) - len(lora_id)] or None
    return extra_key


def parse_request(custom_params: Any, extra_key: str | None, store: HistoryStore | None = None,
                  lora_id: str | None = None) -> SglangRequest | None:
    """The op history of a request, from `custom_params["kvsteward"]` or a `kvsteward:`-prefixed `extra_key`;
    None when it carries none (the request is a plain token request). Raises OpsError on a malformed history."""
    spec = custom_params.get(FIELD) if isinstance(custom_params, dict) else None
    namespace = split_extra_key(extra_key, lora_id)
    if isinstance(namespace, str) and namespace.startswith(EXTRA_KEY_PREFIX):
        if spec is None:
            spec = namespace[len(EXTRA_KEY_PREFIX):]
        namespace = None  # the extra_key was only the carrier: sharing must not be split by it
    if spec is None:
        return None
    return parse_spec(spec, namespace, store)


def _spec_text(spec: dict) -> str:
    return json.dumps(spec, separators=(",", ":"))


def request_fields(messages: list[list[int]], cache: dict | None = None, via: str = "custom_params",
                   base: HistoryState | None = None, miss: str | None = None, hold: bool | str = False) -> dict:
    """The `/generate` fields for a conversation (message token ids) and its cache ops: `input_ids` (physical) plus
    the history as a JSON string in `sampling_params.custom_params` (via="custom_params") or in `extra_key`
    (via="extra_key"). With `base` (the state of messages[:base.n], as the server remembers it), only the new
    messages and the ops at boundaries >= base.n - 1 are sent (the compact form). `miss` (one of `MISS_MODES`;
    None = the server's default, "reprefill") says what the server does when an op's pre-op state is not cached.
    `hold`: the server holds the state this request leaves until a request continues it with an op: a seal (the
    state before the next turn's op, sent with 1 new token); True within the server's hold budget, "always" past it
    (a rebuild after a refusal)."""
    return build_request(messages, cache, via, base, miss, hold)[0]


def build_request(messages: list[list[int]], cache: dict | None = None, via: str = "custom_params",
                  base: HistoryState | None = None, miss: str | None = None,
                  hold: bool | str = False) -> tuple[dict, HistoryState, HistoryState | None]:
    """`request_fields`, the state the server will remember for the request (its `key` names it) and the one
    before its last message (remembered too, when the request sends more than one message)."""
    if via not in ("custom_params", "extra_key"):
        raise ValueError(f"via must be 'custom_params' or 'extra_key', got {via!r}")
    if miss is not None and miss not in MISS_MODES:
        raise ValueError(f"miss must be one of {MISS_MODES}, got {miss!r}")
    state, penultimate, spec = _resolve_local(messages, cache, base)
    if miss is not None:
        spec["miss"] = miss
    if hold not in (False, True, "always"):
        raise ValueError(f"hold must be True, False or 'always', got {hold!r}")
    if hold:
        spec["hold"] = hold
    text = _spec_text(spec)
    ids = list(_array(state.tokens))
    if via == "custom_params":
        body = {"input_ids": ids, "sampling_params": {"custom_params": {FIELD: text}}}
    else:
        body = {"input_ids": ids, "extra_key": EXTRA_KEY_PREFIX + text}
    return body, state, penultimate


def _ops_between(cache: dict | None, lo: int, hi: float = float("inf")) -> dict:
    """The ops of `cache` at boundaries lo <= b < hi."""
    cache = cache or {}
    return {"drop": {k: v for k, v in (cache.get("drop") or {}).items() if lo <= int(k) < hi},
            "reposition": [i for i in (cache.get("reposition") or []) if lo <= int(i) < hi]}


def _new_ops(cache: dict | None, first: int) -> dict:
    """The ops of `cache` at boundaries >= first - 1 (what a compact request continuing messages[:first] sends)."""
    return _ops_between(cache, max(0, first - 1))


def _resolve_local(messages: list[list[int]], cache: dict | None,
                   base: HistoryState | None) -> tuple[HistoryState, HistoryState | None, dict]:
    if base is None or base.n == 0:
        spec = {"v": VERSION, "messages": [list(m) for m in messages], "cache": cache or {}}
        state, penultimate = ROOT.extend_with_penultimate([array("q", m) for m in messages], cache)
        return state, penultimate, spec
    new = messages[base.n:]
    if not new:
        raise OpsError("a compact request needs at least one new message after its base", f"{FIELD}.messages")
    ops = _new_ops(cache, base.n)
    spec = {"v": VERSION, "base": base.key, "n": base.n, "messages": [list(m) for m in new], "cache": ops}
    state, penultimate = base.extend_with_penultimate([array("q", m) for m in new], ops)
    return state, penultimate, spec


class SglangHistory:
    """A client's side of one conversation on an SGLang server with the kvsteward backend: builds each request's
    fields, in the compact form once the server has seen the history it continues.

    `fields(messages, cache)`: `messages` is the whole conversation so far (token ids per message; the last one ends
    with the generation prompt, or is it), `cache` every op so far (the grammar above). The base is the longest
    history the server remembers from this client's previous request — all its messages, or all but the last (a
    turn rewrites the generation prompt into the whole reply) — whose messages and inner ops this request repeats;
    only the rest is sent. Otherwise the full form. `fork_fields` builds a request off the same base (the aux
    manager's fork) without changing what the next main request continues. `reset()` after a server restart."""

    def __init__(self, via: str = "custom_params", miss: str | None = None):
        self.via, self.miss = via, miss
        self._known: list[HistoryState] = []  # what the server remembers from the last main request

    def fields(self, messages: list[list[int]], cache: dict | None = None, full: bool = False,
               hold: bool | str = False) -> dict:
        body, state, penultimate = self._build(messages, cache, full, hold)
        self._known = [s for s in (state, penultimate) if s is not None]
        return body

    def fork_fields(self, messages: list[list[int]], cache: dict | None = None) -> dict:
        return self._build(messages, cache, False)[0]

    def reset(self) -> None:
        """Forget what was sent (a server restart): the next request goes in full."""
        self._known = []

    def _build(self, messages, cache, full, hold=False):
        base = None if full else self._base(messages, cache or {})
        return build_request(messages, cache, via=self.via, base=base, miss=self.miss, hold=hold)

    def pre_op_fields(self, messages: list[list[int]], cache: dict | None, tokens: int) -> dict:
        """The full-form request for the state a refused request named (`refused_pre_op`): the messages whose
        tokens add up to `tokens` and the ops at the boundaries before the last of them, i.e. the state the ops
        after that message apply to. Sent with 1 new token it makes the tree hold that state whole (its missing
        tokens computed at their positions, the ones later ops drop included)."""
        ends = list(accumulate(len(m) for m in messages))
        if tokens not in ends:
            raise OpsError(f"the server named a pre-op state of {tokens} tokens, which ends at no message boundary "
                           f"of this history ({ends[-8:]} ...)", f"{FIELD}.miss")
        last = ends.index(tokens)
        before = _ops_between(cache, 0, last)
        # held past the budget: the request it is for was refused once and waits for it
        return build_request(messages[: last + 1], before, via=self.via, miss=self.miss, hold="always")[0]

    def _base(self, messages: list[list[int]], cache: dict) -> HistoryState | None:
        known = [s for s in self._known if 0 < s.n < len(messages)]
        if not known:
            return None
        spec = parse_cache(cache, len(messages))
        key, keys = ROOT_KEY, {}
        for i in range(max(s.n for s in known)):
            key = chain_key(key, _boundary_json(spec, i - 1) if i > 0 else "", array("q", messages[i]))
            keys[i + 1] = key
        for s in sorted(known, key=lambda s: -s.n):
            if keys.get(s.n) == s.key:
                return s
        return None


def _reprefill(body: dict, messages: list[list[int]], cache: dict | None, via: str) -> dict:
    """`body` in the full form with `miss: "reprefill"`: its history fields replaced, every other field kept (the
    sampling parameters, an aux fork's adapter, logit processor and log-probability fields)."""
    full = build_request(messages, cache, via=via, miss="reprefill")[0]
    out = copy.deepcopy(body)
    out["input_ids"] = full["input_ids"]
    if via == "custom_params":
        out.setdefault("sampling_params", {}).setdefault("custom_params", {})[FIELD] = \
            full["sampling_params"]["custom_params"][FIELD]
    else:
        out["extra_key"] = full["extra_key"]
    return out


def refused_pre_op(out: dict) -> int | None:
    """The logical length of the pre-op state a `/generate` response says it was refused for (`miss: "refuse"`), or
    None when the request was served."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("err_type") == MISS_ERR_TYPE:
        return int(reason[MISS_TOKENS])
    return None


def generate_exact(send: Callable[[dict, int], dict], history: SglangHistory, body: dict,
                   messages: list[list[int]], cache: dict | None, max_new_tokens: int,
                   max_refusals: int = 8) -> tuple[dict, int]:
    """Serve `body` (built by `history`, with `miss: "refuse"`) exactly when the tree has lost a pre-op state: each
    refusal names the state to rebuild; its 1-token request goes first (it may be refused in turn for an earlier
    state: a stack), then the request is sent again. After `max_refusals` (memory so tight that rebuilt states are
    evicted again before use) the request goes with `miss: "reprefill"` (served as plain tokens, counted by the
    server). `send(body, n)` posts and returns the response. Returns (response, refusals)."""
    stack, refusals = [(body, max_new_tokens)], 0
    while True:
        out = send(*stack[-1])
        tokens = refused_pre_op(out)
        if tokens is None:
            stack.pop()
            if not stack:
                return out, refusals
            continue
        refusals += 1
        if refusals > max_refusals:
            return send(_reprefill(body, messages, cache, history.via), max_new_tokens), refusals
        stack.append((history.pre_op_fields(messages, cache, tokens), 1))
