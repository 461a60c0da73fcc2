"""Render a message list into per-message token ids with the model's own chat template.

The engine appends one message per step, so a session's token stream is the concatenation of per-message pieces.
Pieces are cut from the template's own rendering of growing prefixes (any prefix-stable template works), so the
concatenation equals the template's rendering of the whole conversation.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def _render(tokenizer, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def message_texts(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> list[str]:
    """Text of each message as the template renders it in context (the first piece includes any preamble)."""
    pieces, prev = [], ""
    for i in range(len(messages)):
        full = _render(tokenizer, messages[: i + 1], tools)
        if not full.startswith(prev):
            raise ValueError(f"chat template is not prefix-stable at message {i}: cannot split it into pieces")
        pieces.append(full[len(prev):])
        prev = full
    return pieces


def message_token_ids(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> list[list[int]]:
    """Token ids of each message piece; their concatenation is the session's logical token stream."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in message_texts(tokenizer, messages, tools)]


def generation_prompt(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> str:
    """The text the template adds to open an assistant turn after `messages` (e.g. `<|im_start|>assistant\\n`)."""
    return _render(tokenizer, messages, tools, add_generation_prompt=True)[len(_render(tokenizer, messages, tools)):]
