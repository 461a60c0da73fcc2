"""The auxiliary memory-management thread (SideQuest): the model itself decides which tool responses are stale.

At a *boundary* — right after every K-th tool response, the moment `synth/hindsight.py` trains the manager on — fork
the main session (the fork reads the main KV; the main session is never written), append the trigger message
`Memory management mode` and the assistant opener, then greedy-decode `{"del_cursors": [...]}` under a constraint
that admits only open cursor ids (no repeats) — so the output always parses. The caller applies the deletion to the
main session as a `drop` at its next turn. The aux tokens never enter the main context.

The constraint is a character-level automaton over the tail after the forced `{"del_cursors": [` prefix; at each step
only vocabulary tokens made of `0-9 , ] }` and space are candidates (a few hundred), each checked against it.

In the server (`SessionStore` with an `AuxConfig`): the store takes the fork inside the main turn, right after the
boundary's tool message was appended and before the reply is generated (`fork_point`), and hands it to `AuxWorker`,
one background thread that runs `aux_steps` — the same decode as `run_aux`, cut into steps of at most one forward —
under `Scheduler`, the model lock with priorities (main requests first; the aux takes the lock only while no request
is in progress, per step), so a request arriving mid-decode waits for at most one aux forward.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvsteward.serve.session import Session
from kvsteward.synth.chat import generation_prompt, message_texts

TRIGGER = "Memory management mode"
PREFIX = '{"del_cursors": ['
_ALPHABET = set("0123456789, ]}")


def valid_tail(tail: str, open_ids: frozenset[int]) -> tuple[bool, bool]:
    """(prefix of a valid tail?, complete?) for the language `ID (", " ID)* "]}"` | `"]}"` over unused open ids."""
    used: set[int] = set()
    i, n = 0, len(tail)
    expect_id = True
    first = True
    while i < n:
        if expect_id:
            if first and tail[i] == "]":
                return _end(tail[i:])
            j = i
            while j < n and tail[j].isdigit():
                j += 1
            digits = tail[i:j]
            if not digits:
                return False, False
            if j == n:  # an id still being typed: some unused open id must start with it
                return any(str(c).startswith(digits) and c not in used for c in open_ids), False
            if digits.startswith("0") and digits != "0" or int(digits) not in open_ids or int(digits) in used:
                return False, False
            used.add(int(digits))
            i, expect_id, first = j, False, False
        else:
            rest = tail[i:]
            if rest.startswith("]"):
                return _end(rest)
            if len(used) == len(open_ids):  # no id left to list: a separator would be a dead end
                return False, False
            if ", ".startswith(rest):
                return True, False
            if not rest.startswith(", "):
                return False, False
            i += 2
            expect_id = True
    return True, False


def _end(rest: str) -> tuple[bool, bool]:
    return ("]}".startswith(rest) or rest == "]}"), rest == "]}"


@lru_cache(maxsize=4)
def _candidates(tokenizer) -> tuple[list[int], list[str]]:
    ids, texts = [], []
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if text and set(text) <= _ALPHABET:
            ids.append(tid)
            texts.append(text)
    return ids, texts


@dataclass
class AuxDecision:
    del_cursors: list[int]
    text: str
    tokens: int
    truncated: bool = False  # the token budget ran out before the list closed; completed ids are kept


def constrained_del_cursors(session: Session, tokenizer, open_ids: list[int], max_tokens: int = 64) -> AuxDecision:
    """Greedy decode of the deletion list on `session` (already holding trigger + opener), constrained to open ids."""
    return drive(_constrained_steps(session, tokenizer, open_ids, max_tokens))


def drive(steps: Generator[None, None, AuxDecision]) -> AuxDecision:
    """Run a step generator to its end (no scheduling): its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _constrained_steps(session: Session, tokenizer, open_ids: list[int],
                       max_tokens: int) -> Generator[None, None, AuxDecision]:
    """`constrained_del_cursors` as a generator: every resumption runs at most one model forward."""
    allowed = frozenset(open_ids)
    cand_ids, cand_texts = _candidates(tokenizer)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    session.append(tokenizer.encode(PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
    yield
    tail, used_tokens = "", 0
    for used_tokens in range(1, max_tokens + 1):  # noqa: B007 (the count is reported)
        logits = session.last_logits[cand]
        order = torch.argsort(logits, descending=True).tolist()
        for k in order:
            ok, done = valid_tail(tail + cand_texts[k], allowed)
            if ok:
                break
        else:  # cannot happen: "]" alone is always a valid continuation somewhere
            raise RuntimeError(f"no valid continuation after {tail!r}")
        tail += cand_texts[k]
        if done:
            break
        session.append([cand_ids[k]], kind="assistant", continue_message=True, logits="last")
        yield
    else:
        tail = _close(tail)
        text = PREFIX + tail
        return AuxDecision(sorted(json.loads(text)["del_cursors"]), text, used_tokens, truncated=True)
    text = PREFIX + tail
    return AuxDecision(sorted(json.loads(text)["del_cursors"]), text, used_tokens)


def _close(tail: str) -> str:
    """Budget exhausted mid-list: keep the ids already closed by a separator and close the JSON."""
    return ", ".join(re.findall(r"(\d+)(?=, |\])", tail)) + "]}"


def open_cursors(messages: list[dict], dropped) -> list[int]:
    """Cursor ids still in the context: the indices of tool messages not dropped (the synth convention: a tool
    response is tagged `[cursor N]` with N its own message index, so an id names the span a drop removes)."""
    return [i for i, m in enumerate(messages) if m.get("role") == "tool" and i not in dropped]


def fork_point(messages: list[dict], first: int, every: int) -> int | None:
    """Where a turn that appends `messages[first:]` forks the aux thread: the index t of the last new tool message
    that is the K-th, 2K-th, ... tool response of the session (`every` = K, counting every tool message, dropped ones
    included), or None. The fork is the state right after message t (and the cache ops that belong right after it),
    before the next message or the reply: exactly `synth.hindsight.boundaries(trace, K)`'s boundary t + 1. A turn
    that crosses two multiples of K forks once, at the later one."""
    if every < 1:
        raise ValueError(f"aux every K must be >= 1, got {every}")
    count = sum(m.get("role") == "tool" for m in messages[:first])
    out = None
    for i in range(first, len(messages)):
        if messages[i].get("role") == "tool":
            count += 1
            if count % every == 0:
                out = i
    return out


def aux_steps(fork: Session, tokenizer, messages: list[dict], open_cursors: list[int],
              max_tokens: int = 64) -> Generator[None, None, AuxDecision]:
    """The aux thread on `fork` (a fork of the main session, adapter set by the caller) as a generator of steps:
    every resumption runs at most one model forward (trigger prefill, the forced opener, then one decoded token), so
    a scheduler can take the model lock per step and yield to main work in between. Returns the decision."""
    history = messages + [{"role": "user", "content": TRIGGER}]
    trigger_text = message_texts(tokenizer, history)[-1] + generation_prompt(tokenizer, history)
    fork.append(tokenizer.encode(trigger_text, add_special_tokens=False), kind="user", logits="last")
    yield
    return (yield from _constrained_steps(fork, tokenizer, open_cursors, max_tokens))


def run_aux(main: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
            use_adapter: bool = True) -> AuxDecision:
    """Fork the main session, append the trigger (a user message) and the assistant opener, decode the deletion."""
    if not open_cursors:
        return AuxDecision([], PREFIX + "]}", 0)
    fork = main.fork()
    fork.config.use_adapter = use_adapter
    return drive(aux_steps(fork, tokenizer, messages, open_cursors, max_tokens))


# -- the server's aux worker ----------------------------------------------------------------------------------------
class Scheduler:
    """The model lock of a server, with priorities: main work first, the aux worker only in idle time.

    `with sched:` takes the lock for one main forward (it is the lock the serving code has always used). Main work
    (a request, from its start to its answer) is registered with `sched.main()`; while any is registered the aux
    worker starts no forward (`aux_step` waits), so a main request is delayed by at most the one aux forward already
    running when it arrived. The model is one: the lock serializes every forward, which also makes the global PEFT
    adapter toggle (on only inside an aux forward) safe.
    """

    def __init__(self, trace: bool = False):
        self._cond = threading.Condition()
        self._held = False
        self._main = 0
        self.events: list[tuple[str, float, float]] | None = [] if trace else None  # (who, start, end) per hold

    # main side
    def __enter__(self):
        with self._cond:
            while self._held:
                self._cond.wait()
            self._held = True
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._release("main")

    def _release(self, who: str) -> None:
        if self.events is not None:
            self.events.append((who, self._t0, time.perf_counter()))
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def begin_main(self) -> None:
        with self._cond:
            self._main += 1

    def end_main(self) -> None:
        with self._cond:
            self._main -= 1
            self._cond.notify_all()

    @contextmanager
    def main(self):
        """A main request in progress (re-entrant: a counter)."""
        self.begin_main()
        try:
            yield
        finally:
            self.end_main()

    @property
    def main_active(self) -> int:
        return self._main

    def quiesce(self) -> None:
        """Wait until no forward runs (take and release the lock as main): the in-flight aux step has ended."""
        with self:
            pass

    # aux side
    @contextmanager
    def aux_step(self):
        """Hold the lock for one aux step, taken only while no main work is registered; yields whether it had to
        wait for main work first (a preemption)."""
        waited = False
        with self._cond:
            while self._held or self._main:
                waited = waited or self._main > 0
                self._cond.wait()
            self._held = True
        self._t0 = time.perf_counter()
        try:
            yield waited
        finally:
            self._release("aux")


@dataclass
class AuxConfig:
    every: int = 4  # fork right after every K-th tool response of a session (`fork_point`)
    max_tokens: int = 48  # decode budget of one `{"del_cursors": [...]}`
    use_adapter: bool = True  # False: the base model is the manager (testing, or no adapter trained yet)

    def validate(self) -> None:
        if self.every < 1:
            raise ValueError(f"aux every K must be >= 1, got {self.every}")
        if self.max_tokens < 1:
            raise ValueError(f"aux max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class AuxJob:
    """A fork taken by the store inside a main turn, at a boundary, and the context it was taken in."""

    fork: Session  # the main state right after the boundary's tool message (use_adapter already set)
    messages: list[dict]  # the session's messages up to and including that tool message
    open_cursors: list[int]  # tool messages among them not dropped at the fork point
    turn: int  # the index of the turn the fork was taken in
    fork_key: str = ""  # the fork's history key before the trigger (what the manager saw), set by `aux_take`
    fork_s: float = 0.0  # what taking the fork cost the main turn


class AuxWorker:
    """One background thread running the aux memory manager for the sessions of a store, step by step under the
    scheduler. The store supplies `aux_take(sid)` (the AuxJob it forked, or None) and
    `aux_deliver(sid, job, decision | None, seconds)` (None: no decision, the job is abandoned); the decision is
    applied by the store at the session's next turn.
    """

    def __init__(self, tokenizer, sched: Scheduler, config: AuxConfig, store, metrics=None):
        config.validate()
        self.tokenizer, self.sched, self.config, self.store, self.metrics = tokenizer, sched, config, store, metrics
        self._cond = threading.Condition()
        self._jobs: deque[str] = deque()
        self._queued: set[str] = set()
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.step_hook: Callable[[str, int], None] | None = None  # tests: called between steps (no lock held)
        self.errors: list[BaseException] = []

    def warm(self) -> None:
        """The constrained decoder's candidate table (a scan of the vocabulary): built once, before serving."""
        _candidates(self.tokenizer)

    def submit(self, sid: str) -> None:
        with self._cond:
            if self._stop or sid in self._queued:
                return
            self._queued.add(sid)
            self._jobs.append(sid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvsteward-aux", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._jobs.clear()
            self._queued.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                sid = self._jobs.popleft()
                self._busy = True
            try:
                self._run(sid)
            except Exception as e:  # never kill the worker: the session just gets no decision this time
                self.errors.append(e)
                if self.metrics is not None:
                    self.metrics.aux_errors.inc()
            finally:
                with self._cond:
                    self._busy = False
                    self._queued.discard(sid)
                    self._cond.notify_all()

    def _run(self, sid: str) -> None:
        t0 = time.perf_counter()
        job = self.store.aux_take(sid)  # forked by the main turn already: no model lock, no session lock needed
        if job is None:
            return
        decision = None
        try:
            if self._stop:
                return
            steps = aux_steps(job.fork, self.tokenizer, job.messages, job.open_cursors, self.config.max_tokens)
            k = 0
            while True:
                if self.step_hook is not None:
                    self.step_hook(sid, k)
                if self._stop:
                    return
                with self.sched.aux_step() as waited:
                    if waited and self.metrics is not None:
                        self.metrics.aux_preemptions.inc()
                    try:
                        next(steps)
                    except StopIteration as stop:
                        decision = stop.value
                        break
                k += 1
        finally:  # a decision, or None (an error or a shutdown): either way the session may fork again
            self.store.aux_deliver(sid, job, decision, time.perf_counter() - t0)
