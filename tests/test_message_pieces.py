"""`message_pieces` cuts each message's tokens from the chat template's renderings: the windowed (linear) path must
give exactly the exact rule's pieces (one render per growing prefix), and hand over to it where it cannot."""

from __future__ import annotations

import copy
import random

import pytest

from kvsteward.serve.engine import ops
from kvsteward.serve.engine.ops import message_pieces, normalize_messages
from kvsteward.synth.chat import message_token_ids

TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the web",
                                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    from kvsteward.models import load_tokenizer

    return load_tokenizer("smollm2")


def conversation(seed: int, n: int, system: bool) -> list[dict]:
    rng = random.Random(seed)
    out = [{"role": "system", "content": "You are an agent."}] if system else []
    words = ["alpha", "beta", "ticket", "7", "é", "日本", "\n", "  ", "<tag>", "{json}"]
    for i in range(n):
        role = ["user", "assistant", "tool"][i % 3] if rng.random() < 0.8 else rng.choice(["user", "assistant"])
        out.append({"role": role, "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))})
    return normalize_messages(out)


def exact(tok, messages, tools, start):
    return [tok.encode(x, add_special_tokens=False) for x in ops._prefix_texts(tok, messages, tools, start)]


@pytest.mark.parametrize("seed", range(6))
def test_windowed_pieces_are_the_exact_rules(tok, seed):
    messages = conversation(seed, 30 + seed * 7, system=seed % 2 == 0)
    tools = TOOLS if seed % 3 == 0 else None
    for start in (0, 1, 5, len(messages) - ops.WINDOWED_FROM):
        assert ops._windowed_texts(tok, messages, tools, start) is not None  # SmolLM2's template: the fast path
        assert message_pieces(tok, messages, tools, start) == exact(tok, messages, tools, start)
    assert message_pieces(tok, messages, tools) == message_token_ids(tok, messages, tools)


def test_the_windowed_path_renders_linearly(tok, monkeypatch):
    """Messages rendered in all, over every template call: linear in the count (the exact rule: n^2 / 2)."""
    rendered = {"n": 0}
    inner = ops._render

    def counting(tokenizer, messages, tools, add_generation_prompt=False):
        rendered["n"] += len(messages)
        return inner(tokenizer, messages, tools, add_generation_prompt)

    monkeypatch.setattr(ops, "_render", counting)
    messages = conversation(9, 400, system=True)
    message_pieces(tok, messages)
    assert rendered["n"] <= 8 * len(messages)


def test_a_template_that_depends_on_more_context_takes_the_exact_rule(tok):
    """A template numbering the messages: a window renders every message as number 2, so the texts do not rebuild
    the whole rendering; the exact rule gives the pieces."""
    numbered = copy.copy(tok)
    numbered.chat_template = ("{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n"
                              "{% endfor %}{% if add_generation_prompt %}[next] assistant:{% endif %}")
    messages = conversation(3, 20, system=False)
    assert ops._windowed_texts(numbered, messages, None, 0) is None
    pieces = message_pieces(numbered, messages)
    assert pieces == exact(numbered, messages, None, 0)
    assert numbered.decode(pieces[11], skip_special_tokens=False).startswith("[12] ")
