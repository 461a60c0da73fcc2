"""The learned planner (`Planning mode`): a blueprint for the foresight policy, decoded under a strict grammar.

With `AuxConfig.plan` (`steward serve --aux-plan`), after the deletion decode the worker runs `Planning mode`
(`synth.traces.hindsight.PLAN_TRIGGER`) on its own shared fork of the same boundary state and decodes
`{"plan": [{"cursor": c, "readers": [step, ...]}, ...]}` under `PlanGrammar` (open cursors ascending, readers strictly
ascending future steps: always well-formed JSON in `json.dumps` form; only a token budget running out leaves it
unfinished, which is a parse failure). `parse_plan` validates strictly; an invalid plan is never applied in part. The
store turns a valid plan into the session's blueprint (`plan_blueprint`) at the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass

import torch

from kvsteward.serve.engine.blueprint import PlannedSpan, parse_blueprint
from kvsteward.serve.engine.session import Session
from kvsteward.serve.manager.decode import LIST_OPEN, _candidates, drive
from kvsteward.synth.chat import generation_prompt, message_texts
from kvsteward.synth.traces.hindsight import PLAN_TRIGGER

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
    """The plan tail after the forced `{"plan":`, exactly as `json.dumps` writes `synth.traces.hindsight.plan_target`:

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
    its reader steps (step = message index, as `serve/engine/blueprint.py` reads them)."""
    return parse_blueprint([{"span": list(ranges[e["cursor"]]), "readers": e["readers"]} for e in plan])

