"""The server's aux worker: one background thread running the aux decisions step by step, main requests first.

In the server (`SessionStore` with an `AuxConfig`): the store takes the fork inside the main turn, right after the
boundary's tool message was appended and before the reply is generated (`manager.thread.fork_point`), and hands it to
`AuxWorker`, one background thread that runs `aux_steps` — the same decode as `run_aux`, cut into steps of at most one
forward — under `Scheduler`, the model lock with priorities (main requests first; the aux takes the lock only while no
request is in progress, per step), so a request arriving mid-decode waits for at most one aux forward.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass

from kvsteward.serve.engine.session import Session
from kvsteward.serve.manager.decode import _candidates, check_close_bias, check_min_confidence
from kvsteward.serve.manager.planner import _PLAN_ALPHABET, check_plan, plan_steps
from kvsteward.serve.manager.rule import RuleManager
from kvsteward.serve.manager.stack import StackManager
from kvsteward.serve.manager.thread import aux_steps


class Scheduler:
    """The model lock of a server, with priorities: main work first, the aux worker only in idle time.

    `with sched:` takes the lock for one main forward (it is the lock the serving code has always used). Main work
    (a request, from its start to its answer) is registered with `sched.main()`; while any is registered the aux
    worker starts no forward (`aux_step` waits), so a main request is delayed by at most the one aux forward already
    running when it arrived. The model is one: the lock serializes every forward, which also makes the global PEFT
    adapter toggle (on only inside an aux forward) safe.

    Under traffic that never pauses the aux thread would never run. `max_aux_wait` (seconds, None = never) bounds
    that: an aux step that has waited that long for main work takes the lock at the end of the current main forward
    (main forwards queued after it wait for that one aux forward), then waits again from zero. So the aux gets at
    least one forward per `max_aux_wait` seconds, and main work pays at most one aux forward per `max_aux_wait`.
    """

    def __init__(self, trace: bool = False, max_aux_wait: float | None = None):
        if max_aux_wait is not None and max_aux_wait < 0:
            raise ValueError(f"max_aux_wait must be >= 0 seconds, got {max_aux_wait}")
        self._cond = threading.Condition()
        self._held = False
        self._main = 0
        self._aux_due = False  # a starved aux step is next in line for the lock
        self.max_aux_wait = max_aux_wait
        self.starved_steps = 0  # aux steps that ran while main work was registered (starvation bound hit)
        self.events: list[tuple[str, float, float]] | None = [] if trace else None  # (who, start, end) per hold

    # main side
    def __enter__(self):
        with self._cond:
            while self._held or self._aux_due:
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
        start = time.monotonic()
        with self._cond:
            while self._held or (self._main and not self._aux_due):
                waited = waited or self._main > 0
                if self.max_aux_wait is None or self._aux_due:
                    self._cond.wait()  # (already due: the running main forward's release wakes us)
                    continue
                left = self.max_aux_wait - (time.monotonic() - start)
                if left <= 0:
                    self._aux_due = True  # starved: main forwards not yet started now wait for this one step
                else:
                    self._cond.wait(timeout=left)
            if self._aux_due:
                self._aux_due = False
                self.starved_steps += self._main > 0
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
    plan: bool = False  # also run `Planning mode` at each fork: its plan becomes the session's blueprint
    plan_max_tokens: int = 128  # decode budget of one `{"plan": [...]}` (running out = a parse failure)
    max_wait: float | None = None  # starvation bound in seconds (`Scheduler.max_aux_wait`); None: only idle time
    close_bias: float = 0.0  # nats added to closing the deletion list (`_constrained_steps`): > 0 deletes less
    keep_unread: bool = True  # never delete a tool response the agent has not read yet (`unread_cursors`)
    min_confidence: float | None = None  # delete only ids listed with this probability (`_confident_steps`)
    # a fitted rule decides instead of the model (`manager.rule`, `--manager`), or the stacked head on the
    # per-response adapter's forward (`manager.stack.StackManager`: the fork carries the adapter)
    rule: RuleManager | StackManager | None = None

    def validate(self) -> None:
        check_close_bias(self.close_bias)
        check_min_confidence(self.min_confidence)
        if self.max_wait is not None and self.max_wait < 0:
            raise ValueError(f"aux max_wait must be >= 0 seconds, got {self.max_wait}")
        if self.every < 1:
            raise ValueError(f"aux every K must be >= 1, got {self.every}")
        if self.max_tokens < 1:
            raise ValueError(f"aux max_tokens must be >= 1, got {self.max_tokens}")
        if self.plan_max_tokens < 1:
            raise ValueError(f"aux plan max_tokens must be >= 1, got {self.plan_max_tokens}")


@dataclass
class AuxJob:
    """A fork taken by the store inside a main turn, at a boundary, and the context it was taken in."""

    fork: Session  # the main state right after the boundary's tool message (use_adapter already set)
    messages: list[dict]  # the session's messages up to and including that tool message
    open_cursors: list[int]  # tool messages among them not dropped at the fork point
    turn: int  # the index of the turn the fork was taken in
    fork_key: str = ""  # the fork's history key before the trigger (the boundary state decided on), set by `aux_take`
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
        self.plan_hook: Callable[[AuxJob], str] | None = None  # tests: a fake planner's text instead of the decode
        self.errors: list[BaseException] = []

    def warm(self) -> None:
        """The constrained decoders' candidate tables (a scan of the vocabulary): built once, before serving."""
        _candidates(self.tokenizer)
        if self.config.plan:
            _candidates(self.tokenizer, _PLAN_ALPHABET)

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
            # the planner's own shared fork of the boundary state, taken before the deletion decode writes `job.fork`
            plan_fork = job.fork.fork(shared=True) if self.config.plan and self.plan_hook is None else None
            if self.config.rule is not None:  # a fitted rule (no forward) or the stacked head (the scores forward)
                steps = self.config.rule.steps(job.fork, self.tokenizer, job.messages, job.open_cursors)
            else:
                steps = aux_steps(job.fork, self.tokenizer, job.messages, job.open_cursors, self.config.max_tokens,
                                  self.config.close_bias, self.config.keep_unread, self.config.min_confidence)
            k, got = self._drive(sid, steps, 0)
            if got is None:
                return
            if self.config.plan:
                if self.plan_hook is not None:
                    plan = check_plan(self.plan_hook(job), job.open_cursors, len(job.messages))
                else:
                    _, plan = self._drive(sid, plan_steps(plan_fork, self.tokenizer, job.messages, job.open_cursors,
                                                          self.config.plan_max_tokens), k)
                    if plan is None:
                        return
                got.plan = plan
            decision = got
        finally:  # a decision, or None (an error or a shutdown): either way the session may fork again
            self.store.aux_deliver(sid, job, decision, time.perf_counter() - t0)

    def _drive(self, sid: str, steps: Generator, k: int) -> tuple[int, object | None]:
        """Run a step generator under the scheduler, one model-lock hold per step: (next step number, its value),
        value None if the worker is stopping."""
        while True:
            if self.step_hook is not None:
                self.step_hook(sid, k)
            if self._stop:
                return k, None
            with self.sched.aux_step() as waited:
                if waited and self.metrics is not None:
                    self.metrics.aux_preemptions.inc()
                try:
                    next(steps)
                except StopIteration as stop:
                    return k + 1, stop.value
            k += 1

