"""Persistent sessions: one append-only JSONL log per session, every turn fsynced before it is acknowledged.

Log lines (`<data>/sessions/<id>.jsonl`):
    {"type": "create", "v": 1, "id", "created", "spec": {...}, "tools": [...] | null}
    {"type": "turn", "turn": k, "messages": [new messages, the generated reply included], "cache": {...},
     "ops": [the engine history entries this turn added], "reply": {...} | null}

A session is rebuilt by replaying the persisted engine ops in order (appends with their exact chunks and steps,
drops, repositions; evictions and renumbers happen again by themselves) — the same forwards in the same order, so
the state is the one acknowledged — and the rebuilt history must equal the persisted one op for op, or the rebuild
fails loudly. A torn last line (a kill during the write, never acknowledged) is cut off on load.

Idle sessions beyond `max_bytes` of KV are unloaded LRU and rebuilt from their log on the next access.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvsteward.serve.completions import check_context, max_new_tokens, stop_strings
from kvsteward.serve.decode import Decoder
from kvsteward.serve.ops import (
    ROLE_KIND,
    OpsError,
    SessionSpec,
    apply_op,
    build_ops,
    generation_prompt_ids,
    message_pieces,
    normalize_messages,
    parse_cache,
    resolve_blueprint,
    session_spec,
)

ID_RE = re.compile(r"^sess_[0-9a-f]{24}$")


class SessionNotFound(KeyError):
    pass


class RebuildError(RuntimeError):
    """A persisted history that does not replay to itself (a corrupt log or a nondeterministic engine)."""


# -- the log --------------------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SessionLog:
    def __init__(self, path: Path):
        self.path = path

    def append(self, record: dict) -> None:
        """Write one line and fsync it: when this returns, the record survives a kill -9 or a power cut."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        new = not self.path.exists()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if new:
            _fsync_dir(self.path.parent)

    def read(self) -> list[dict]:
        """All complete records; a torn trailing line (never acknowledged) is truncated away."""
        data = self.path.read_bytes()
        records, good = [], 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        return records


def model_fingerprint(engine) -> str:
    """Identity of the model a log was written with: config, dtype and two weight checksums (a replay on other
    weights would silently compute another state)."""
    model = engine.model.get_base_model() if hasattr(engine.model, "get_base_model") else engine.model  # main
    params = list(model.parameters())  # threads run the base model: an aux-thread LoRA adapter does not count
    sums = [float(p.detach().double().sum()) for p in (params[0], params[-1])]
    text = model.config.to_json_string(use_diff=False) + str(engine.dtype) + repr(sums)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- replay ---------------------------------------------------------------------------------------------------------
def replay(session, ops: list[dict]) -> None:
    """Re-run persisted engine history entries on `session` (evict / renumber are re-derived, not replayed)."""
    for op in ops:
        kind = op["op"]
        if kind == "append":
            cont = op["step"] == session.current_step
            if not cont and op["step"] != session.n_messages:
                raise RebuildError(f"append for step {op['step']} but the session is at step {session.n_messages}")
            session.append(op["tokens"], kind=op["kind"], continue_message=cont, logits=None)
        elif kind == "drop":
            session.drop(op["indices"])
        elif kind == "reposition":
            session.reposition()
        elif kind not in ("evict", "renumber"):
            raise RebuildError(f"unknown op {kind!r} in the log")


def message_ranges_of(history: list[dict]) -> list[tuple[int, int]]:
    """Logical token range of every message (step), from the engine history."""
    ranges: list[list[int]] = []
    n = 0
    for op in history:
        if op["op"] == "append":
            if op["step"] == len(ranges):
                ranges.append([n, n])
            ranges[op["step"]][1] = n + len(op["tokens"])
            n += len(op["tokens"])
    return [tuple(r) for r in ranges]


# -- one session ----------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Record:
    id: str
    spec: SessionSpec
    tools: list | None
    created: int
    log: SessionLog
    messages: list[dict] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    turns: int = 0
    session: object | None = None  # the engine Session, None while unloaded
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = 0.0
    deleted: bool = False
    pending: list[dict] | None = None  # turns read at load, replayed on first use

    def describe(self) -> dict:
        s = self.session
        return {"id": self.id, "object": "session", "created": self.created, "config": self.spec.as_json(),
                "turns": self.turns, "n_messages": len(self.messages), "messages": self.messages,
                "dropped_messages": sorted(self.dropped), "resident_tokens": s.resident, "n_logical": s.n_logical,
                "next_position": s.next_pos, "history_len": len(s.history), "history_key": s.history_key()}


class SessionStore:
    def __init__(self, root: Path, engine, defaults: SessionSpec, lock: threading.Lock, metrics,
                 max_bytes: int, limits):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.engine, self.defaults, self.lock, self.metrics = engine, defaults, lock, metrics
        self.max_bytes = max_bytes
        self.limits = limits
        self._records: dict[str, Record] = {}
        self._guard = threading.Lock()
        self.fingerprint = model_fingerprint(engine)
        self._known = {p.stem for p in self.root.glob("sess_*.jsonl") if ID_RE.match(p.stem)}
        self.metrics.sessions_known.set(len(self._known))

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def create(self, body: dict) -> Record:
        blueprint = resolve_blueprint(body.get("blueprint"), None)
        spec = session_spec(self.engine, self.defaults, body.get("policy"), body.get("budget"), body.get("limit"),
                            blueprint)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise OpsError("tools must be a list of tool definitions", "tools")
        sid = "sess_" + uuid.uuid4().hex[:24]
        rec = Record(sid, spec, tools, int(time.time()), SessionLog(self.root / f"{sid}.jsonl"))
        rec.log.append({"type": "create", "v": 1, "id": sid, "created": rec.created, "spec": spec.as_json(),
                        "tools": tools, "model": self.fingerprint})
        rec.session = spec.new_session(self.engine)
        with self._guard:
            self._records[sid] = rec
            self._known.add(sid)
        self._touch(rec)
        return rec

    def ids(self) -> list[str]:
        with self._guard:
            return sorted(self._known)

    def acquire(self, sid: str, load: bool = True) -> Record:
        """The session's record, loaded (rebuilt from its log if needed); the caller holds `rec.lock`."""
        if not ID_RE.match(sid):
            raise SessionNotFound(sid)
        with self._guard:
            rec = self._records.get(sid)
            if rec is None:
                if sid not in self._known:
                    raise SessionNotFound(sid)
                rec = self._load_record(sid)
                self._records[sid] = rec
        rec.lock.acquire()
        if rec.deleted:
            rec.lock.release()
            raise SessionNotFound(sid)
        try:
            if load and rec.session is None:
                self._rebuild(rec)
        except BaseException:
            rec.lock.release()
            raise
        return rec

    def release(self, rec: Record) -> None:
        rec.lock.release()
        self._touch(rec)

    def delete(self, sid: str) -> None:
        rec = self.acquire(sid, load=False)
        try:
            rec.log.path.unlink(missing_ok=True)
            _fsync_dir(self.root)
            rec.deleted, rec.session = True, None
            with self._guard:
                self._records.pop(sid, None)
                self._known.discard(sid)
        finally:
            rec.lock.release()
        self._publish()

    # -- loading ----------------------------------------------------------------------------------------------------
    def _load_record(self, sid: str) -> Record:
        log = SessionLog(self.root / f"{sid}.jsonl")
        records = log.read()
        if not records or records[0].get("type") != "create":
            raise RebuildError(f"session {sid}: log has no create record")
        head = records[0]
        if head.get("model") != self.fingerprint:
            raise RebuildError(f"session {sid} was created with model {head.get('model')}; this server runs "
                               f"{self.fingerprint}: its history would replay to a different state")
        s = head["spec"]
        spec = SessionSpec(policy=s["policy"], budget=s["budget"], limit=s["limit"], chunk=s["chunk"],
                           blueprint=resolve_blueprint(s["blueprint"], None))
        return Record(sid, spec, head.get("tools"), head["created"], log, pending=records[1:])

    def _rebuild(self, rec: Record) -> None:
        t0 = time.perf_counter()
        turns = rec.pending
        if turns is None:
            turns = rec.log.read()[1:]
        session = rec.spec.new_session(self.engine)
        expected: list[dict] = []
        messages: list[dict] = []
        dropped: set[int] = set()
        for t in turns:
            try:
                with self.lock:  # hold the engine for a whole turn: replay is a burst of forwards
                    replay(session, t["ops"])
            except (ValueError, KeyError, TypeError) as e:  # CacheOpError included: a log the engine refuses
                raise RebuildError(f"session {rec.id}: turn {t.get('turn')} does not replay: {e}") from e
            expected.extend(t["ops"])
            messages.extend(t["messages"])
            for js in t["cache"].get("drop", {}).values():
                dropped.update(js)
        if session.history != expected:
            at = next((i for i, (a, b) in enumerate(zip(session.history, expected, strict=False)) if a != b),
                      min(len(session.history), len(expected)))
            raise RebuildError(f"session {rec.id}: replay diverged from the persisted history at op {at}")
        rec.session, rec.messages, rec.dropped, rec.turns = session, messages, dropped, len(turns)
        rec.pending = None
        self.metrics.rebuild_seconds.observe(time.perf_counter() - t0)
        self._publish()

    # -- a turn -----------------------------------------------------------------------------------------------------
    def turn(self, rec: Record, body: dict) -> dict:
        """Append new messages (+ their cache ops), optionally generate a reply, persist, then answer."""
        tok = self.engine.tokenizer
        new = normalize_messages(body.get("messages") or [], allow_empty=True)
        generate = body.get("generate", body.get("max_tokens") is not None)
        if not isinstance(generate, bool):
            raise OpsError("generate must be true or false", "generate")
        if not new and not body.get("cache") and not generate:
            raise OpsError("nothing to do: give new messages, cache ops or generate=true", "messages")
        n_old = len(rec.messages)
        msgs = rec.messages + new
        pieces = message_pieces(tok, msgs, rec.tools, start=n_old)
        cache = parse_cache(body.get("cache"), len(msgs), first=n_old, dropped=frozenset(rec.dropped))
        ops = build_ops(pieces, [ROLE_KIND[m["role"]] for m in new], cache, first=n_old)
        n_new, stops = 0, ()
        if generate:
            n_new = max_new_tokens(body.get("max_completion_tokens", body.get("max_tokens")), self.limits)
            stops = stop_strings(body.get("stop"))
        session = rec.session
        h0 = len(session.history)
        try:
            reply = self._apply(rec, session, msgs, ops, generate, n_new, stops)
            new_messages = new + ([{"role": "assistant", "content": reply["content"]}] if reply else [])
            rec.log.append({"type": "turn", "turn": rec.turns, "messages": new_messages, "cache": cache.as_json(),
                            "ops": session.history[h0:], "reply": reply})
        except BaseException:
            rec.session = None  # partly applied and never persisted: rebuild from the log on next use
            raise
        self.metrics.persisted_turns.inc()
        rec.messages = msgs + new_messages[len(new):]
        rec.dropped.update(j for js in cache.drop.values() for j in js)
        rec.turns += 1
        return {"id": rec.id, "object": "session.turn", "turn": rec.turns - 1, "n_messages": len(rec.messages),
                "reply": reply, "resident_tokens": session.resident, "n_logical": session.n_logical,
                "next_position": session.next_pos, "history_len": len(session.history),
                "history_key": session.history_key(), "persisted": True}

    def _apply(self, rec: Record, session, msgs: list[dict], ops: list, generate: bool, n_new: int,
               stops: tuple[str, ...]) -> dict | None:
        from kvsteward.serve.completions import stop_ids

        ranges = message_ranges_of(session.history)
        offset = session.n_logical
        for op in ops:  # ranges grow as appends happen (drops only refer to earlier messages)
            if op[0] == "append":
                ranges.append((offset, offset + len(op[2])))
                offset += len(op[2])
            apply_op(session, op, ranges, self.lock)
        if not generate:
            return None
        tok = self.engine.tokenizer
        gen_prompt = generation_prompt_ids(tok, msgs, rec.tools)
        check_context(self.engine, session, len(gen_prompt) + n_new)
        with self.lock:
            session.append(gen_prompt, kind="assistant", logits=None)
        dec = Decoder(session, tok, self.lock, n_new, stop_ids(self.engine), stops, append_last=True)
        text = dec.run()
        self._close_reply(session, msgs, rec.tools, gen_prompt, dec)
        self.metrics.generated_tokens.inc(len(dec.tokens))
        return {"role": "assistant", "content": text, "finish_reason": dec.finish_reason,
                "completion_tokens": len(dec.tokens)}

    def _close_reply(self, session, msgs: list[dict], tools, gen_prompt: list[int], dec: Decoder) -> None:
        """Append what the template puts after the reply (e.g. `<|im_end|>\\n`), so the next message starts on a
        well-formed turn boundary. The generated tokens stay as generated (a stop string's tokens included)."""
        tok = self.engine.tokenizer
        piece = message_pieces(tok, msgs + [{"role": "assistant", "content": dec.text}], tools, start=len(msgs))[0]
        piece_text = tok.decode(piece, skip_special_tokens=False)
        head = tok.decode(gen_prompt, skip_special_tokens=False) + dec.text
        if piece_text.startswith(head) and len(piece_text) > len(head):
            closing = tok.encode(piece_text[len(head):], add_special_tokens=False)
            if closing:
                with self.lock:
                    session.append(closing, kind="assistant", continue_message=True, logits=None)

    # -- memory bound -----------------------------------------------------------------------------------------------
    def _touch(self, rec: Record) -> None:
        rec.last_used = time.monotonic()
        self._unload_idle()
        self._publish()

    def _unload_idle(self) -> None:
        with self._guard:
            loaded = [r for r in self._records.values() if r.session is not None]
            total = sum(r.session.table.allocated_bytes() for r in loaded)
            for r in sorted(loaded, key=lambda r: r.last_used):
                if total <= self.max_bytes:
                    break
                if not r.lock.acquire(blocking=False):  # in use: never unload
                    continue
                try:
                    total -= r.session.table.allocated_bytes()
                    r.session = None
                    self.metrics.session_unloads.inc()
                finally:
                    r.lock.release()

    def _publish(self) -> None:
        with self._guard:
            loaded = [r for r in self._records.values() if r.session is not None]
            self.metrics.sessions_active.set(len(loaded))
            self.metrics.session_resident.set(sum(r.session.resident for r in loaded))
            self.metrics.sessions_known.set(len(self._known))
