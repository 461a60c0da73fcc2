"""The auxiliary memory-management thread (SideQuest): the model itself decides which tool responses are stale.

At a *boundary* — right after every K-th tool response, the moment `synth/hindsight.py` trains the manager on — fork the
main session (a shared fork: it reads the main K/V in place, copying none; the main session is never written), append
the trigger message (`Memory management mode`, then `Open cursors: ...`: `synth.hindsight.delete_trigger`, the text the
manager was trained on, in the layout its adapter records: `Engine.trigger_style`) and the assistant opener, then
greedy-decode `{"del_cursors": [...]}` under a constraint that admits only open cursor ids (no repeats) — so the output
always parses. The caller applies the deletion to the main session as a `drop` at its next turn. The aux tokens never
enter the main context.

An adapter trained with `--aux-context first` (`Engine.aux_context`) is served as trained: its trigger follows a
session holding only the conversation's first message (`first_message_session`), not the fork.

The constraint is a character-level automaton over the tail after the forced `{"del_cursors":` prefix; at each step
only vocabulary tokens made of `0-9 , [ ] }` and space are candidates (a few hundred), each checked against it.
`AuxConfig.close_bias` (`--aux-close-bias`) adds a constant to the candidates that close the list: fewer, surer
deletions (a prefix of the greedy list). `AuxConfig.min_confidence` (`--aux-min-confidence`) replaces the greedy list
by a decision per id: the ids the manager lists with probability >= the threshold, summed over the list's branches
(`_confident_steps`).

In the server (`SessionStore` with an `AuxConfig`): the store takes the fork inside the main turn, right after the
boundary's tool message was appended and before the reply is generated (`fork_point`), and hands it to `AuxWorker`,
one background thread that runs `aux_steps` — the same decode as `run_aux`, cut into steps of at most one forward —
under `Scheduler`, the model lock with priorities (main requests first; the aux takes the lock only while no request
is in progress, per step), so a request arriving mid-decode waits for at most one aux forward.

The learned planner (`AuxConfig.plan`, `steward serve --aux-plan`): after the deletion decode, the worker runs
`Planning mode` (`synth.hindsight.PLAN_TRIGGER`) on its own shared fork of the same boundary state and decodes
`{"plan": [{"cursor": c, "readers": [step, ...]}, ...]}` under `PlanGrammar` (open cursors ascending, readers strictly
ascending future steps: always well-formed JSON in `json.dumps` form; only a token budget running out leaves it
unfinished, which is a parse failure). `parse_plan` validates strictly; an invalid plan is never applied in part. The
store turns a valid plan into the session's blueprint (`plan_blueprint`) at the next turn.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvsteward.serve.blueprint import PlannedSpan, parse_blueprint
from kvsteward.serve.session import Session
from kvsteward.synth.chat import generation_prompt, message_texts, message_token_ids
from kvsteward.synth.hindsight import PLAN_TRIGGER, delete_trigger, unread_cursors

# The forced opener stops before the list's `[`: BPE merges the bracket with what follows, so the training targets
# (`json.dumps`, tokenized as one piece) read ` []` + `}` for an empty list and ` [` + `3` for a non-empty one.
# Forcing ` [` would leave the model in a token state it never saw before an empty list (and bias it to delete);
# the bracket is decoded under the constraint instead, so either tokenization can be chosen.
PREFIX = '{"del_cursors":'
LIST_OPEN = " ["
_ALPHABET = set("0123456789, []}")


def check_min_confidence(value) -> float | None:
    """`value` as a probability in (0, 1], or None (plain greedy decode)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"aux min_confidence must be a probability in (0, 1] (or none), got {value}")
    return float(value)


def check_close_bias(value) -> float:
    """`value` as a float if it is a finite number of nats (not a bool, not text from a hand-edited record)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"aux close_bias must be a finite number of nats, got {value}")
    return float(value)


def valid_tail(tail: str, open_ids: frozenset[int]) -> tuple[bool, bool]:
    """(prefix of a valid tail?, complete?) for the language `" [" (ID (", " ID)* "]}" | "]}")` over unused open
    ids (the tail is what follows `PREFIX`)."""
    if not tail.startswith(LIST_OPEN):
        return LIST_OPEN.startswith(tail), False
    return _valid_list(tail[len(LIST_OPEN):], open_ids)


def _valid_list(tail: str, open_ids: frozenset[int]) -> tuple[bool, bool]:
    """`valid_tail` after the opening bracket: `ID (", " ID)* "]}"` | `"]}"`."""
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


@lru_cache(maxsize=8)
def _candidates(tokenizer, alphabet: str = "".join(sorted(_ALPHABET))) -> tuple[list[int], list[str]]:
    """Vocabulary tokens whose text is made only of `alphabet` (default: the deletion list's characters)."""
    allowed = set(alphabet)
    ids, texts = [], []
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if text and set(text) <= allowed:
            ids.append(tid)
            texts.append(text)
    return ids, texts


def closing_tokens(tokenizer) -> list[int]:
    """The deletion list's candidates that close it (their text holds `]`): where `close_bias` applies."""
    ids, texts = _candidates(tokenizer)
    return [i for i, t in zip(ids, texts, strict=True) if "]" in t]


def _close_bias_vector(tokenizer, close_bias: float) -> torch.Tensor | None:
    """`close_bias` on every closing candidate of `_candidates(tokenizer)`, 0 elsewhere; None for no bias."""
    if not close_bias:
        return None
    closing = set(closing_tokens(tokenizer))
    return torch.tensor([close_bias if t in closing else 0.0 for t in _candidates(tokenizer)[0]])


@dataclass
class AuxDecision:
    del_cursors: list[int]
    text: str
    tokens: int
    truncated: bool = False  # the token budget ran out before the list closed; completed ids are kept
    plan: PlanDecision | None = None  # `--aux-plan`: the same boundary's `Planning mode` decision
    confidence: dict[int, float] | None = None  # `min_confidence`: each deletable id's P(listed) (a lower bound)


def constrained_del_cursors(session: Session, tokenizer, open_ids: list[int], max_tokens: int = 64,
                            close_bias: float = 0.0) -> AuxDecision:
    """Greedy decode of the deletion list on `session` (already holding the trigger and the generation prompt; the
    opener `PREFIX` is appended here), constrained to `open_ids`."""
    return drive(_constrained_steps(session, tokenizer, open_ids, max_tokens, close_bias))


def drive(steps: Generator[None, None, AuxDecision]) -> AuxDecision:
    """Run a step generator to its end (no scheduling): its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _constrained_steps(session: Session, tokenizer, open_ids: list[int], max_tokens: int,
                       close_bias: float = 0.0) -> Generator[None, None, AuxDecision]:
    """`constrained_del_cursors` as a generator: every resumption runs at most one model forward.

    `close_bias` (nats) is added to the logit of every candidate that closes the list (its text holds `]`: ` []`,
    `]}`, ...). Only the choice "close here or list one more id" moves; the ranking among ids does not, so a higher
    bias lists a prefix of what a lower one lists (the ids in decode order): it trades recall for precision, i.e.
    fewer harmful deletions. 0 is plain greedy, the decode the manager was trained for."""
    allowed = frozenset(open_ids)
    cand_ids, cand_texts = _candidates(tokenizer)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    bias = _close_bias_vector(tokenizer, close_bias)
    session.append(tokenizer.encode(PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
    yield
    tail, used_tokens = "", 0
    for used_tokens in range(1, max_tokens + 1):  # noqa: B007 (the count is reported)
        logits = session.last_logits[cand].float()
        if bias is not None:
            logits = logits + bias
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


# The branch decode's bounds: a branch below PRUNE probability is not expanded, and at most MAX_BRANCH_FORWARDS
# tokens are decoded per decision (most probable branches first). Both only lose probability mass, so every
# confidence is a lower bound of the model's P(listed): the rule errs toward keeping.
PRUNE = 0.01
MAX_BRANCH_FORWARDS = 64


def confident_del_cursors(session: Session, tokenizer, open_ids: list[int], min_confidence: float,
                          max_tokens: int = 64, close_bias: float = 0.0, prune: float = PRUNE,
                          max_forwards: int = MAX_BRANCH_FORWARDS) -> AuxDecision:
    """`constrained_del_cursors` under the confidence rule: the ids the manager lists with probability >=
    `min_confidence` (`_confident_steps`)."""
    return drive(_confident_steps(session, tokenizer, open_ids, min_confidence, max_tokens, close_bias, prune,
                                  max_forwards))


def _confident_steps(session: Session, tokenizer, open_ids: list[int], min_confidence: float, max_tokens: int,
                     close_bias: float = 0.0, prune: float = PRUNE,
                     max_forwards: int = MAX_BRANCH_FORWARDS) -> Generator[None, None, AuxDecision]:
    """The deletion as a decision per id: P(c listed) under the manager's constrained distribution over lists, and
    delete the ids with P >= `min_confidence`. Every resumption runs at most one model forward.

    Why: greedy decoding commits to the first id it ranks highest, and a manager torn between two ids (0.55 vs 0.45:
    which of two fact pages is stale) deletes one with certainty; its harmful deletions are mostly such splits, while
    its right ones are listed with P > 0.9 (docs/training.md, session 19). Summing the probability of every list
    that holds c — the marginal, what a decision per id needs — makes that doubt visible.

    How: a depth-first walk over the grammar's token tree (`valid_tail`; probabilities renormalized over the valid
    candidates, `close_bias` added to closing tokens as in greedy), the most probable child first, each branch a
    copy of the state (`Session.fork`); a branch closes its list (its mass goes to its ids), falls below `prune`, runs
    out of `max_tokens`, or finds the `max_forwards` budget spent (those three lose their mass). `truncated`: no
    list closed at all (nothing is deleted)."""
    allowed = frozenset(open_ids)
    cand_ids, cand_texts = _candidates(tokenizer)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    bias = _close_bias_vector(tokenizer, close_bias)
    session.append(tokenizer.encode(PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
    yield
    mass = dict.fromkeys(open_ids, 0.0)
    closed, forwards = 0.0, 0
    floor = math.log(prune) if prune > 0 else -math.inf
    # a pending child: its parent's state (shared with its siblings: [session, children not yet taken]), the tail
    # and log P with its token, the token, tokens decoded. The parent state is copied per child (the last one taken
    # reuses it), so only the states on the current path and their parents are alive.
    stack: list[tuple[list, str, float, int | None, int]] = [([session, 1], "", 0.0, None, 0)]
    while stack and forwards < max_forwards:
        parent, tail, logp, token, used = stack.pop()
        parent[1] -= 1
        state = parent[0] if parent[1] == 0 else parent[0].fork()
        if token is not None:
            state.append([token], kind="assistant", continue_message=True, logits="last")
            forwards += 1
            yield
        logits = state.last_logits[cand].float()
        if bias is not None:
            logits = logits + bias
        valid = [(k, done) for k in range(len(cand_ids)) for ok, done in [valid_tail(tail + cand_texts[k], allowed)]
                 if ok]
        logq = torch.log_softmax(logits[[k for k, _ in valid]], 0).tolist()
        growing = []
        for (k, done), q in zip(valid, logq, strict=True):
            if logp + q < floor:
                continue
            if done:
                p = math.exp(logp + q)
                closed += p
                for c in json.loads(PREFIX + tail + cand_texts[k])["del_cursors"]:
                    mass[c] += p
            elif used + 1 < max_tokens:
                growing.append((logp + q, k))
        node = [state, len(growing)]
        for lp, k in sorted(growing):  # the least probable pushed first: the most probable is expanded next
            stack.append((node, tail + cand_texts[k], lp, cand_ids[k], used + 1))
    keep = sorted(c for c in open_ids if mass[c] >= min_confidence)
    text = PREFIX + " " + json.dumps(keep) + "}"
    return AuxDecision(keep, text, forwards, truncated=closed == 0.0, confidence=mass)


def _close(tail: str) -> str:
    """Budget exhausted mid-list: keep the ids already closed by a separator and close the JSON."""
    return LIST_OPEN + ", ".join(re.findall(r"(\d+)(?=, |\])", tail)) + "]}"


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


def aux_steps(fork: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
              close_bias: float = 0.0, keep_unread: bool = True,
              min_confidence: float | None = None) -> Generator[None, None, AuxDecision]:
    """The aux thread on `fork` (a fork of the main session, adapter set by the caller) as a generator of steps:
    every resumption runs at most one model forward (trigger prefill, the forced opener, then one decoded token), so
    a scheduler can take the model lock per step and yield to main work in between. Returns the decision.
    The decoder may list any open cursor, except the unread ones with `keep_unread` (`unread_cursors`); with none
    left to list the decision is "delete nothing" without a forward.

    With `Engine.aux_context == "first"` (an adapter trained with `--aux-context first`) the trigger follows only the
    conversation's first message, in a session of its own (`first_message_session`), not the fork: the computation
    the adapter was trained on. The notes trigger still lists every open cursor of the whole session.
    `min_confidence`: delete the ids listed with at least this probability (`_confident_steps`), not the greedy
    list."""
    unread = set(unread_cursors(messages)) if keep_unread else set()
    deletable = [c for c in open_cursors if c not in unread]
    if not deletable:
        return AuxDecision([], PREFIX + LIST_OPEN + "]}", 0)
    if fork.engine.aux_context == "first":
        fork = first_message_session(fork, tokenizer, messages)
        yield
    text = delete_trigger(open_cursors, messages, fork.engine.trigger_style)  # the adapter's training layout
    history = messages + [{"role": "user", "content": text}]
    trigger_text = message_texts(tokenizer, history)[-1] + generation_prompt(tokenizer, history)
    fork.append(tokenizer.encode(trigger_text, add_special_tokens=False), kind="user", logits="last")
    yield
    if min_confidence is not None:
        return (yield from _confident_steps(fork, tokenizer, deletable, min_confidence, max_tokens, close_bias))
    return (yield from _constrained_steps(fork, tokenizer, deletable, max_tokens, close_bias))


def first_message_session(fork: Session, tokenizer, messages: list[dict]) -> Session:
    """A new session on `fork`'s engine holding only `messages[0]` (as the chat template writes it at the start of
    the conversation, positions from 0), prefilled by the base model as the main thread computed it; the adapter
    setting of `fork` applies to what is appended next. Exactly the context of a `train.data.first_message_rows` row.
    Why not cut the fork: a shared fork cannot drop the main session's rows, and a copy would cost the whole
    session; this costs the first message, whatever the session's length.

    The prefilled first message (the head) is kept on the engine (`Engine.aux_heads`, least recently used first out,
    at most `Engine.aux_head_tokens` tokens in all; a session's system prompt is the same at every decision, and
    often across sessions), so a decision copies its rows instead of running its forward. A copy, not a shared fork:
    the trigger's logits are then bit for bit those of a fresh prefill (a shared fork sums attention over two
    segments). Only the aux thread touches the cache (one worker thread per engine)."""
    engine = fork.engine
    role = messages[0].get("role", "system")
    ids = tuple(message_token_ids(tokenizer, messages[:1])[0])
    key = (role, ids, fork.config.chunk)  # the chunking shapes the prefill's float rounding
    heads = engine.aux_heads
    head = heads.get(key)
    if head is None:
        head = engine.session("full", chunk=fork.config.chunk)
        head.append(list(ids), kind=role)
        heads[key] = head
        while heads and sum(len(k[1]) for k in heads) > engine.aux_head_tokens:
            heads.popitem(last=False)  # (a head longer than the whole cap is not kept: it is used once below)
    else:
        heads.move_to_end(key)
    out = head.fork()  # a copy of the head's rows: the head itself is never appended to
    out.config.use_adapter = fork.config.use_adapter
    return out


def run_aux(main: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
            use_adapter: bool = True, close_bias: float = 0.0, keep_unread: bool = True,
            min_confidence: float | None = None) -> AuxDecision:
    """Fork the main session, append the trigger (a user message) and the assistant opener, decode the deletion."""
    fork = main.fork(shared=True)  # reads the main K/V in place: no copy
    fork.config.use_adapter = use_adapter
    return drive(aux_steps(fork, tokenizer, messages, open_cursors, max_tokens, close_bias, keep_unread,
                           min_confidence))


# -- the planner (`Planning mode`): a blueprint for the foresight policy ----------------------------------------------
PLAN_PREFIX = '{"plan":'  # stops before the bracket, as `PREFIX` does (` [{` and ` []` are single tokens)
PLAN_HORIZON = 4096  # readers are steps in [boundary, boundary + PLAN_HORIZON): a bound that ends every number
_PLAN_ALPHABET = "0123456789, ]}{[\":cursoread"
_ENTRY = '{"cursor": '
_READERS = ', "readers": ['


class PlanError(ValueError):
    """An aux plan that is not a valid plan for its boundary (counted as a parse failure, never applied)."""


def _has_prefix_in(digits: str, lo: int, hi: int) -> bool:
    """Some integer n in [lo, hi] is written (decimal, no leading zero) with `digits` as a prefix."""
    if lo > hi or not digits:
        return lo <= hi
    if digits[0] == "0":
        return digits == "0" and lo <= 0 <= hi
    base = int(digits)
    for k in range(len(str(hi)) - len(digits) + 1):
        a, b = base * 10**k, base * 10**k + 10**k - 1
        if a <= hi and b >= lo:
            return True
    return False


class PlanGrammar:
    """The plan tail after the forced `{"plan":`, exactly as `json.dumps` writes `synth.hindsight.plan_target`:

        " [" ("]}"  |  ENTRY (", " ENTRY)* "]}")        ENTRY = '{"cursor": ' C ', "readers": [' R (", " R)* "]}"

    C: open cursor ids in ascending order (so none twice); R: steps in [boundary, boundary + PLAN_HORIZON), strictly
    ascending within an entry. A character-level automaton: a state is a tuple, `feed` advances it over a string
    (None: not a prefix of the language), `done` says whether the tail is complete. Every reachable state has a
    completion (a separator is admitted only if something can follow it), so greedy decoding never gets stuck.
    """

    def __init__(self, open_ids: list[int], boundary: int):
        self.open = sorted(set(open_ids))
        self.lo, self.hi = boundary, boundary + PLAN_HORIZON - 1

    # states: ("lit", text, pos, next) | ("start",) | ("cid", digits, last_c) | ("rid", digits, last_c, last_r)
    #         | ("entry_end", last_c) | ("done",)
    def start(self) -> tuple:
        return ("lit", LIST_OPEN, 0, ("start",))

    def _cursor_ok(self, digits: str, last_c: int) -> bool:
        return any(str(c).startswith(digits) for c in self.open if c > last_c)

    def _more_cursors(self, last_c: int) -> bool:
        return any(c > last_c for c in self.open)

    def _step(self, st: tuple, ch: str) -> tuple | None:
        kind = st[0]
        if kind == "lit":
            _, text, pos, nxt = st
            if ch != text[pos]:
                return None
            return nxt if pos + 1 == len(text) else ("lit", text, pos + 1, nxt)
        if kind == "start":
            if ch == "]":
                return ("lit", "]}", 1, ("done",))
            if ch == "{" and self.open:
                return ("lit", _ENTRY, 1, ("cid", "", -1))
            return None
        if kind == "cid":
            _, digits, last_c = st
            if ch.isdigit():
                return ("cid", digits + ch, last_c) if self._cursor_ok(digits + ch, last_c) else None
            if ch == "," and digits and int(digits) in self.open and int(digits) > last_c \
                    and str(int(digits)) == digits:
                return ("lit", _READERS, 1, ("rid", "", int(digits), self.lo - 1))
            return None
        if kind == "rid":
            _, digits, last_c, last_r = st
            lo = max(self.lo, last_r + 1)
            if ch.isdigit():
                return ("rid", digits + ch, last_c, last_r) if _has_prefix_in(digits + ch, lo, self.hi) else None
            if not digits or str(int(digits)) != digits or not lo <= int(digits) <= self.hi:
                return None
            r = int(digits)
            if ch == "," and r < self.hi:
                return ("lit", ", ", 1, ("rid", "", last_c, r))
            if ch == "]":
                return ("lit", "]}", 1, ("entry_end", last_c))
            return None
        if kind == "entry_end":
            (_, last_c) = st
            if ch == "," and self._more_cursors(last_c):
                return ("lit", ", " + _ENTRY, 1, ("cid", "", last_c))
            if ch == "]":
                return ("lit", "]}", 1, ("done",))
            return None
        return None  # done: nothing may follow

    def feed(self, st: tuple | None, text: str) -> tuple | None:
        for ch in text:
            if st is None:
                return None
            st = self._step(st, ch)
        return st

    @staticmethod
    def done(st: tuple | None) -> bool:
        return st is not None and st[0] == "done"


def parse_plan(text: str, open_ids: list[int], boundary: int) -> list[dict]:
    """Strict validation of a plan text: `{"plan": [{"cursor": c, "readers": [s, ...]}, ...]}` with every c an open
    cursor (each once) and every reader list non-empty, without repeats, of steps in [boundary, boundary +
    PLAN_HORIZON). Returns the entries (cursors and readers sorted) or raises PlanError: all or nothing."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as e:
        raise PlanError(f"not JSON: {e}") from e
    if not isinstance(data, dict) or set(data) != {"plan"} or not isinstance(data["plan"], list):
        raise PlanError('expected {"plan": [...]}')
    hi = boundary + PLAN_HORIZON - 1
    out, seen = [], set()
    for k, e in enumerate(data["plan"]):
        if not isinstance(e, dict) or set(e) != {"cursor", "readers"}:
            raise PlanError(f'plan[{k}] must be {{"cursor": c, "readers": [...]}}')
        c, rs = e["cursor"], e["readers"]
        if not _is_int(c) or c not in open_ids or c in seen:
            raise PlanError(f"plan[{k}].cursor {c!r} is not an open cursor (open: {sorted(open_ids)}) or repeats")
        if not isinstance(rs, list) or not rs or not all(_is_int(r) and boundary <= r <= hi for r in rs) \
                or len(set(rs)) != len(rs):
            raise PlanError(f"plan[{k}].readers {rs!r} must be distinct future steps in [{boundary}, {hi}]")
        seen.add(c)
        out.append({"cursor": c, "readers": sorted(rs)})
    return sorted(out, key=lambda e: e["cursor"])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class PlanDecision:
    text: str
    plan: list[dict] | None  # the validated entries; None: invalid (a parse failure, ignored)
    tokens: int = 0
    truncated: bool = False  # the token budget ran out before the plan closed (invalid: never applied partially)
    error: str | None = None

    def as_json(self) -> dict:
        return {"text": self.text, "plan": self.plan, "tokens": self.tokens, "truncated": self.truncated,
                "error": self.error}


def check_plan(text: str, open_ids: list[int], boundary: int, tokens: int = 0,
               truncated: bool = False) -> PlanDecision:
    """A plan text judged strictly: valid entries, or a parse failure (plan None, error set)."""
    if truncated:
        return PlanDecision(text, None, tokens, True, "the token budget ran out before the plan closed")
    try:
        return PlanDecision(text, parse_plan(text, open_ids, boundary), tokens)
    except PlanError as e:
        return PlanDecision(text, None, tokens, False, str(e))


def _plan_steps(session: Session, tokenizer, open_ids: list[int], boundary: int,
                max_tokens: int) -> Generator[None, None, PlanDecision]:
    """Greedy decode of the plan on `session` (holding trigger + opener) under `PlanGrammar`, one forward a step."""
    grammar = PlanGrammar(open_ids, boundary)
    cand_ids, cand_texts = _candidates(tokenizer, _PLAN_ALPHABET)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    session.append(tokenizer.encode(PLAN_PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
    yield
    tail, state, used = "", grammar.start(), 0
    for used in range(1, max_tokens + 1):  # noqa: B007 (the count is reported)
        order = torch.argsort(session.last_logits[cand], descending=True).tolist()
        for k in order:
            nxt = grammar.feed(state, cand_texts[k])
            if nxt is not None:
                break
        else:  # cannot happen: every reachable state has a continuation made of candidate characters
            raise RuntimeError(f"no valid plan continuation after {tail!r}")
        tail, state = tail + cand_texts[k], nxt
        if grammar.done(state):
            return check_plan(PLAN_PREFIX + tail, open_ids, boundary, used)
        session.append([cand_ids[k]], kind="assistant", continue_message=True, logits="last")
        yield
    return check_plan(PLAN_PREFIX + tail, open_ids, boundary, used, truncated=True)


def plan_steps(fork: Session, tokenizer, messages: list[dict], open_cursors: list[int],
               max_tokens: int = 128) -> Generator[None, None, PlanDecision]:
    """`aux_steps` for `Planning mode`: trigger, opener, then the constrained plan, one forward per step. The boundary
    (the first step a reader may be) is `len(messages)`: the step right after the fork's last message."""
    history = messages + [{"role": "user", "content": PLAN_TRIGGER}]
    trigger_text = message_texts(tokenizer, history)[-1] + generation_prompt(tokenizer, history)
    fork.append(tokenizer.encode(trigger_text, add_special_tokens=False), kind="user", logits="last")
    yield
    return (yield from _plan_steps(fork, tokenizer, open_cursors, len(messages), max_tokens))


def run_plan(main: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 128,
             use_adapter: bool = True) -> PlanDecision:
    """Fork the main session, append `Planning mode` and the opener, decode the plan (the by-hand planner call)."""
    if not open_cursors:
        return check_plan(PLAN_PREFIX + LIST_OPEN + "]}", [], len(messages))
    fork = main.fork(shared=True)
    fork.config.use_adapter = use_adapter
    return drive(plan_steps(fork, tokenizer, messages, open_cursors, max_tokens))


def plan_blueprint(plan: list[dict], ranges: list[tuple[int, int]]) -> list[PlannedSpan]:
    """The plan as blueprint spans: each planned cursor's whole message (its logical token range, `ranges[c]`) with
    its reader steps (step = message index, as `serve/blueprint.py` reads them)."""
    return parse_blueprint([{"span": list(ranges[e["cursor"]]), "readers": e["readers"]} for e in plan])


# -- the server's aux worker ----------------------------------------------------------------------------------------
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
