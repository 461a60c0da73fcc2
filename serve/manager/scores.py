"""The per-response decision (`scores` trigger): every open response's P(still needed) from one forward.

The fork appends the trigger message `synth.traces.hindsight.score_trigger` writes (one line per open response: its
call, its first line, `| still needed?`) exactly as the training rows hold it (no generation prompt), and reads the
next-token logits at each line's slot: P(no) = softmax over the two answers (" yes", " no") is the confidence that
the response can go. Deleted: the deletable ids with P(no) >= the threshold (`min_confidence`; 0.5 when None), the
threshold chosen on validation traces by `steward eval calibrate --confidences` like the list decoder's confidence
rule. No decode, no grammar: the decision always parses.
"""

from __future__ import annotations

import json
from collections.abc import Generator

import torch

from kvsteward.serve.engine.session import Session
from kvsteward.serve.manager.decode import AuxDecision
from kvsteward.synth.chat import message_texts
from kvsteward.synth.traces.hindsight import ANSWERS, score_slot_ends, score_trigger
from kvsteward.synth.traces.tokens import PieceTokenizer, answer_ids, slot_tokens

DEFAULT_THRESHOLD = 0.5


def trigger_ids(tokenizer, messages: list[dict], open_cursors: list[int]) -> tuple[list[int], list[int]]:
    """(token ids of the trigger message as the chat template renders it after `messages`, the slot token index of
    each open cursor in ascending order): the piece a `scores` training row ends with."""
    history = messages + [{"role": "user", "content": score_trigger(open_cursors, messages)}]
    text = message_texts(tokenizer, history)[-1]
    ids, offsets = PieceTokenizer(tokenizer).encode(text)  # the training rows' tokenization (synth.traces.dataset)
    return ids, slot_tokens(offsets, score_slot_ends(text, open_cursors))


def needless(logits: torch.Tensor, slots: list[int], tokenizer) -> list[float]:
    """P(no) at each slot: the two answers' logits, softmaxed against each other."""
    yes, no = answer_ids(tokenizer, ANSWERS)
    pair = logits[slots][:, [yes, no]].float()
    return torch.softmax(pair, dim=-1)[:, 1].tolist()


def deletions(p_no: dict[int, float], deletable: list[int], min_confidence: float | None = None) -> list[int]:
    """The deletable ids whose P(no) reaches the threshold (`min_confidence`, DEFAULT_THRESHOLD when None)."""
    threshold = DEFAULT_THRESHOLD if min_confidence is None else min_confidence
    return [c for c in sorted(deletable) if p_no[c] >= threshold]


def score_steps(fork: Session, tokenizer, messages: list[dict], open_cursors: list[int], deletable: list[int],
                min_confidence: float | None = None) -> Generator[None, None, AuxDecision]:
    """The per-response decision on `fork` as a step generator (one forward: the trigger)."""
    ids, slots = trigger_ids(tokenizer, messages, open_cursors)
    logits = fork.append(ids, kind="user", logits="all")
    yield
    p_no = dict(zip(sorted(open_cursors), needless(logits, slots, tokenizer), strict=True))
    gone = deletions(p_no, deletable, min_confidence)
    return AuxDecision(gone, json.dumps({"del_cursors": gone}), 0,
                       confidence={c: p_no[c] for c in deletable})
