"""The learned manager inside a real SGLang server, against the kvsteward engine on the same session.

SmolLM2 (fp32, real weights) served by `python -m sglang.launch_server` with LoRA (`--lora-paths mgr=ADAPTER`,
torch_native LoRA backend on CPU) and the kvsteward backend; the adapter is a LoRA made here the way `steward train`
makes one (`train.lora.wrap_lora`, top layers only: `layers_to_transform`), with random B so that it changes the
decode. The aux fork (`serve.sglang.manager.SglangManager`) is a LoRA request carrying the main's op history: it
must decide exactly what `run_aux` decides on the engine (the decode `steward serve`'s worker runs; tests/
test_serve_aux.py checks the server's decision is `run_aux` on the boundary state), read the main's cached prefix
(not recompute it, not with the adapter), cache nothing of its own, and its drop on the main's next request must
give the engine's tokens.
"""

from __future__ import annotations

import json

import pytest
import requests
import torch

from kvsteward.serve.server.testing import free_port
from kvsteward.serve.sglang.launch import SglangServer, server_command
from kvsteward.serve.sglang.manager import SglangManager
from kvsteward.serve.sglang.ops import SglangHistory

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Find the owner of ticket 7."},
            {"role": "assistant", "content": "I will search."},
            {"role": "tool", "content": "[cursor 3] ticket 7: printer broken, owner unknown"},
            {"role": "assistant", "content": "Look up the team."},
            {"role": "tool", "content": "[cursor 5] team roster: Ann owns printers"}]
OPEN = [3, 5]


def make_adapter(path, std: float = 0.5):
    from transformers import AutoModelForCausalLM

    from kvsteward.models import resolve, write_adapter_meta
    from kvsteward.train.lora import LoraRunConfig, wrap_lora

    base = AutoModelForCausalLM.from_pretrained(resolve("smollm2"), dtype=torch.float32)
    torch.manual_seed(0)  # lora_A's init draws from the global generator: the same adapter in any test order
    model = wrap_lora(base, LoraRunConfig(data="-", out="-", rank=8, alpha=16, top_layers=6))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * std
    model.save_pretrained(path)
    write_adapter_meta(path, {"trigger": "ids", "adapter_scope": "aux", "aux_context": "full"})
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from kvsteward.models import resolve
    from kvsteward.serve.engine import Engine

    torch.set_num_threads(1)
    adapter = make_adapter(tmp_path_factory.mktemp("adapter"))
    port = free_port()
    cmd = server_command(resolve("smollm2"), port, max_total_tokens=8192, lora={"mgr": str(adapter)}, lora_rank=8)
    server = SglangServer(cmd, port, log=tmp_path_factory.mktemp("log") / "server.log")
    server.start()
    engine = Engine.load("smollm2", adapter=str(adapter))
    try:
        yield server, engine, adapter
    finally:
        server.kill()


def main_ids(tok):
    from kvsteward.synth.chat import generation_prompt, message_token_ids

    ids = message_token_ids(tok, MESSAGES)
    prompt = tok.encode(generation_prompt(tok, MESSAGES), add_special_tokens=False)
    return ids, prompt


def main_turn(server, ids, prompt) -> SglangHistory:
    """The main turn up to the boundary's tool response, then one token of its reply, sent to the server (its
    state cached in the tree); returns the history the forks continue."""
    history = SglangHistory()
    body = history.fields([*ids, prompt])
    body["sampling_params"].update({"max_new_tokens": 1, "temperature": 0.0})
    requests.post(f"{server.url}/generate", json=body, timeout=300).raise_for_status()
    return history


def main_session(engine, ids):
    s = engine.session("full")
    for m in ids:
        s.append(m, logits="last")
    return s


def test_the_fork_decides_what_the_engine_decides_with_the_adapter(served):
    from kvsteward.serve.manager.thread import run_aux

    server, engine, adapter = served
    tok = engine.tokenizer
    ids, prompt = main_ids(tok)
    history = main_turn(server, ids, prompt)
    main_prefix = sum(len(m) for m in ids)
    decisions = {}
    for keep_unread in (False, True):
        mgr = SglangManager.for_adapter(tok, str(adapter), "mgr", keep_unread=keep_unread, max_tokens=16)
        fork = mgr.fork_body(history, MESSAGES, ids, None, OPEN)
        assert fork["lora_path"] == "mgr" and '"base"' in fork["sampling_params"]["custom_params"]["kvsteward"]
        out = requests.post(f"{server.url}/generate", json=fork, timeout=300).json()
        got = mgr.decision(out["output_ids"])
        want = run_aux(main_session(engine, ids), tok, MESSAGES, OPEN, max_tokens=16, use_adapter=True,
                       keep_unread=keep_unread)
        assert (got.text, got.tokens, got.del_cursors) == (want.text, want.tokens, want.del_cursors), keep_unread
        # it read the main's state from the tree (the base model's K/V: the fork's prefix is the main's path), and
        # computed only the trigger (with the adapter)
        assert out["meta_info"]["cached_tokens"] == main_prefix, out["meta_info"]
        decisions[keep_unread] = got
    assert decisions[True].del_cursors == [3]  # 5 is unread: never offered
    # the adapter made the difference: the base model as its own manager decodes another token sequence
    base = run_aux(main_session(engine, ids), tok, MESSAGES, OPEN, max_tokens=16, use_adapter=False,
                   keep_unread=False)
    assert (base.text, base.tokens) != (decisions[False].text, decisions[False].tokens)
    # nothing the fork computed entered the tree: the same tokens as a plain request reuse only the main's prefix
    fork_tokens = SglangManager.for_adapter(tok, str(adapter), "mgr", max_tokens=16).fork_body(
        None, MESSAGES, ids, None, OPEN)["input_ids"]
    plain = requests.post(f"{server.url}/generate", json={
        "input_ids": fork_tokens, "sampling_params": {"max_new_tokens": 1}}, timeout=300).json()
    main_cached = [t for m in ids for t in m] + prompt  # what the main turn left in the tree
    common = next(i for i, (a, b) in enumerate(zip(fork_tokens, main_cached, strict=False)) if a != b)
    assert common == main_prefix + 1  # (`<|im_start|>`, the first token of both the trigger and the reply prompt)
    assert plain["meta_info"]["cached_tokens"] == common


def test_the_decision_is_the_main_s_next_drop(served):
    """The agent loop on SGLang: main turn (reply generated), the fork's decision, the main's next turn with the
    decision as a drop right after the reply (the state through the reply sealed first): the main's tokens equal the
    engine's session with the same reply, the same drop and the same new messages."""
    server, engine, adapter = served
    tok = engine.tokenizer
    ids, prompt = main_ids(tok)
    history = SglangHistory()
    mgr = SglangManager.for_adapter(tok, str(adapter), "mgr", keep_unread=True, max_tokens=16)
    body = history.fields([*ids, prompt])
    body["sampling_params"].update({"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    reply = requests.post(f"{server.url}/generate", json=body, timeout=300).json()["output_ids"]
    decision = mgr.decide(server.url, history, MESSAGES, ids, None, OPEN)
    assert decision.del_cursors == [3]
    closing = tok.encode("<|im_end|>\n", add_special_tokens=False)
    assistant = prompt + reply + closing
    seal = history.fields([*ids, assistant])  # the tree must hold the state through the reply before the drop
    seal["sampling_params"].update({"max_new_tokens": 1})
    requests.post(f"{server.url}/generate", json=seal, timeout=300).raise_for_status()
    user = tok.encode("<|im_start|>user\nWho is it?<|im_end|>\n", add_special_tokens=False)
    messages = [*ids, assistant, user, prompt]
    cache = {"drop": {str(len(ids)): decision.del_cursors}}
    nxt = history.fields(messages, cache)
    nxt["sampling_params"].update({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    out = requests.post(f"{server.url}/generate", json=nxt, timeout=300).json()
    s = main_session(engine, [*ids, assistant])
    start = sum(len(m) for m in ids[:3])
    s.drop(list(range(start, start + len(ids[3]))))
    s.append(user, logits=None)
    s.append(prompt, logits="last")
    assert out["output_ids"] == s.generate(8)
    assert out["meta_info"]["cached_tokens"] >= sum(len(m) for m in ids) + len(assistant) - len(ids[3])
    assert json.loads(nxt["sampling_params"]["custom_params"]["kvsteward"])["cache"]["drop"] == {"6": [3]}


def test_the_confidence_rule_on_sglang_is_the_engine_s(served):
    """An adapter calibrated with `min_confidence`: the branch walk driven by one-token requests (the candidates'
    log-probabilities) gives the engine's confidences and decision on the same boundary, branch for branch."""
    from kvsteward.serve.manager.thread import run_aux

    server, engine, adapter = served
    tok = engine.tokenizer
    ids, prompt = main_ids(tok)
    history = main_turn(server, ids, prompt)
    for close_bias in (0.0, -3.0):  # a negative bias keeps lists open: more branches
        mgr = SglangManager.for_adapter(tok, str(adapter), "mgr", keep_unread=False, max_tokens=16,
                                        min_confidence=0.5, close_bias=close_bias)
        branch = mgr.branch_body(history, MESSAGES, ids, None, OPEN, [])
        assert branch["lora_path"] == "mgr" and "custom_logit_processor" not in branch
        got = mgr.decide(server.url, history, MESSAGES, ids, None, OPEN)
        want = run_aux(main_session(engine, ids), tok, MESSAGES, OPEN, max_tokens=16, use_adapter=True,
                       keep_unread=False, min_confidence=0.5, close_bias=close_bias)
        assert want.tokens >= 2  # the walk branched: more than one list was decoded
        assert (got.del_cursors, got.tokens, got.truncated) == (want.del_cursors, want.tokens, want.truncated)
        assert got.confidence.keys() == want.confidence.keys()
        for c in OPEN:
            assert abs(got.confidence[c] - want.confidence[c]) < 1e-3, (c, got.confidence, want.confidence)


def test_a_per_response_adapter_on_sglang_reads_the_engine_s_p_no(served):
    """A `scores` adapter on SGLang: one request, the fork with the scores trigger and the answers' log-probabilities
    at every trigger position; each open response's P(no) at its slot is the engine's (`run_aux` on the same
    boundary), the decision at a threshold between them too, and the fork read the main's cached prefix."""
    from kvsteward.serve.manager.thread import run_aux

    server, engine, adapter = served
    tok = engine.tokenizer
    ids, prompt = main_ids(tok)
    history = main_turn(server, ids, prompt)
    engine.trigger_style = "scores"  # the same LoRA, read as a per-response adapter (its slots' yes / no logits)
    try:
        want = run_aux(main_session(engine, ids), tok, MESSAGES, OPEN, use_adapter=True, keep_unread=False)
        assert set(want.confidence) == set(OPEN)
        middle = sum(want.confidence.values()) / 2  # a threshold that keeps one response and deletes the other
        assert abs(want.confidence[3] - want.confidence[5]) > 1e-3
        for threshold in (None, middle):
            mgr = SglangManager(tok, lora="mgr", trigger_style="scores", keep_unread=False, min_confidence=threshold)
            got = mgr.decide(server.url, history, MESSAGES, ids, None, OPEN)
            ref = run_aux(main_session(engine, ids), tok, MESSAGES, OPEN, use_adapter=True, keep_unread=False,
                          min_confidence=threshold)
            for c in OPEN:
                assert abs(got.confidence[c] - ref.confidence[c]) < 1e-3, (c, got.confidence, ref.confidence)
            assert got.del_cursors == ref.del_cursors, threshold
        assert len(got.del_cursors) == 1  # at the middle threshold
        req, _ = mgr.scores_body(history, MESSAGES, ids, None, OPEN)
        assert req["lora_path"] == "mgr" and "custom_logit_processor" not in req
        out = requests.post(f"{server.url}/generate", json=req, timeout=300).json()
        assert out["meta_info"]["cached_tokens"] == sum(len(m) for m in ids), out["meta_info"]
    finally:
        engine.trigger_style = "ids"


def test_the_stack_on_sglang_decides_as_on_the_engine(served):
    """The stack (structure trees over a per-response adapter's P(no)) on SGLang: the per-response request, then the
    head; the same decision and scores as the engine's `StackManager` on a fork of the same boundary."""
    import numpy as np

    from kvsteward.serve.manager.decode import drive
    from kvsteward.serve.manager.stack import StackManager
    from kvsteward.synth.traces.baselines import StackClassifier
    from kvsteward.synth.traces.decisions import Decision
    from kvsteward.synth.traces.structure import FEATURES

    server, engine, adapter = served
    tok = engine.tokenizer
    ids, prompt = main_ids(tok)
    history = main_turn(server, ids, prompt)
    rng = np.random.default_rng(0)  # a head that follows the score: delete when P(no) is high
    train = [Decision(f"t{i % 8}", "x", 4, i, p > 0.5, "", "task", "body", "note", "call", 1, 0,
                      tuple(float(v) for v in rng.normal(size=len(FEATURES))), p)
             for i, p in enumerate(rng.uniform(size=200))]
    stack = StackManager(StackClassifier().fit(train))
    engine.trigger_style = "scores"
    try:
        fork = main_session(engine, ids).fork(shared=True)
        fork.config.use_adapter = True
        want = drive(stack.steps(fork, tok, MESSAGES, OPEN))
        mgr = SglangManager(tok, lora="mgr", trigger_style="scores", rule=stack)
        got = mgr.decide(server.url, history, MESSAGES, ids, None, OPEN)
    finally:
        engine.trigger_style = "ids"
    assert got.del_cursors == want.del_cursors and got.confidence.keys() == want.confidence.keys() == {3}
    assert abs(got.confidence[3] - want.confidence[3]) < 1e-3
