"""Persistent sessions: one append-only JSONL log per session, every turn fsynced before it is acknowledged.

Log lines (`<data>/sessions/<id>.jsonl`):
    {"type": "create", "v": 1, "id", "created", "spec": {...}, "tools": [...] | null}
    {"type": "turn", "turn": k, "messages": [new messages, the generated reply included], "cache": {...},
     "ops": [the engine history entries this turn added], "reply": {...} | null}
    {"type": "aux", "turn": k, "pending": {...}}   an aux decision made after turn k-1, applied by turn k (if the
                                                   last line, it is pending: a restart applies it at the next turn)

A session is rebuilt by replaying the persisted engine ops in order (appends with their exact chunks and steps,
drops, repositions; evictions and renumbers happen again by themselves) — the same forwards in the same order, so
the state is the one acknowledged — and the rebuilt history must equal the persisted one op for op, or the rebuild
fails loudly. A torn last line (a kill during the write, never acknowledged) is cut off on load, and kept in
`<id>.jsonl.torn` next to the log; a log without a valid create record (empty, or its first line torn), or with an
unreadable line before its end, is listed but refused with `CorruptSession` (only DELETE works on it).

Ownership: the create record carries the session's `owner` (absent in older logs: None). Every access that names an
owner (`create`/`ids`/`acquire`/`delete`/`run_turn`) sees only that owner's sessions — another owner's session is
`SessionNotFound`, exactly like a missing one; owner None means no access control. The owners are indexed in memory
(read from each log's first line at startup, and on create): listing never parses a log.

Exactly-once turns: a turn sent with an idempotency key is persisted with the key, a digest of its request body and
the whole response, all in its one fsynced record. A retry with the same key (same session) returns that stored
response and appends nothing; the same key with another body is `IdempotencyConflict`. The turn record is written
once, after the reply is decoded, as a single line: a kill leaves either no record (the turn was never persisted:
the retry runs it, once) or the whole record with its answer (the retry gets the stored answer) — a persisted turn
has no missing answer to complete. A turn without a key behaves as before (a retry is a new turn).

Idle sessions beyond `max_bytes` of KV are unloaded LRU: their snapshot goes down the storage tiers (host memory →
local disk → Valkey, `serve/engine/tiers.py`) and comes back bit for bit on the next access; a tier copy is used only
if its op history equals the persisted one (else it is discarded), and without one the session is rebuilt from its log.

The aux memory manager (SideQuest, `serve/manager/`): a turn that appends the K-th, 2K-th, ... tool response of the
session forks it right after that tool message (and the cache ops that belong right after it), before the next
message or the reply — the training boundary of `synth/traces/hindsight.py` — and, once the turn is persisted, hands
the fork
to the aux worker, which decodes `{"del_cursors": [...]}` in idle time. The decision is applied at the start of the
session's next turn, as a drop of those tool messages before any of the turn's own ops, and persisted with that turn
(`"aux"` in the turn record, the drop among its `"ops"`): a restart replays it exactly. A decision still being
computed when the next turn arrives waits for the turn after (as SideQuest's main thread re-checks its aux thread at
every step); a boundary reached meanwhile forks nothing (one decision per session at a time).

The learned planner (`AuxConfig.plan`): the same aux run also decodes a `Planning mode` plan on the same boundary
state; a valid plan becomes the session's blueprint (the create-time blueprint plus one span per planned cursor: its
whole message, with its reader steps; it replaces the previous plan's spans) at the start of the next turn, before
the turn's ops — the same place as the aux drop. A blueprint is not an engine op (it only steers later evictions), so
the turn record carries the whole new blueprint (`"blueprint"`), and a rebuild installs it before replaying that
turn's ops: the same evictions happen again, checked op for op against the persisted history.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from kvsteward.serve.engine.blueprint import PlannedSpan, parse_blueprint
from kvsteward.serve.engine.ops import (
    ROLE_KIND,
    CacheSpec,
    OpsError,
    SessionSpec,
    build_ops,
    generation_prompt_ids,
    message_pieces,
    normalize_messages,
    parse_cache,
    resolve_blueprint,
    session_spec,
)
from kvsteward.serve.manager.planner import plan_blueprint
from kvsteward.serve.manager.thread import fork_point, open_cursors
from kvsteward.serve.manager.worker import AuxConfig, AuxJob, AuxWorker
from kvsteward.serve.server.completions import (
    TimedDecoder,
    check_cancel,
    check_context,
    max_new_tokens,
    run_op,
    stop_strings,
)
from kvsteward.serve.server.decode import Decoder

ID_RE = re.compile(r"^sess_[0-9a-f]{24}$")


class SessionNotFound(KeyError):
    pass


class RebuildError(RuntimeError):
    """A persisted history that does not replay to itself (a corrupt log or a nondeterministic engine)."""


class CorruptSession(RebuildError):
    """A session log that cannot be loaded at all: empty, no valid create record, or an unreadable line followed by
    more records (not a torn tail). The session stays listed; every access but DELETE raises this (API: 409)."""


class IdempotencyConflict(ValueError):
    """An idempotency key reused with a different request body (API: 409/422)."""

    def __init__(self, sid: str, key: str):
        super().__init__(f"idempotency key {key!r} was already used in session {sid} for a different request body")
        self.sid, self.key = sid, key


MAX_IDEMPOTENCY_KEY = 256


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

    @property
    def torn_path(self) -> Path:
        return self.path.with_name(self.path.name + ".torn")

    def read(self) -> list[dict]:
        """All complete records. A torn last line (a kill mid-write: never acknowledged) is cut off, after a copy of
        it is appended (fsynced) to `<log>.torn`; an unreadable line with records after it is not a torn tail but a
        corrupt log: `CorruptSession`, and the file is left as it is."""
        data = self.path.read_bytes()
        records, good = [], 0
        lines = data.splitlines(keepends=True)
        for i, line in enumerate(lines):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no line end")
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
                if i < len(lines) - 1:
                    raise CorruptSession(f"session log {self.path.name}: line {i + 1} is not a valid record ({e}) "
                                         f"and {len(lines) - 1 - i} more lines follow it: the log is corrupt, "
                                         f"not torn") from e
                break
            records.append(record)
            good += len(line)
        if good < len(data):
            self._cut(data, good)
        return records

    def _cut(self, data: bytes, good: int) -> None:
        """Keep the torn tail in `<log>.torn` (durably), then truncate the log to its last complete record."""
        with open(self.torn_path, "ab") as f:
            f.write(data[good:] + (b"" if data.endswith(b"\n") else b"\n"))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.path.parent)
        with open(self.path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())

    def head(self) -> dict | None:
        """The create record (the first line only; None if it is missing or not a complete create record)."""
        try:
            with open(self.path, "rb") as f:
                line = f.readline()
            record = json.loads(line) if line.endswith(b"\n") else None
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return record if isinstance(record, dict) and record.get("type") == "create" else None


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
    """Re-run persisted engine history entries on `session` (evict / renumber / rehydrate are re-derived by the
    session's own policy, not replayed)."""
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
        elif kind == "refresh" and "reader" not in op:  # (a reader-step refresh is re-derived by the session)
            session.refresh()
        elif kind not in ("evict", "renumber", "rehydrate", "refresh"):
            raise RebuildError(f"unknown op {kind!r} in the log")


def _turn_records(records: list[dict]) -> list[dict]:
    """The turn records of a log (after the create record; aux decision records are not turns)."""
    return [r for r in records[1:] if r.get("type") == "turn"]


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


def _history_key(history: list[dict]) -> str:
    return hashlib.sha256(json.dumps(history, separators=(",", ":")).encode()).hexdigest()  # = Session.history_key


def blueprint_json(spans) -> list[dict]:
    return [{"span": [s.start, s.end], "readers": list(s.readers)} for s in spans]


def _replayed_state(turns: list[dict]) -> tuple[list[dict], set[int], set[int], list[dict], tuple | None]:
    """Messages, dropped messages (client + aux), aux-dropped messages, engine history and blueprint (None: never
    changed by a plan) of persisted turns."""
    messages: list[dict] = []
    dropped: set[int] = set()
    aux_dropped: set[int] = set()
    expected: list[dict] = []
    blueprint = None
    for t in turns:
        expected.extend(t["ops"])
        messages.extend(t["messages"])
        for js in t["cache"].get("drop", {}).values():
            dropped.update(js)
        aux_dropped.update((t.get("aux") or {}).get("dropped", ()))
        if "blueprint" in t:
            blueprint = tuple(parse_blueprint(t["blueprint"]))
    return messages, dropped | aux_dropped, aux_dropped, expected, blueprint


def _idempotent_turns(turns: list[dict]) -> dict[str, dict]:
    """Key → {"key", "body" (request digest), "response"} of the persisted turns sent with an idempotency key."""
    return {t["idempotency"]["key"]: t["idempotency"] for t in turns if isinstance(t.get("idempotency"), dict)}


def body_digest(body: dict) -> str:
    """Digest of a turn's request body (canonical JSON: key order and spacing do not matter)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _check_key(key) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise OpsError(f"idempotency key must be a non-empty string of at most {MAX_IDEMPOTENCY_KEY} characters",
                       "idempotency_key")


def _without(cache: CacheSpec, gone: set[int]) -> CacheSpec:
    """The cache spec without drops of messages in `gone` (already dropped by the aux thread)."""
    if not gone or not any(j in gone for js in cache.drop.values() for j in js):
        return cache
    drop = {i: tuple(j for j in js if j not in gone) for i, js in cache.drop.items()}
    return CacheSpec(drop={i: js for i, js in drop.items() if js}, reposition=cache.reposition)


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
    aux_pending: dict | None = None  # an aux decision waiting for the next turn
    aux_job: AuxJob | None = None  # a fork handed to the aux worker, until its decision is delivered
    aux_dropped: set[int] = field(default_factory=set)  # messages dropped by applied aux decisions
    blueprint: tuple[PlannedSpan, ...] | None = None  # the session's blueprint now (None: the spec's, no plan yet)
    unloaded_key: str | None = None  # history key of the state snapshotted into the tiers at unload
    owner: str | None = None  # who may see it (None: anyone; sessions created without an owner, older logs)
    idempotent: dict[str, dict] = field(default_factory=dict)  # key → persisted {"key", "body", "response"}

    def describe(self) -> dict:
        s = self.session
        return {"id": self.id, "object": "session", "created": self.created, "config": self.spec.as_json(),
                "turns": self.turns, "n_messages": len(self.messages), "messages": self.messages,
                "dropped_messages": sorted(self.dropped), "aux_dropped_messages": sorted(self.aux_dropped),
                "aux_pending": self.aux_pending is not None, "blueprint": blueprint_json(self.current_blueprint()),
                "resident_tokens": s.resident, "n_logical": s.n_logical,
                "next_position": s.next_pos, "history_len": len(s.history), "history_key": s.history_key()}

    def current_blueprint(self) -> tuple[PlannedSpan, ...]:
        return self.spec.blueprint if self.blueprint is None else self.blueprint


class SessionStore:
    def __init__(self, root: Path, engine, defaults: SessionSpec, lock, metrics, max_bytes: int, limits,
                 aux: AuxConfig | None = None, tiers=None):
        """`lock`: the model lock (a `kvsteward.serve.manager.worker.Scheduler` when `aux` is given: main work has
        priority);
        `tiers`: a `kvsteward.serve.engine.tiers.SessionTiers` for unloaded sessions (None: unload = drop, rebuild)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.engine, self.defaults, self.lock, self.metrics = engine, defaults, lock, metrics
        self.max_bytes = max_bytes
        self.limits = limits
        self._records: dict[str, Record] = {}
        self._guard = threading.Lock()
        self.fingerprint = model_fingerprint(engine)
        self._owners: dict[str, str | None] = {}  # every known session (a log on disk) → its owner
        self._by_owner: dict[str | None, set[str]] = {}
        for path in self.root.glob("sess_*.jsonl"):
            if ID_RE.match(path.stem):  # the first line only; a log without a valid one: owner None
                self._index(path.stem, (SessionLog(path).head() or {}).get("owner"))
        self.metrics.sessions_known.set(len(self._owners))
        self.tiers = tiers
        self.aux = aux
        self.worker = None
        self.aux_forks, self.aux_fork_seconds, self.aux_fork_seconds_max = 0, 0.0, 0.0  # the forks' main-turn cost
        self.plan_metrics = self.metrics.aux_plan if aux is not None and aux.plan else None
        if aux is not None:
            if not hasattr(lock, "aux_step"):
                raise ValueError("the aux worker needs a Scheduler as the model lock")
            self.worker = AuxWorker(engine.tokenizer, lock, aux, self, metrics)
            self.worker.warm()

    def main(self):
        """Context of one main request (the aux worker starts no forward meanwhile)."""
        return self.lock.main() if hasattr(self.lock, "main") else nullcontext()

    def run_turn(self, sid: str, body: dict, owner: str | None = None, idempotency_key: str | None = None,
                 cancel: threading.Event | None = None) -> dict:
        """A whole main turn: acquire (restore if needed), turn, release. With `idempotency_key`: exactly once — a
        retry of a persisted turn with the same key returns its stored response and appends nothing. `cancel`: set
        when the client has gone; the turn stops at its next prefill chunk or decode step (`Cancelled`), persists
        nothing, and the session is rebuilt from its log on next use."""
        if idempotency_key is not None:
            _check_key(idempotency_key)
        with self.main():
            rec = self.acquire(sid, owner=owner)  # loaded: its key index is the log's
            try:
                return self.turn(rec, body, idempotency_key=idempotency_key, cancel=cancel)
            finally:
                self.release(rec)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def create(self, body: dict, owner: str | None = None) -> Record:
        blueprint = resolve_blueprint(body.get("blueprint"), None)
        spec = session_spec(self.engine, self.defaults, body.get("policy"), body.get("budget"), body.get("limit"),
                            blueprint)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise OpsError("tools must be a list of tool definitions", "tools")
        sid = "sess_" + uuid.uuid4().hex[:24]
        if owner is not None and not isinstance(owner, str):
            raise TypeError("owner must be a string or None")
        rec = Record(sid, spec, tools, int(time.time()), SessionLog(self.root / f"{sid}.jsonl"), owner=owner)
        rec.log.append({"type": "create", "v": 1, "id": sid, "created": rec.created, "spec": spec.as_json(),
                        "tools": tools, "model": self.fingerprint, "owner": owner})
        rec.session = spec.new_session(self.engine)
        with self._guard:
            self._records[sid] = rec
            self._index(sid, owner)
        self._touch(rec)
        return rec

    def _index(self, sid: str, owner: str | None) -> None:
        self._owners[sid] = owner
        self._by_owner.setdefault(owner, set()).add(sid)

    def _unindex(self, sid: str) -> None:
        owner = self._owners.pop(sid, None)
        ids = self._by_owner.get(owner)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del self._by_owner[owner]

    def ids(self, owner: str | None = None) -> list[str]:
        """Known session ids (corrupt logs included); with `owner`, only that owner's (from the in-memory index)."""
        with self._guard:
            return sorted(self._owners if owner is None else self._by_owner.get(owner, ()))

    def _visible(self, sid: str, owner: str | None) -> bool:
        """Known, and `owner`'s (or no access control); the caller holds the guard."""
        return sid in self._owners and (owner is None or self._owners[sid] == owner)

    def acquire(self, sid: str, load: bool = True, owner: str | None = None) -> Record:
        """The session's record, loaded (rebuilt from its log if needed); the caller holds `rec.lock`. Another
        owner's session is `SessionNotFound`; a log that cannot be loaded at all is `CorruptSession`."""
        if not ID_RE.match(sid):
            raise SessionNotFound(sid)
        with self._guard:
            if not self._visible(sid, owner):
                raise SessionNotFound(sid)
            rec = self._records.get(sid)
            if rec is None:
                rec = self._load_record(sid)
                self._records[sid] = rec
        rec.lock.acquire()
        if rec.deleted:
            rec.lock.release()
            raise SessionNotFound(sid)
        try:
            if load and rec.session is None:
                self._restore(rec)
        except BaseException:
            rec.lock.release()
            raise
        return rec

    def release(self, rec: Record) -> None:
        rec.lock.release()
        self._touch(rec)

    def delete(self, sid: str, owner: str | None = None) -> None:
        """Remove the session, its log (and a torn tail kept next to it) and its tier copies. Works on a log that
        cannot be loaded (corrupt, or from another model) too: that is how such a session goes away."""
        try:
            rec = self.acquire(sid, load=False, owner=owner)
        except RebuildError:  # CorruptSession included: never loaded, so no record and nothing else to release
            with self._guard:
                if not self._visible(sid, owner) or sid in self._records:
                    raise
                self._remove_files(sid)
                self._unindex(sid)
            self._publish()
            return
        try:
            self._remove_files(sid)
            rec.deleted, rec.session, rec.aux_pending, rec.aux_job = True, None, None, None
            with self._guard:
                self._records.pop(sid, None)
                self._unindex(sid)
        finally:
            rec.lock.release()
        self._publish()

    def _remove_files(self, sid: str) -> None:
        log = SessionLog(self.root / f"{sid}.jsonl")
        log.path.unlink(missing_ok=True)
        log.torn_path.unlink(missing_ok=True)
        _fsync_dir(self.root)
        if self.tiers is not None:
            self.tiers.discard(sid)

    # -- loading ----------------------------------------------------------------------------------------------------
    def _load_record(self, sid: str) -> Record:
        log = SessionLog(self.root / f"{sid}.jsonl")
        try:
            records = log.read()
        except FileNotFoundError as e:
            raise CorruptSession(f"session {sid}: its log {log.path.name} is gone") from e
        except CorruptSession as e:
            raise CorruptSession(f"session {sid}: {e}") from e
        if not records:
            raise CorruptSession(f"session {sid}: its log is empty (no create record: the create was never "
                                 f"acknowledged); delete it")
        head = records[0]
        if head.get("type") != "create":
            raise CorruptSession(f"session {sid}: its log does not start with a create record; delete it")
        if head.get("model") != self.fingerprint:
            raise RebuildError(f"session {sid} was created with model {head.get('model')}; this server runs "
                               f"{self.fingerprint}: its history would replay to a different state")
        try:
            s = head["spec"]
            spec = SessionSpec(policy=s["policy"], budget=s["budget"], limit=s["limit"], chunk=s["chunk"],
                               blueprint=resolve_blueprint(s["blueprint"], None))
            created = int(head["created"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSession(f"session {sid}: its create record is invalid ({type(e).__name__}: {e}); "
                                 f"delete it") from e
        turns = _turn_records(records)
        rec = Record(sid, spec, head.get("tools"), created, log, pending=turns, owner=head.get("owner"))
        last = records[-1]
        if last.get("type") == "aux" and last.get("turn") == len(turns):  # decided, not yet applied by a turn
            rec.aux_pending = last["pending"]
        return rec

    def _restore(self, rec: Record) -> None:
        """Load the session: from the highest storage tier holding a state whose op history is the persisted one,
        else by replaying the log."""
        turns = rec.pending
        expected_key = rec.unloaded_key
        rec.unloaded_key = None
        if self.tiers is not None:
            blueprint = rec.blueprint
            if turns is not None:  # first load in this process: the log says what the state must be
                expected_key = _history_key([op for t in turns for op in t["ops"]])
                blueprint = _replayed_state(turns)[4]
            config = rec.spec.new_session(self.engine).config
            if blueprint is not None:  # a planned blueprint is session state the snapshot does not carry
                config.blueprint = list(blueprint)
            got = self.tiers.take(rec.id, self.engine, config)
            if got is not None:
                if expected_key is not None and got.session.history_key() == expected_key:
                    if turns is not None:
                        rec.messages, rec.dropped, rec.aux_dropped, _, rec.blueprint = _replayed_state(turns)
                        rec.turns, rec.pending = len(turns), None
                        rec.idempotent = _idempotent_turns(turns)
                    rec.session = got.session
                    self.metrics.tier_restores.labels(got.tier).inc()
                    self.metrics.tier_restore_seconds.labels(got.tier).observe(got.seconds)
                    self._publish()
                    return
                self.metrics.tier_stale.inc()
        self._rebuild(rec)

    def _rebuild(self, rec: Record) -> None:
        t0 = time.perf_counter()
        turns = rec.pending
        if turns is None:
            turns = _turn_records(rec.log.read())
        session = rec.spec.new_session(self.engine)
        for t in turns:
            try:
                if "blueprint" in t:  # a plan installed at this turn, before its ops (as the live turn did)
                    session.config.blueprint = list(parse_blueprint(t["blueprint"]))
                with self.lock:  # hold the engine for a whole turn: replay is a burst of forwards
                    replay(session, t["ops"])
            except (ValueError, KeyError, TypeError) as e:  # CacheOpError included: a log the engine refuses
                raise RebuildError(f"session {rec.id}: turn {t.get('turn')} does not replay: {e}") from e
        messages, dropped, aux_dropped, expected, blueprint = _replayed_state(turns)
        if session.history != expected:
            at = next((i for i, (a, b) in enumerate(zip(session.history, expected, strict=False)) if a != b),
                      min(len(session.history), len(expected)))
            raise RebuildError(f"session {rec.id}: replay diverged from the persisted history at op {at}")
        rec.session, rec.messages, rec.dropped, rec.turns = session, messages, dropped, len(turns)
        rec.aux_dropped, rec.blueprint = aux_dropped, blueprint
        rec.idempotent = _idempotent_turns(turns)
        rec.pending = None
        self.metrics.rebuild_seconds.observe(time.perf_counter() - t0)
        self._publish()

    # -- a turn -----------------------------------------------------------------------------------------------------
    def turn(self, rec: Record, body: dict, idempotency_key: str | None = None,
             cancel: threading.Event | None = None) -> dict:
        """Append new messages (+ their cache ops), optionally generate a reply, persist, then answer. With
        `idempotency_key`: if a persisted turn of this session carries it, return its stored response (nothing is
        appended; `IdempotencyConflict` if its request body differs); else the turn is persisted with the key, the
        body's digest and the response, in its one record."""
        digest = None
        if idempotency_key is not None:
            _check_key(idempotency_key)
            digest = body_digest(body)
            done = rec.idempotent.get(idempotency_key)
            if done is not None:
                if done["body"] != digest:
                    raise IdempotencyConflict(rec.id, idempotency_key)
                return copy.deepcopy(done["response"])
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
        # a client that drops a message the aux thread already dropped is not refused: that drop is a no-op
        cache = parse_cache(body.get("cache"), len(msgs), first=n_old, dropped=frozenset(rec.dropped - rec.aux_dropped))
        cache = _without(cache, rec.aux_dropped)
        ops = build_ops(pieces, [ROLE_KIND[m["role"]] for m in new], cache, first=n_old)
        aux, aux_msgs = rec.aux_pending, []
        if aux is not None:  # the aux decision runs first: "after the main thread's (previous) turn"
            client = {j for js in cache.drop.values() for j in js}
            aux_msgs = sorted(c for c in aux["del_cursors"] if c < n_old and c not in rec.dropped and c not in client)
            if aux_msgs:
                ops = [("drop", tuple(aux_msgs)), *ops]
        session = rec.session
        planned, blueprint = None, None  # a valid aux plan: its spans, and the session's blueprint with them
        if aux is not None and (aux.get("plan") or {}).get("plan") is not None:
            planned = tuple(plan_blueprint(aux["plan"]["plan"], message_ranges_of(session.history)))
            blueprint = rec.spec.blueprint + planned
        fork_at = None  # the aux fork: right after this message (a tool response at a boundary)
        if self.worker is not None and rec.aux_job is None:
            fork_at = fork_point(msgs, n_old, self.aux.every)
        aux_gone = rec.dropped | set(aux_msgs)
        n_new, stops = 0, ()
        if generate:
            n_new = max_new_tokens(body.get("max_completion_tokens", body.get("max_tokens")), self.limits)
            stops = stop_strings(body.get("stop"))
        self._check_room(rec, session, msgs, ops, generate, n_new)
        h0 = len(session.history)
        job = None

        def take_fork() -> None:  # called by _apply when the ops of messages <= fork_at have run
            nonlocal job
            gone = aux_gone | {j for i, js in cache.drop.items() if i <= fork_at for j in js}
            open_c = open_cursors(msgs[: fork_at + 1], gone)
            if open_c:
                job = self._fork(rec, session, msgs[: fork_at + 1], open_c)

        try:
            if blueprint is not None:  # installed before any of the turn's ops (new list: forks keep theirs)
                session.config.blueprint = list(blueprint)
            reply = self._apply(rec, session, msgs, ops, generate, n_new, stops,
                                None if fork_at is None else (fork_at - n_old, take_fork), cancel)
            new_messages = new + ([{"role": "assistant", "content": reply["content"]}] if reply else [])
            record = {"type": "turn", "turn": rec.turns, "messages": new_messages, "cache": cache.as_json(),
                      "ops": session.history[h0:], "reply": reply}
            if aux is not None:
                record["aux"] = {**aux, "dropped": aux_msgs}
            if blueprint is not None:
                record["blueprint"] = blueprint_json(blueprint)
            response = {"id": rec.id, "object": "session.turn", "turn": rec.turns,
                        "n_messages": n_old + len(new_messages), "reply": reply,
                        "resident_tokens": session.resident, "n_logical": session.n_logical,
                        "next_position": session.next_pos, "history_len": len(session.history),
                        "history_key": session.history_key(), "persisted": True,
                        "aux": None if aux is None else {**aux, "dropped": aux_msgs}}
            if idempotency_key is not None:  # the answer is in the same fsynced line: persisted turn = answered turn
                response = json.loads(json.dumps(response))  # as a retry will read it back
                record["idempotency"] = {"key": idempotency_key, "body": digest, "response": response}
            rec.log.append(record)
        except BaseException:
            rec.session = None  # partly applied and never persisted: rebuild from the log on next use
            raise  # (a pending aux decision stays pending)
        self.metrics.persisted_turns.inc()
        rec.messages = msgs + new_messages[len(new):]
        rec.dropped.update(j for js in cache.drop.values() for j in js)
        if aux is not None:
            rec.aux_pending = None
            rec.dropped.update(aux_msgs)
            rec.aux_dropped.update(aux_msgs)
            self.metrics.aux_deleted.inc(len(aux_msgs))
        if blueprint is not None:
            rec.blueprint = blueprint
            if self.plan_metrics is not None:
                self.plan_metrics.spans.inc(len(planned))
        rec.turns += 1
        if idempotency_key is not None:
            rec.idempotent[idempotency_key] = copy.deepcopy(record["idempotency"])
        if job is not None:  # forked in this (now persisted) turn
            rec.aux_job = job
            self.worker.submit(rec.id)  # decodes once this request is answered (main work has priority)
        return response

    # -- the aux worker's side --------------------------------------------------------------------------------------
    def _fork(self, rec: Record, session, messages: list[dict], open_c: list[int]) -> AuxJob:
        """The aux fork, inside the main turn (under the session lock; no forward, so no model lock): a shared fork
        that reads the main K/V rows in place (`SlotTable.share`: only per-slot metadata is copied). While the fork
        lives, the main session's next compaction writes fresh buffers instead of its own (copy-on-write)."""
        t0 = time.perf_counter()
        fork = session.fork(shared=True)  # the main session is never written
        fork.config.use_adapter = self.aux.use_adapter
        seconds = time.perf_counter() - t0
        self.aux_forks += 1
        self.aux_fork_seconds += seconds
        self.aux_fork_seconds_max = max(self.aux_fork_seconds_max, seconds)
        return AuxJob(fork, list(messages), open_c, rec.turns, fork_s=seconds)  # fork_key: by the worker

    def aux_take(self, sid: str) -> AuxJob | None:
        """Called by the aux worker: the fork a turn of the session handed over (None: deleted, or nothing)."""
        with self._guard:
            rec = self._records.get(sid)
        job = None if rec is None or rec.deleted else rec.aux_job
        if job is not None and not job.fork_key:
            job.fork_key = job.fork.history_key()  # before the trigger: what the manager sees (off the main turn)
        return job

    def aux_deliver(self, sid: str, job: AuxJob, decision, seconds: float) -> None:
        """The decision (None: none, the run failed or stopped), to be applied at the session's next turn."""
        plan = None if decision is None else decision.plan
        if decision is not None:
            self.metrics.aux_decisions.inc()
            self.metrics.aux_seconds.observe(seconds)
        if plan is not None and self.plan_metrics is not None:
            self.plan_metrics.decisions.inc()
            self.plan_metrics.parse_failures.inc(plan.plan is None)
        with self._guard:
            rec = self._records.get(sid)
        if rec is None:
            return
        with rec.lock:  # the worker holds no model lock here: waiting for a turn to finish is safe
            if rec.aux_job is job:
                rec.aux_job = None
            if rec.deleted or decision is None:
                return
            rec.aux_pending = {"fork_turn": job.turn, "boundary": len(job.messages), "fork_key": job.fork_key,
                               "open_cursors": job.open_cursors, "del_cursors": decision.del_cursors,
                               "text": decision.text, "truncated": decision.truncated,
                               "fork_s": round(job.fork_s, 6), "seconds": round(seconds, 6)}
            if decision.confidence is not None:  # the confidence rule's evidence: P(listed) per deletable id
                rec.aux_pending["confidence"] = {str(c): round(p, 6) for c, p in decision.confidence.items()}
            if plan is not None:
                rec.aux_pending["plan"] = plan.as_json()
            # persisted (fsynced) before anyone can see it: a kill -9 now still applies it at the next turn
            rec.log.append({"type": "aux", "turn": rec.turns, "pending": rec.aux_pending})

    def _check_room(self, rec: Record, session, msgs: list[dict], ops: list, generate: bool, n_new: int) -> None:
        """Refuse, before any forward, a turn whose tokens cannot fit the model's positions. Exact for a turn
        without a reposition (drops do not give positions back); one that repositions is checked after its ops, as
        it applies them (`_apply`)."""
        if any(op[0] == "reposition" for op in ops):
            return
        n = sum(len(op[2]) for op in ops if op[0] == "append")
        if generate:
            n += len(generation_prompt_ids(self.engine.tokenizer, msgs, rec.tools)) + n_new
        check_context(self.engine, session, n)

    def _apply(self, rec: Record, session, msgs: list[dict], ops: list, generate: bool, n_new: int,
               stops: tuple[str, ...], fork: tuple | None = None,
               cancel: threading.Event | None = None) -> dict | None:
        """Run the ops, then the reply. `fork`: (k, callback) — call it once the ops of the turn's k-th new message
        (0-based, the ops that belong right after it included) have run, before the next append or the reply."""
        from kvsteward.serve.server.completions import stop_ids

        ranges = message_ranges_of(session.history)
        offset = session.n_logical
        appended = 0
        for op in ops:  # ranges grow as appends happen (drops only refer to earlier messages)
            if op[0] == "append":
                if fork is not None and appended > fork[0]:
                    fork[1]()
                    fork = None
                ranges.append((offset, offset + len(op[2])))
                offset += len(op[2])
                appended += 1
            run_op(session, op, ranges, self.lock, cancel)
        if fork is not None:
            fork[1]()
        if not generate:
            return None
        tok = self.engine.tokenizer
        gen_prompt = generation_prompt_ids(tok, msgs, rec.tools)
        check_context(self.engine, session, len(gen_prompt) + n_new)
        with self.lock:
            session.append(gen_prompt, kind="assistant", logits=None)
        timeout = self.limits.request_timeout  # counted from the reply's start: the turn's ops ran before it
        check_cancel(cancel)
        dec = TimedDecoder(session, tok, self.lock, n_new, stop_ids(self.engine), stops, append_last=True,
                           deadline=None if timeout is None else time.monotonic() + timeout, cancel=cancel)
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
        victims = []
        with self._guard:
            loaded = [r for r in self._records.values() if r.session is not None]
            total = sum(r.session.table.allocated_bytes() for r in loaded)
            for r in sorted(loaded, key=lambda r: r.last_used):
                if total <= self.max_bytes:
                    break
                if not r.lock.acquire(blocking=False):  # in use: never unload
                    continue
                if r.session is None:
                    r.lock.release()
                    continue
                total -= r.session.table.allocated_bytes()
                victims.append(r)
        for r in victims:  # snapshots outside the guard, each under its session's lock
            try:
                if self.tiers is not None:
                    self.tiers.put(r.id, r.session)
                    r.unloaded_key = r.session.history_key()
                r.session = None
                self.metrics.session_unloads.inc()
            finally:
                r.lock.release()

    def _publish(self) -> None:
        with self._guard:
            loaded = [r for r in self._records.values() if r.session is not None]
            self.metrics.sessions_active.set(len(loaded))
            self.metrics.session_resident.set(sum(r.session.resident for r in loaded))
            self.metrics.sessions_known.set(len(self._owners))
