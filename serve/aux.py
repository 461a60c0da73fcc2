"""The auxiliary memory-management thread (SideQuest): the model itself decides which tool responses are stale.

Every K turns: fork the main session (the fork reads the main KV; the main session is never written), append the
trigger message `Memory management mode` and the assistant opener, then greedy-decode `{"del_cursors": [...]}` under
a constraint that admits only open cursor ids (no repeats) — so the output always parses. The caller applies the
deletion to the main session as a `drop` after the main thread's current turn. The aux tokens never enter the main
context.

The constraint is a character-level automaton over the tail after the forced `{"del_cursors": [` prefix; at each step
only vocabulary tokens made of `0-9 , ] }` and space are candidates (a few hundred), each checked against it.
"""

from __future__ import annotations

import json
import re
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
    allowed = frozenset(open_ids)
    cand_ids, cand_texts = _candidates(tokenizer)
    cand = torch.tensor(cand_ids, dtype=torch.long)
    session.append(tokenizer.encode(PREFIX, add_special_tokens=False), kind="assistant", continue_message=True)
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
    else:
        tail = _close(tail)
        text = PREFIX + tail
        return AuxDecision(sorted(json.loads(text)["del_cursors"]), text, used_tokens, truncated=True)
    text = PREFIX + tail
    return AuxDecision(sorted(json.loads(text)["del_cursors"]), text, used_tokens)


def _close(tail: str) -> str:
    """Budget exhausted mid-list: keep the ids already closed by a separator and close the JSON."""
    return ", ".join(re.findall(r"(\d+)(?=, |\])", tail)) + "]}"


def run_aux(main: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
            use_adapter: bool = True) -> AuxDecision:
    """Fork the main session, append the trigger (a user message) and the assistant opener, decode the deletion."""
    if not open_cursors:
        return AuxDecision([], PREFIX + "]}", 0)
    fork = main.fork()
    fork.config.use_adapter = use_adapter
    history = messages + [{"role": "user", "content": TRIGGER}]
    trigger_text = message_texts(tokenizer, history)[-1] + generation_prompt(tokenizer, history)
    fork.append(tokenizer.encode(trigger_text, add_special_tokens=False), kind="user", logits="last")
    return constrained_del_cursors(fork, tokenizer, open_cursors, max_tokens)
