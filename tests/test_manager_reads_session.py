"""The served manager decides from the session it forks: its deletion probabilities move when the session's content
moves (the default, `aux_context="full"`), and do not under the `first` ablation, which reads only the first
message. The content swap keeps everything the trigger shows (ids, message count, roles) and changes only what is
inside the tool responses."""

from __future__ import annotations

import random

import torch

from kvsteward.serve.engine import Engine
from kvsteward.serve.manager import run_aux
from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.traces.envs import generate
from kvsteward.synth.traces.toolcall import cursor_body, cursor_content

torch.set_num_threads(1)


def _engine(tok, aux_context: str) -> Engine:
    from peft import LoraConfig, get_peft_model

    from kvsteward.models import tiny_model

    base = tiny_model("llama", vocab=len(tok), seed=4)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return Engine(lora, tok, "ids", aux_context)


def _scrambled(messages: list[dict], seed: int) -> list[dict]:
    """The same session with every tool response's body replaced by random words (tags and roles kept)."""
    r = random.Random(seed)
    words = [w for m in messages for w in (m.get("content") or "").split()]
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            n = len(cursor_body(m["content"]).split())
            m = {**m, "content": cursor_content(i, " ".join(r.choice(words) for _ in range(n)))}
        out.append(m)
    return out


def _confidences(engine, tok, messages, open_c):
    s = engine.session("full")
    for m, ids in zip(messages, message_token_ids(tok, messages), strict=True):
        s.append(ids, kind=m["role"])
    d = run_aux(s, tok, messages, open_c, max_tokens=16, min_confidence=0.5)
    return d.confidence


def test_the_default_manager_reads_the_session_and_the_first_message_ablation_does_not(tok):
    trace = next(t for t in generate("ops", 6, 3) if len(t.cursors()) >= 4)
    b = trace.cursors()[3] + 1
    messages = trace.messages[:b]
    open_c = [c for c in trace.cursors() if c < b]
    other = _scrambled(messages, 1)
    for aux_context, moves in (("full", True), ("first", False)):
        engine = _engine(tok, aux_context)
        real, fake = _confidences(engine, tok, messages, open_c), _confidences(engine, tok, other, open_c)
        assert set(real) == set(fake) and real
        diff = max(abs(real[c] - fake[c]) for c in real)
        assert (diff > 1e-4) == moves, (aux_context, diff)
