"""Tokenize message lists piece by piece (as the engine appends them) and find the assistant tokens to label."""

from __future__ import annotations

from typing import Any

from kvsteward.synth.chat import generation_prompt, message_texts

IGNORE = -100


class PieceTokenizer:
    """`kvsteward.synth.chat.message_token_ids` with a cache: aux examples re-tokenize the same messages many times."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if text not in self._cache:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            self._cache[text] = (list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])
        return self._cache[text]

    def pieces(self, messages: list[dict[str, Any]]) -> list[list[int]]:
        return [self.encode(t)[0] for t in message_texts(self.tokenizer, messages)]

    def tokenize(self, messages: list[dict[str, Any]], label_steps: set[int]) -> tuple[list[int], list[int], list[int]]:
        """(input_ids, labels, per-message start offsets). Messages in `label_steps` (assistant turns) are labelled on
        their content and end-of-turn marker; the role header and the trailing newline stay -100."""
        texts = message_texts(self.tokenizer, messages)
        ids, labels, starts = [], [], []
        for i, text in enumerate(texts):
            tok, offs = self.encode(text)
            starts.append(len(ids))
            ids.extend(tok)
            if i in label_steps:
                lo, hi = self._content_range(messages, i, text)
                labels.extend(t if (a >= lo and b <= hi) else IGNORE for t, (a, b) in zip(tok, offs, strict=True))
            else:
                labels.extend([IGNORE] * len(tok))
        return ids, labels, starts

    def _content_range(self, messages: list[dict[str, Any]], i: int, text: str) -> tuple[int, int]:
        header = generation_prompt(self.tokenizer, messages[:i]) if i else ""
        content = messages[i].get("content") or ""
        lo = len(header) if header and text.startswith(header) else max(text.find(content), 0)
        return lo, len(text.rstrip())


def slot_tokens(offsets: list[tuple[int, int]], char_ends: list[int]) -> list[int]:
    """The token index holding the character just before each of `char_ends` (a score slot's last character, e.g.
    the `?` of `hindsight.SLOT_MARK`) in a text tokenized with these offsets: where the next-token logits are read."""
    out = []
    for e in char_ends:
        hit = next((i for i, (a, b) in enumerate(offsets) if a < e <= b), None)
        if hit is None:
            raise ValueError(f"no token covers character {e - 1} of the trigger")
        out.append(hit)
    return out


def answer_ids(tokenizer, answers: tuple[str, ...]) -> tuple[int, ...]:
    """Each answer's token id; refused when an answer is not one token of this tokenizer (its score would need a
    decode, not one logit)."""
    out = []
    for a in answers:
        ids = tokenizer.encode(a, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"answer {a!r} is {len(ids)} tokens for this tokenizer; the scores trigger needs one each")
        out.append(ids[0])
    return tuple(out)


def offsets(pieces: list[list[int]]) -> list[int]:
    """Start token of each piece plus the total length at the end."""
    out = [0]
    for p in pieces:
        out.append(out[-1] + len(p))
    return out
