"""The auxiliary memory-management thread: constrained JSON, read-only fork, adapter only on the aux side."""

from __future__ import annotations

import json

import pytest
import torch

from kvsteward.models import load_tokenizer, tiny_model
from kvsteward.serve.aux import _close, run_aux, valid_tail
from kvsteward.serve.engine import Engine

torch.set_num_threads(1)
OPEN = frozenset({3, 7, 12})


@pytest.mark.parametrize("tail, ok, done", [
    ("", True, False), ("]", True, False), ("]}", True, True), ("3", True, False), ("1", True, False),
    ("12, 3]}", True, True), ("3, ", True, False), ("3,", True, False), ("4", False, False), ("3, 3", False, False),
    ("03", False, False), ("7]", True, False), ("7, ]", False, False), ("7 ", False, False), ("]]", False, False),
    ("12]}x", False, False), ("3, 7, 12", True, False), ("3, 7, 12, ", False, False), ("3, 7, 12]}", True, True),
])
def test_valid_tail_hand_worked(tail, ok, done):
    assert valid_tail(tail, OPEN) == (ok, done)


def test_close_keeps_only_completed_ids():
    assert _close("3, 12, 7") == "3, 12]}"
    assert _close("3, ") == "3]}"
    assert _close("") == "]}"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def engine(tok):
    return Engine(tiny_model("llama", vocab=len(tok), seed=4), tok)


MESSAGES = [{"role": "user", "content": "Find the founder of Acme."},
            {"role": "assistant", "content": "search(Acme)"}, {"role": "tool", "content": "[cursor 2] Acme ..."},
            {"role": "assistant", "content": "open(doc 9)"}, {"role": "tool", "content": "[cursor 4] founded by X"}]


def _main(engine, tok):
    from kvsteward.synth.chat import message_token_ids

    s = engine.session("full")
    for m, ids in zip(MESSAGES, message_token_ids(tok, MESSAGES), strict=True):
        s.append(ids, kind=m["role"])
    return s


@pytest.mark.parametrize("seed", range(4))
def test_aux_output_always_parses_to_open_ids_and_main_is_untouched(engine, tok, seed):
    torch.manual_seed(seed)
    engine.model.lm_head.weight.data.normal_()  # a different random model each time: the constraint must hold
    s = _main(engine, tok)
    key, n = s.history_key(), s.table.n
    k0 = s.table.k[0][:, :n].clone()
    decision = run_aux(s, tok, MESSAGES, open_cursors=[2, 4], max_tokens=12)
    parsed = json.loads(decision.text)
    assert set(parsed["del_cursors"]) <= {2, 4} and len(set(parsed["del_cursors"])) == len(parsed["del_cursors"])
    assert decision.del_cursors == sorted(parsed["del_cursors"])
    assert s.history_key() == key and s.table.n == n and torch.equal(s.table.k[0][:, :n], k0)


def test_adapter_runs_only_on_the_aux_side(tok):
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", vocab=len(tok), seed=5)
    plain = Engine(base, tok)
    ref = _main(plain, tok).last_logits.clone()
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False))
    eng = Engine(peft, tok)
    assert eng.is_peft
    main = _main(eng, tok)
    torch.testing.assert_close(main.last_logits, ref)  # main thread: base model, adapter off
    aux = main.fork()
    aux.config.use_adapter = True
    assert main.config.use_adapter is False  # forks do not share config
    aux.append([5, 6], kind="user")
    main.append([5, 6], kind="user")
    assert not torch.allclose(aux.last_logits, main.last_logits)
