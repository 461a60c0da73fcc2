"""Stateless chat completions: the full message list + `cache` ops determine the state; the server reuses the
deepest cached (config, ops) prefix and rebuilds the rest.

The state cached for a request is the prompt state (every message appended, every op applied); the reply is
generated on a private fork, so a later request that sends the reply back as a message appends it as one message —
exactly what a fresh server would do. The generated tokens themselves are never cached (per-token appends are a
different op history from one message append).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field

from kvsteward.serve.engine.ops import (
    ROLE_KIND,
    OpsError,
    SessionSpec,
    apply_op,
    build_ops,
    generation_prompt_ids,
    message_pieces,
    message_ranges,
    normalize_messages,
    op_tokens,
    parse_cache,
    resolve_blueprint,
    session_spec,
)
from kvsteward.serve.server.decode import Decoder
from kvsteward.serve.server.prompt_bound import bytes_per_token, min_tokens
from kvsteward.serve.server.state import PrefixCache


@dataclass
class ServeLimits:
    max_tokens_default: int = 256
    max_tokens_limit: int = 4096
    max_messages: int | None = None  # messages of one request (a session turn: its new messages); None: no limit
    max_prompt_tokens: int | None = None  # prompt tokens of one request as the template renders them (None: the
    # model's positions, filled in by `for_model`; a model without max_position_embeddings has no limit)
    request_timeout: float | None = None  # seconds from arrival; decoding stops once spent (finish_reason "length")

    def validate(self) -> None:
        for name in ("max_messages", "max_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds or None, got {self.request_timeout!r}")

    def for_model(self, engine) -> ServeLimits:
        """These limits with the default `max_prompt_tokens` filled in: the model's positions (a prompt beyond them
        cannot be encoded without bounded positions, and its prefill alone would hold the engine for minutes)."""
        if self.max_prompt_tokens is not None:
            return self
        return dataclasses.replace(self, max_prompt_tokens=model_positions(engine))


class Cancelled(Exception):
    """The client went away: the request's work stops at the next prefill chunk or decode step."""


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled


def model_positions(engine) -> int | None:
    return getattr(engine.model.config, "max_position_embeddings", None)


def run_op(session, op, ranges: list[tuple[int, int]], lock, cancel: threading.Event | None = None) -> None:
    """`apply_op`, cancellable between prefill chunks: an append runs as one chunk-sized append per forward (the
    first opens the message, the rest continue it) — the same forwards, so the same state and history — holding
    the engine lock per chunk, so other requests interleave at chunk granularity too."""
    check_cancel(cancel)
    chunk = session.config.chunk
    if op[0] != "append" or len(op[2]) <= chunk:
        apply_op(session, op, ranges, lock)
        return
    tokens = list(op[2])
    for start in range(0, len(tokens), chunk):
        if start:
            check_cancel(cancel)
        with lock:
            session.append(tokens[start : start + chunk], kind=op[1], continue_message=start > 0, logits=None)


class _Deadline(Exception):
    pass


@dataclass
class TimedDecoder(Decoder):
    """A Decoder that stops at the next token once `deadline` (time.monotonic()) has passed: the reply ends there
    with finish_reason "length", as if max_tokens had been reached."""

    deadline: float | None = None
    timed_out: bool = False
    cancel: threading.Event | None = None  # set when the client has gone: the next step raises Cancelled

    def _step(self, tok: int) -> None:
        check_cancel(self.cancel)
        expired = self.deadline is not None and time.monotonic() > self.deadline
        if expired and not self.append_last:  # a private fork: the token is in the reply, its KV is not needed
            raise _Deadline
        super()._step(tok)
        if expired:  # a persistent session keeps every token of its reply: appended before stopping
            raise _Deadline

    def __iter__(self):
        emitted = 0
        try:
            for piece in super().__iter__():
                emitted += len(piece)
                yield piece
        except _Deadline:
            self.finish_reason, self.timed_out = "length", True
            if len(self.text) > emitted:
                yield self.text[emitted:]


@dataclass
class Prepared:
    """A request ready to decode: a private session holding prompt + generation prompt."""

    session: object
    decoder: Decoder
    prompt_tokens: int
    reused_tokens: int
    info: dict = field(default_factory=dict)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise OpsError("stop must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    return tuple(stop)


def max_new_tokens(value, limits: ServeLimits) -> int:
    if value is None:
        return limits.max_tokens_default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limits.max_tokens_limit:
        raise OpsError(f"max_tokens must be an integer in [1, {limits.max_tokens_limit}], got {value!r}", "max_tokens")
    return value


def stop_ids(engine) -> frozenset[int]:
    ids = set(engine.eos_ids)
    tok = engine.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return frozenset(ids)


def prompt_token_count(tokenizer, messages: list[dict], tools: list | None, generation_prompt: bool = True,
                       limits: ServeLimits | None = None, per_token: float | None = None) -> int:
    """Tokens of the whole prompt, rendered by the chat template once (linear in the messages). With `limits` and
    `per_token` (`prompt_bound.bytes_per_token`): a rendering whose size alone proves it over `max_prompt_tokens`
    is refused before it is tokenized."""
    from kvsteward.serve.engine.ops import _render

    text = _render(tokenizer, messages, tools, add_generation_prompt=generation_prompt)
    cap = None if limits is None else limits.max_prompt_tokens
    if cap is not None and min_tokens(text, per_token) > cap:
        raise OpsError(f"the prompt has at least {min_tokens(text, per_token)} tokens ({len(text.encode())} bytes, at "
                       f"most {per_token:g} bytes a token), over this server's limit of {cap}", "messages",
                       "context_length_exceeded")
    return len(tokenizer.encode(text, add_special_tokens=False))


def check_message_count(n: int, limits: ServeLimits, param: str = "messages") -> None:
    if limits.max_messages is not None and n > limits.max_messages:
        raise OpsError(f"{n} messages exceed this server's limit of {limits.max_messages} per request", param,
                       "too_many_messages")


def check_prompt_size(engine, limits: ServeLimits, n_prompt: int, n_new: int, unbounded: bool) -> None:
    """Refuse, before any forward, a prompt over `max_prompt_tokens` or (unbounded positions, no reposition) one
    whose prompt + max_tokens exceeds the model's positions."""
    if limits.max_prompt_tokens is not None and n_prompt > limits.max_prompt_tokens:
        raise OpsError(f"the prompt has {n_prompt} tokens, over this server's limit of {limits.max_prompt_tokens}",
                       "messages", "context_length_exceeded")
    max_pos = model_positions(engine)
    if unbounded and max_pos is not None and n_prompt + n_new > max_pos:
        raise OpsError(f"context length exceeded: {n_prompt} prompt tokens + {n_new} max_tokens > {max_pos} "
                       "positions of the model (lower max_tokens, drop + reposition, or use bounded positions via "
                       "'limit')", "messages", "context_length_exceeded")


def check_context(engine, session, n_new: int) -> None:
    """Unbounded positions must stay below the model's position range (bounded sessions renumber instead)."""
    max_pos = getattr(engine.model.config, "max_position_embeddings", None)
    if session.config.limit is None and max_pos is not None and session.next_pos + n_new > max_pos:
        raise OpsError(f"context length exceeded: next position {session.next_pos} + {n_new} new tokens > "
                       f"{max_pos} positions of the model (drop + reposition, or use bounded positions via "
                       "'limit')", "messages", "context_length_exceeded")


def cache_root(owner: str | None, spec: SessionSpec) -> object:
    """The prefix-cache root of a request: its owner, then its session config. Owners never share a state: a hit
    (its `reused_tokens`, or its latency) would tell one API key what another one sent. The anonymous owner (no API
    keys) roots at the bare config, as the cache did before owners (a SessionSpec is never a tuple: no clash)."""
    return spec if owner is None else (owner, spec)


PUBLIC = ("public",)  # the owner of declared-public prefixes: a tuple, so no owner name (a string) can be it


def public_first_messages(tokenizer, prompts: tuple[str, ...]) -> frozenset[tuple[int, ...]]:
    """The first-message appends (tokens) of the declared-public system prompts, rendered as a conversation's first
    message without tools: a request whose first op appends exactly these tokens starts with public text only."""
    return frozenset(tuple(message_pieces(tokenizer, [{"role": "system", "content": p}], None)[0]) for p in prompts)


class ChatService:
    def __init__(self, engine, defaults: SessionSpec, cache_bytes: int, limits: ServeLimits, metrics,
                 lock: threading.Lock | None = None, checkpoints: bool = True, public_prompts: tuple[str, ...] = ()):
        self.engine = engine
        self.defaults = defaults
        self.limits = limits
        self.metrics = metrics
        self.lock = lock or threading.Lock()  # one model forward at a time: the engine is not thread-safe
        self.cache = PrefixCache(cache_bytes, metrics)
        self.checkpoints = checkpoints
        self.stop_ids = stop_ids(engine)
        self.per_token = bytes_per_token(engine.tokenizer)  # once: the bound reads the whole vocabulary
        self.public = public_first_messages(engine.tokenizer, public_prompts)

    def prepare(self, body: dict, t0: float | None = None, owner: str | None = None,
                cancel: threading.Event | None = None) -> Prepared:
        """Validate the request, build (or reuse) its prompt state, open the assistant reply. Every limit is checked
        before the first forward (a refused request leaves the prefix cache as it was). `t0`: the request's arrival
        (time.monotonic(); the start of its `request_timeout`). `owner`: whose prefix-cache partition serves and
        keeps its states (None: the one anonymous owner of a server without keys). `cancel`: set when the client
        has gone; the work stops at the next prefill chunk or decode step (`Cancelled`)."""
        t0 = time.monotonic() if t0 is None else t0
        tok = self.engine.tokenizer
        raw = body.get("messages")
        if isinstance(raw, list):
            check_message_count(len(raw), self.limits)
        messages = normalize_messages(raw)
        tools = body.get("tools")
        n_new = max_new_tokens(body.get("max_completion_tokens", body.get("max_tokens")), self.limits)
        stops = stop_strings(body.get("stop"))
        cache = parse_cache(body.get("cache"), len(messages))
        bare = session_spec(self.engine, self.defaults, body.get("policy"), body.get("budget"), body.get("limit"))
        n_prompt = prompt_token_count(tok, messages, tools, limits=self.limits, per_token=self.per_token)
        check_prompt_size(self.engine, self.limits, n_prompt, n_new,
                          unbounded=bare.limit is None and not cache.reposition)
        pieces = message_pieces(tok, messages, tools)
        ranges = message_ranges(pieces)
        spec = session_spec(self.engine, self.defaults, body.get("policy"), body.get("budget"), body.get("limit"),
                            resolve_blueprint(body.get("blueprint"), ranges))
        ops = build_ops(pieces, [ROLE_KIND[m["role"]] for m in messages], cache)
        gen_prompt = generation_prompt_ids(tok, messages, tools)

        session, match = self._build_match(spec, ops, ranges, room=len(gen_prompt) + n_new, owner=owner,
                                           cancel=cancel)
        depth = match.depth
        reused = sum(op_tokens(op) for op in ops[:depth])
        requested = ranges[-1][1]
        self.metrics.reuse(requested, reused)
        info = {"reused_tokens": reused, "resident_tokens": session.resident, "history_len": len(session.history),
                "history_key": session.history_key(), "next_position": session.next_pos,
                "prefix_match": match.kind}
        check_cancel(cancel)
        with self.lock:
            session.append(gen_prompt, kind="assistant", logits=None)
        timeout = self.limits.request_timeout
        decoder = TimedDecoder(session, tok, self.lock, n_new, self.stop_ids, stops,
                               deadline=None if timeout is None else t0 + timeout, cancel=cancel)
        return Prepared(session, decoder, prompt_tokens=requested + len(gen_prompt), reused_tokens=reused, info=info)

    def _build(self, spec: SessionSpec, ops: list, ranges: list[tuple[int, int]], owner: str | None = None):
        """(session, depth): see `_build_match`."""
        session, match = self._build_match(spec, ops, ranges, owner=owner)
        return session, match.depth

    def _build_match(self, spec: SessionSpec, ops: list, ranges: list[tuple[int, int]], room: int | None = None,
                     owner: str | None = None, cancel: threading.Event | None = None):
        """Fork the deepest cached prefix (exact, or a repositioned version of it restored by re-rotation: see
        `PrefixCache.lookup`), apply the rest, cache the result (and checkpoints on the way); (session, Match).
        `room`: tokens still to come (generation prompt + reply); a state without room for them below the model's
        positions is refused (`check_context`) before it is cached — what a `reposition` gives back is known only
        once it ran. The cache is partitioned by `owner` (`cache_root`)."""
        root = cache_root(owner, spec)
        match = self.cache.lookup(root, ops, self.lock)
        public = owner is not None and bool(ops) and ops[0][0] == "append" and ops[0][2] in self.public
        if public and match.depth == 0:  # the owner holds nothing: the declared-public first message may serve
            match = self.cache.lookup(cache_root(PUBLIC, spec), ops[:1], self.lock, compatible=False)
        session, depth = match.session, match.depth
        if session is None:
            session = spec.new_session(self.engine)
        marks = self._checkpoint_depths(ops) if self.checkpoints else set()
        for i in range(depth, len(ops)):
            run_op(session, ops[i], ranges, self.lock, cancel)
            if i + 1 in marks and i + 1 < len(ops):
                self.cache.insert(root, ops[: i + 1], session)
            if i == 0 and public:  # state(public first message): the same computation whoever asks
                self.cache.insert(cache_root(PUBLIC, spec), ops[:1], session)
        if room is not None:
            check_context(self.engine, session, room)
        if depth < len(ops) or match.kind == "compatible":  # a restored state(ops) is not held yet either
            self.cache.insert(root, ops, session)
        return session, match

    @staticmethod
    def _checkpoint_depths(ops: list) -> set[int]:
        """Where a next request most likely branches off: before the last message (a retried / alternative last
        message) and right after it, before its boundary ops (a different drop / reposition decision)."""
        appends = [i for i, op in enumerate(ops) if op[0] == "append"]
        return {appends[-1], appends[-1] + 1}

    def complete(self, body: dict, t0: float | None = None, owner: str | None = None,
                 cancel: threading.Event | None = None) -> dict:
        t0 = time.monotonic() if t0 is None else t0
        prep = self.prepare(body, t0, owner, cancel)
        text = prep.decoder.run()
        self.metrics.generated_tokens.inc(len(prep.decoder.tokens))
        return completion_object(body, prep, text, t0)


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(prep: Prepared) -> dict:
    n = len(prep.decoder.tokens)
    return {"prompt_tokens": prep.prompt_tokens, "completion_tokens": n, "total_tokens": prep.prompt_tokens + n}


def completion_object(body: dict, prep: Prepared, text: str, t0: float) -> dict:
    return {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model") or "kvsteward",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": prep.decoder.finish_reason, "logprobs": None}],
        "usage": usage(prep),
        "kvsteward": {**prep.info, "seconds": round(time.monotonic() - t0, 6)},
    }
