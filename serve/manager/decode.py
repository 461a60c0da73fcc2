"""The deletion decision's grammar and decoding rules: `{"del_cursors": [...]}` constrained to the open cursor ids.

The constraint is a character-level automaton over the tail after the forced `{"del_cursors":` prefix; at each step
only vocabulary tokens made of `0-9 , [ ] }` and space are candidates (a few hundred), each checked against it, so
the output always parses. Two decision rules on top: the greedy list (`constrained_del_cursors`;
`AuxConfig.close_bias`, `--aux-close-bias`, adds a constant to the candidates that close the list: fewer, surer
deletions, a prefix of the greedy list) and the confidence rule (`confident_del_cursors`; `AuxConfig.min_confidence`,
`--aux-min-confidence`): the ids the manager lists with probability >= the threshold, summed over the list's
branches. Each decode is also a step generator (`_constrained_steps`, `_confident_steps`): every resumption runs at
most one model forward, so the worker can yield the model lock to main requests in between.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Generator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvsteward.models import check_close_bias, check_min_confidence
from kvsteward.serve.engine.session import Session

__all__ = ["PREFIX", "LIST_OPEN", "AuxDecision", "check_close_bias", "check_min_confidence", "closing_tokens",
           "confident_del_cursors", "constrained_del_cursors", "drive", "valid_tail"]

# The forced opener stops before the list's `[`: BPE merges the bracket with what follows, so the training targets
# (`json.dumps`, tokenized as one piece) read ` []` + `}` for an empty list and ` [` + `3` for a non-empty one.
# Forcing ` [` would leave the model in a token state it never saw before an empty list (and bias it to delete);
# the bracket is decoded under the constraint instead, so either tokenization can be chosen.
PREFIX = '{"del_cursors":'
LIST_OPEN = " ["
_ALPHABET = set("0123456789, []}")



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
    plan: PlanDecision | None = None  # noqa: F821 (manager.planner; a forward reference, no import cycle)  # `--aux-plan`: the same boundary's `Planning mode` decision
    confidence: dict[int, float] | None = None  # `min_confidence`: each deletable id's P(listed) (a lower bound)


def rule_decision(deleted: set[int] | list[int]) -> AuxDecision:
    """A decision made without a decode (a fitted rule, the stack's head) in the list decoder's text form (what the
    server logs and an SGLang client would parse)."""
    ids = sorted(deleted)
    return AuxDecision(ids, PREFIX + " " + json.dumps(ids) + "}", 0)


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
    its right ones are listed with P > 0.9 (docs/results/2026-12-02-manager-confidence-rule). Summing the probability
    of every list that holds c — the marginal, what a decision per id needs — makes that doubt visible.

    How: a depth-first walk over the grammar's token tree (`valid_tail`; probabilities renormalized over the valid
    candidates, `close_bias` added to closing tokens as in greedy), the most probable child first, each branch a
    copy of the state (`Session.fork`); a branch closes its list (its mass goes to its ids), falls below `prune`, runs
    out of `max_tokens`, or finds the `max_forwards` budget spent (those three lose their mass). `truncated`: no
    list closed at all (nothing is deleted)."""
    cand_ids, _ = _candidates(tokenizer)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    session.append(tokenizer.encode(PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
    yield
    walk = branch_walk(tokenizer, open_ids, min_confidence, max_tokens, close_bias, prune, max_forwards)
    try:
        request = next(walk)
    except StopIteration as stop:  # no forward budget at all
        return stop.value
    while True:
        parent, token, last = request
        if token is None:  # the root: the session after the opener
            state = session
        else:
            state = parent if last else parent.fork()
            state.append([token], kind="assistant", continue_message=True, logits="last")
            yield
        try:
            request = walk.send((state, state.last_logits[cand].float()))
        except StopIteration as stop:
            return stop.value


def branch_walk(tokenizer, open_ids: list[int], min_confidence: float, max_tokens: int, close_bias: float = 0.0,
                prune: float = PRUNE, max_forwards: int = MAX_BRANCH_FORWARDS
                ) -> Generator[tuple[Any, int | None, bool], tuple[Any, torch.Tensor], AuxDecision]:
    """The confidence rule's walk, apart from where the logits come from (the engine's session states, or an SGLang
    server's requests: `kvsteward.serve.sglang.manager`).

    It yields `(parent, token, last)`: extend the state `parent` by `token` (None: the root, as it is) and send
    back `(child, logits)`, the child's state handle and its logits over `_candidates(tokenizer)` (any constant
    offset: they are renormalized over the valid candidates); `last` says no other child of `parent` remains, so
    the driver may extend `parent` in place instead of copying it. The first request is `(None, None, True)`: send
    the root (the state after the opener `PREFIX`) and its logits."""
    allowed = frozenset(open_ids)
    cand_ids, cand_texts = _candidates(tokenizer)
    bias = _close_bias_vector(tokenizer, close_bias)
    mass = dict.fromkeys(open_ids, 0.0)
    closed, forwards = 0.0, 0
    floor = math.log(prune) if prune > 0 else -math.inf
    # a pending child: its parent's state (shared with its siblings: [state, children not yet taken]), the tail
    # and log P with its token, the token, tokens decoded. The parent state is copied per child (the last one taken
    # reuses it), so only the states on the current path and their parents are alive.
    stack: list[tuple[list, str, float, int | None, int]] = [([None, 1], "", 0.0, None, 0)]
    while stack and forwards < max_forwards:
        parent, tail, logp, token, used = stack.pop()
        parent[1] -= 1
        if token is not None:
            forwards += 1
        state, logits = yield parent[0], token, parent[1] == 0
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

