"""Stateless chat completions: the full message list + `cache` ops determine the state; the server reuses the
deepest cached (config, ops) prefix and rebuilds the rest.

The state cached for a request is the prompt state (every message appended, every op applied); the reply is
generated on a private fork, so a later request that sends the reply back as a message appends it as one message —
exactly what a fresh server would do. The generated tokens themselves are never cached (per-token appends are a
different op history from one message append).
"""

from __future__ import annotations

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
from kvsteward.serve.server.state import PrefixCache


@dataclass
class ServeLimits:
    max_tokens_default: int = 256
    max_tokens_limit: int = 4096


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


def check_context(engine, session, n_new: int) -> None:
    """Unbounded positions must stay below the model's position range (bounded sessions renumber instead)."""
    max_pos = getattr(engine.model.config, "max_position_embeddings", None)
    if session.config.limit is None and max_pos is not None and session.next_pos + n_new > max_pos:
        raise OpsError(f"context length exceeded: next position {session.next_pos} + {n_new} new tokens > "
                       f"{max_pos} positions of the model (drop + reposition, or use bounded positions via "
                       "'limit')", "messages")


class ChatService:
    def __init__(self, engine, defaults: SessionSpec, cache_bytes: int, limits: ServeLimits, metrics,
                 lock: threading.Lock | None = None, checkpoints: bool = True):
        self.engine = engine
        self.defaults = defaults
        self.limits = limits
        self.metrics = metrics
        self.lock = lock or threading.Lock()  # one model forward at a time: the engine is not thread-safe
        self.cache = PrefixCache(cache_bytes, metrics)
        self.checkpoints = checkpoints
        self.stop_ids = stop_ids(engine)

    def prepare(self, body: dict) -> Prepared:
        """Validate the request, build (or reuse) its prompt state, open the assistant reply."""
        tok = self.engine.tokenizer
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools")
        pieces = message_pieces(tok, messages, tools)
        ranges = message_ranges(pieces)
        spec = session_spec(self.engine, self.defaults, body.get("policy"), body.get("budget"), body.get("limit"),
                            resolve_blueprint(body.get("blueprint"), ranges))
        cache = parse_cache(body.get("cache"), len(messages))
        ops = build_ops(pieces, [ROLE_KIND[m["role"]] for m in messages], cache)
        n_new = max_new_tokens(body.get("max_completion_tokens", body.get("max_tokens")), self.limits)
        stops = stop_strings(body.get("stop"))
        gen_prompt = generation_prompt_ids(tok, messages, tools)

        session, match = self._build_match(spec, ops, ranges)
        depth = match.depth
        reused = sum(op_tokens(op) for op in ops[:depth])
        requested = ranges[-1][1]
        self.metrics.reuse(requested, reused)
        info = {"reused_tokens": reused, "resident_tokens": session.resident, "history_len": len(session.history),
                "history_key": session.history_key(), "next_position": session.next_pos,
                "prefix_match": match.kind}
        check_context(self.engine, session, len(gen_prompt) + n_new)
        with self.lock:
            session.append(gen_prompt, kind="assistant", logits=None)
        decoder = Decoder(session, tok, self.lock, n_new, self.stop_ids, stops)
        return Prepared(session, decoder, prompt_tokens=requested + len(gen_prompt), reused_tokens=reused, info=info)

    def _build(self, spec: SessionSpec, ops: list, ranges: list[tuple[int, int]]):
        """(session, depth): see `_build_match`."""
        session, match = self._build_match(spec, ops, ranges)
        return session, match.depth

    def _build_match(self, spec: SessionSpec, ops: list, ranges: list[tuple[int, int]]):
        """Fork the deepest cached prefix (exact, or a repositioned version of it restored by re-rotation: see
        `PrefixCache.lookup`), apply the rest, cache the result (and checkpoints on the way); (session, Match)."""
        match = self.cache.lookup(spec, ops, self.lock)
        session, depth = match.session, match.depth
        if session is None:
            session = spec.new_session(self.engine)
        marks = self._checkpoint_depths(ops) if self.checkpoints else set()
        for i in range(depth, len(ops)):
            apply_op(session, ops[i], ranges, self.lock)
            if i + 1 in marks and i + 1 < len(ops):
                self.cache.insert(spec, ops[: i + 1], session)
        if depth < len(ops) or match.kind == "compatible":  # a restored state(ops) is not held yet either
            self.cache.insert(spec, ops, session)
        return session, match

    @staticmethod
    def _checkpoint_depths(ops: list) -> set[int]:
        """Where a next request most likely branches off: before the last message (a retried / alternative last
        message) and right after it, before its boundary ops (a different drop / reposition decision)."""
        appends = [i for i, op in enumerate(ops) if op[0] == "append"]
        return {appends[-1], appends[-1] + 1}

    def complete(self, body: dict) -> dict:
        t0 = time.perf_counter()
        prep = self.prepare(body)
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
        "kvsteward": {**prep.info, "seconds": round(time.perf_counter() - t0, 6)},
    }
