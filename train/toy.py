"""Small datasets in the hindsight format, for tests and timing runs (not for real training).

Two flavours, same columns as `steward synth hindsight` (input_ids, labels, is_aux, kind, messages, fork_at):
- `random_ids_dataset`: random token ids inside a tiny model's vocabulary; aux targets are a fixed token sequence
  (a learnable toy target), main rows label a random span (the KL mask).
- `chat_dataset`: real chat text through a tokenizer's template; aux rows list cursors with a status and answer the
  `Memory management mode` trigger with `{"del_cursors": [the closed ones]}`, main rows are plain Q&A turns.
"""

from __future__ import annotations

import json
import random

from datasets import Dataset, DatasetDict

from kvsteward.synth.chat import generation_prompt, message_token_ids
from kvsteward.train.loss import IGNORE

TRIGGER = "Memory management mode"
_WORDS = ("read", "file", "parse", "config", "test", "patch", "build", "log", "cache", "index", "query", "merge")


def _split(rows: list[dict], seed: int) -> DatasetDict:
    random.Random(seed).shuffle(rows)
    n_test = n_val = max(1, len(rows) // 10)
    parts = {"test": rows[:n_test], "validation": rows[n_test:n_test + n_val], "train": rows[n_test + n_val:]}
    return DatasetDict({k: Dataset.from_list(v) for k, v in parts.items()})


def random_ids_dataset(vocab: int = 256, rows: int = 40, length: tuple[int, int] = (16, 48), aux_frac: float = 0.5,
                       target: tuple[int, ...] = (5, 6, 7, 8), seed: int = 0) -> DatasetDict:
    """Random-token rows for a tiny model: aux rows end in `target` (labelled), main rows label their last third."""
    if min(target) < 0 or max(target) >= vocab:
        raise ValueError(f"target ids {target} must lie in [0, {vocab})")
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        n = rng.randint(*length)
        is_aux = i < round(rows * aux_frac)
        if is_aux:
            ctx = [rng.randrange(10, vocab) for _ in range(n)]
            ids, labels = ctx + list(target), [IGNORE] * n + list(target)
            fork_at = n - 2  # the aux thread's tokens start unlabelled, as a trigger message does
        else:
            ids = [rng.randrange(10, vocab) for _ in range(n)]
            cut = n - n // 3
            labels = [IGNORE] * cut + ids[cut:]
            fork_at = 0
        out.append({"input_ids": ids, "labels": labels, "is_aux": is_aux, "kind": "delete" if is_aux else "main",
                    "messages": "[]", "fork_at": fork_at})
    return _split(out, seed)


def _labelled(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation with labels on the last (assistant) message, minus its role header."""
    pieces = message_token_ids(tokenizer, messages)
    header = len(tokenizer.encode(generation_prompt(tokenizer, messages[:-1]), add_special_tokens=False))
    ids = [t for p in pieces for t in p]
    answer = pieces[-1]
    labels = [IGNORE] * (len(ids) - len(answer) + header) + answer[header:]
    return ids, labels


def _aux_row(tokenizer, rng: random.Random, cursors: int) -> dict:
    status = {c: rng.choice(("open", "closed")) for c in range(1, cursors + 1)}
    lines = [f"cursor {c}: {rng.choice(_WORDS)} {rng.choice(_WORDS)} — {s}" for c, s in status.items()]
    answer = json.dumps({"del_cursors": [c for c, s in status.items() if s == "closed"]})
    msgs = [{"role": "user", "content": "\n".join(lines)}, {"role": "user", "content": TRIGGER},
            {"role": "assistant", "content": answer}]
    ids, labels = _labelled(tokenizer, msgs)
    fork_at = len(message_token_ids(tokenizer, msgs[:1])[0])  # the trigger message's first token
    return {"input_ids": ids, "labels": labels, "is_aux": True, "kind": "delete", "messages": json.dumps(msgs),
            "fork_at": fork_at}


def _main_row(tokenizer, rng: random.Random, words: int) -> dict:
    topic = " ".join(rng.choice(_WORDS) for _ in range(words))
    msgs = [{"role": "user", "content": f"Summarise these steps: {topic}"},
            {"role": "assistant", "content": f"The steps were: {topic}. Next I will {rng.choice(_WORDS)} again."}]
    ids, labels = _labelled(tokenizer, msgs)
    return {"input_ids": ids, "labels": labels, "is_aux": False, "kind": "main", "messages": json.dumps(msgs),
            "fork_at": 0}


def chat_dataset(tokenizer, rows: int = 40, cursors: tuple[int, int] = (8, 40), words: tuple[int, int] = (20, 150),
                 aux_frac: float = 0.5, seed: int = 0) -> DatasetDict:
    """Chat-template rows: aux rows learn `{"del_cursors": [closed cursors]}`, main rows are distilled Q&A."""
    rng = random.Random(seed)
    out = [_aux_row(tokenizer, rng, rng.randint(*cursors)) if i < round(rows * aux_frac)
           else _main_row(tokenizer, rng, rng.randint(*words)) for i in range(rows)]
    return _split(out, seed)
