"""Greedy decoding on an engine session, as a stream of text deltas with OpenAI stop semantics.

Each decode step is one forward under the engine lock, so concurrent requests interleave token by token. Text is
released only when it can no longer become part of a stop string (or of an unfinished UTF-8 character), so a
streamed reply equals the non-streamed one and never shows a stop string.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class Decoder:
    session: object  # kvsteward.serve.engine.session.Session, already holding the prompt and the generation prompt
    tokenizer: object
    lock: object
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    append_last: bool = False  # also append the final token (a persistent session keeps every generated token)
    tokens: list[int] = field(default_factory=list)  # generated tokens, stop token excluded
    text: str = ""
    finish_reason: str | None = None

    def _stop_cut(self, text: str) -> int | None:
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return min(cuts) if cuts else None

    def _holdback(self, text: str) -> int:
        """Characters at the end of `text` that might still turn into a stop string or a complete character."""
        hold = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its remaining bytes
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return hold

    def _step(self, tok: int) -> None:
        with self.lock:
            self.session.append([tok], kind="assistant", continue_message=True, logits=None)

    def __iter__(self) -> Iterator[str]:
        emitted = 0
        for i in range(self.max_new_tokens):
            tok = int(torch.argmax(self.session.last_logits))
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.tokens.append(tok)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            cut = self._stop_cut(text)
            if cut is not None:
                self.text, self.finish_reason = text[:cut], "stop"
                if self.append_last:
                    self._step(tok)
                break
            self.text = text
            safe = len(text) - self._holdback(text)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if i + 1 < self.max_new_tokens or self.append_last:
                self._step(tok)
        else:
            self.finish_reason = "length"
        if len(self.text) > emitted:
            yield self.text[emitted:]

    def run(self) -> str:
        for _ in self:
            pass
        return self.text
