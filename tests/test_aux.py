"""The auxiliary memory-management thread: constrained JSON, read-only fork, adapter only on the aux side."""

from __future__ import annotations

import json

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.manager.decode import _close, valid_tail
from kvsteward.serve.manager.thread import run_aux
from kvsteward.synth.traces.hindsight import unread_cursors

torch.set_num_threads(1)
OPEN = frozenset({3, 7, 12})


@pytest.mark.parametrize("tail, ok, done", [
    ("", True, False), (" ", True, False), (" [", True, False), ("[", False, False), ("  [", False, False),
    (" []}", True, True), (" [3]}", True, True), ("3", False, False),
])
def test_valid_tail_opening_bracket(tail, ok, done):
    assert valid_tail(tail, OPEN) == (ok, done)


@pytest.mark.parametrize("tail, ok, done", [
    ("", True, False), ("]", True, False), ("]}", True, True), ("3", True, False), ("1", True, False),
    ("12, 3]}", True, True), ("3, ", True, False), ("3,", True, False), ("4", False, False), ("3, 3", False, False),
    ("03", False, False), ("7]", True, False), ("7, ]", False, False), ("7 ", False, False), ("]]", False, False),
    ("12]}x", False, False), ("3, 7, 12", True, False), ("3, 7, 12, ", False, False), ("3, 7, 12]}", True, True),
])
def test_valid_tail_hand_worked(tail, ok, done):
    assert valid_tail(" [" + tail, OPEN) == (ok, done)


def test_close_keeps_only_completed_ids():
    assert _close(" [3, 12, 7") == " [3, 12]}"
    assert _close(" [3, ") == " [3]}"
    assert _close(" [") == " []}"
    assert _close("") == " []}"


@pytest.mark.parametrize("target", [{"del_cursors": []}, {"del_cursors": [3]}, {"del_cursors": [3, 12]},
                                    {"plan": []}, {"plan": [{"cursor": 3, "readers": [13, 14]}]}])
def test_forced_opener_is_a_token_prefix_of_every_training_target(tok, target):
    """The decoder forces `PREFIX` / `PLAN_PREFIX` as tokens and decodes the rest; the model was trained on the whole
    target tokenized as one piece (`synth.traces.hindsight.target_text`). The forced tokens must be exactly the target's
    first tokens, or the model decodes from a token state it never saw in training (` [` then `]}` for an empty list,
    where training has ` []` then `}`). The rest of the target must be a complete tail of the constraint."""
    from kvsteward.serve.manager.decode import PREFIX
    from kvsteward.serve.manager.planner import PLAN_PREFIX, PlanGrammar
    from kvsteward.synth.traces.hindsight import target_text

    text = target_text(target)
    prefix = PREFIX if "del_cursors" in target else PLAN_PREFIX
    forced = tok.encode(prefix, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False)[:len(forced)] == forced
    tail = text[len(prefix):]
    if "del_cursors" in target:
        assert valid_tail(tail, OPEN) == (True, True)
    else:
        g = PlanGrammar([3, 5, 9], boundary=12)
        assert g.done(g.feed(g.start(), tail))


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


@pytest.mark.parametrize("style", ["ids", "notes"])
def test_serving_aux_context_is_the_training_row(engine, tok, style, monkeypatch):
    """The tokens the aux fork holds before its first decoded token (context, trigger with the open ids, assistant
    opener, forced `PREFIX`) are exactly the training row's tokens before the first decision token, in both trigger
    layouts (the server hands the fork the whole message list, pre-masked messages included)."""
    import random

    from kvsteward.serve.manager.decode import PREFIX
    from kvsteward.serve.manager.thread import aux_steps
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.traces import hindsight as hs
    from kvsteward.synth.traces.dataset import HindsightConfig, PieceTokenizer, _aux_at
    from kvsteward.synth.traces.generate import generate_traces

    trace = next(t for t in generate_traces(6, seed=5) if len(t.cursors()) >= 4)
    b = hs.boundaries(trace, 2)[1]
    ctx = hs.aux_context(trace, b, random.Random(0), mask_prob=0.5)
    assert ctx.masked  # a pre-masked cursor: the notes must be read with the served message indices
    cfg = HindsightConfig(every=2, max_tokens=10**6, plan=False, trigger=style)
    row = _aux_at(trace, PieceTokenizer(tok), cfg, ctx)[0]
    monkeypatch.setattr(engine, "trigger_style", style)
    s = engine.session("full")
    for m, ids in zip(ctx.messages, message_token_ids(tok, ctx.messages), strict=True):
        s.append(ids, kind=m["role"])
    assert row["fork_at"] == s.n_logical  # where the aux thread forks (`--adapter-scope aux` trains from there)
    fork = s.fork(shared=True)
    steps = aux_steps(fork, tok, trace.messages[:b], ctx.open_cursors)
    next(steps), next(steps)  # trigger prefill, then the forced opener
    first = next(i for i, t in enumerate(row["labels"]) if t != -100)
    forced = len(tok.encode(PREFIX, add_special_tokens=False))
    assert fork.tokens == row["input_ids"][:first + forced]


def _decode_order(text: str) -> list[int]:
    return json.loads(text)["del_cursors"]


@pytest.mark.parametrize("seed", range(3))
def test_close_bias_lists_a_prefix_of_the_greedy_list(engine, tok, seed):
    """A bias toward closing only moves "close here or list one more id": each higher bias lists a prefix (in decode
    order) of what a lower one lists; a huge bias deletes nothing, a huge negative one every open cursor."""
    torch.manual_seed(100 + seed)
    engine.model.lm_head.weight.data.normal_()
    s = _main(engine, tok)
    open_c = [2, 4]
    lists = [_decode_order(run_aux(s, tok, MESSAGES, open_c, max_tokens=16, close_bias=b, keep_unread=False).text)
             for b in (-1e4, -2.0, 0.0, 2.0, 1e4)]
    assert sorted(lists[0]) == open_c
    assert lists[-1] == []
    for lower, higher in zip(lists, lists[1:], strict=False):
        assert higher == lower[:len(higher)], (lower, higher)
    # 0 is plain greedy: the default decode
    assert lists[2] == _decode_order(run_aux(s, tok, MESSAGES, open_c, max_tokens=16, keep_unread=False).text)


def test_close_bias_must_be_finite():
    from kvsteward.serve.manager.worker import AuxConfig

    with pytest.raises(ValueError, match="close_bias"):
        AuxConfig(close_bias=float("nan")).validate()
    AuxConfig(close_bias=3.0).validate()


def test_unread_cursors_are_the_trailing_tool_messages():
    tool, asst = {"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}
    assert unread_cursors([asst, tool, asst, tool]) == [3]
    assert unread_cursors([asst, tool, tool, tool]) == [1, 2, 3]  # parallel calls: none of them read yet
    assert unread_cursors([asst, tool, asst]) == [] and unread_cursors([]) == []


def test_keep_unread_never_deletes_the_response_the_agent_has_not_read(engine, tok):
    """Even a decoder pushed to delete everything (huge bias against closing) keeps the boundary's own tool response
    (cursor 4, the last message); without `keep_unread` it deletes it too. With nothing else open, no forward runs."""
    torch.manual_seed(7)
    engine.model.lm_head.weight.data.normal_()
    s = _main(engine, tok)
    assert run_aux(s, tok, MESSAGES, [2, 4], max_tokens=16, close_bias=-1e4).del_cursors == [2]
    assert run_aux(s, tok, MESSAGES, [2, 4], max_tokens=16, close_bias=-1e4, keep_unread=False).del_cursors == [2, 4]
    only = run_aux(s, tok, MESSAGES, [4], max_tokens=16, close_bias=-1e4)
    assert only.del_cursors == [] and only.tokens == 0 and json.loads(only.text) == {"del_cursors": []}


def test_the_engine_serves_the_trigger_layout_its_adapter_was_trained_on(tiny_folder, tmp_path, tok):
    """`Engine.load(adapter=...)` reads the adapter's record (`kvsteward.json`, written by `steward train lora`):
    no record means the `ids` layout; `notes` makes the aux fork write the task and the cursor notes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kvsteward.models import ADAPTER_META
    from kvsteward.serve.manager.thread import aux_steps

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    get_peft_model(base, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(tmp_path / "a")
    assert Engine.load(str(tiny_folder), adapter=str(tmp_path / "a")).trigger_style == "ids"
    (tmp_path / "a" / ADAPTER_META).write_text('{"trigger": "notes", "adapter_scope": "aux"}')
    engine = Engine.load(str(tiny_folder), adapter=str(tmp_path / "a"))
    assert engine.trigger_style == "notes"
    fork = _main(engine, tok).fork(shared=True)
    before = len(fork.tokens)
    next(aux_steps(fork, tok, MESSAGES, [2, 4], keep_unread=False))  # the trigger prefill
    trigger = tok.decode(fork.tokens[before:])
    assert "Task: Find the founder of Acme.\nOpen cursors: 2, 4\n2: open(doc 9)\n4: not read yet" in trigger


def test_the_engine_serves_the_aux_context_its_adapter_was_trained_on(tiny_folder, tmp_path):
    """`kvsteward.json` without `aux_context` (adapters before it): the full context; `first` as recorded; an unknown
    value is refused by name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kvsteward.models import ADAPTER_META

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    get_peft_model(base, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_META).write_text('{"trigger": "notes", "adapter_scope": "aux"}')
    assert Engine.load(str(tiny_folder), adapter=str(tmp_path / "a")).aux_context == "full"
    (tmp_path / "a" / ADAPTER_META).write_text('{"trigger": "notes", "adapter_scope": "aux", "aux_context": "first"}')
    assert Engine.load(str(tiny_folder), adapter=str(tmp_path / "a")).aux_context == "first"
    (tmp_path / "a" / ADAPTER_META).write_text('{"trigger": "notes", "aux_context": "task"}')
    with pytest.raises(ValueError, match="aux context must be one of full, first, got 'task'"):
        Engine.load(str(tiny_folder), adapter=str(tmp_path / "a"))


def test_aux_context_first_serves_the_cut_training_row(tok, monkeypatch):
    """With `aux_context == "first"` the aux thread runs on a session holding only the first message, then the
    trigger (notes of every open cursor of the whole session), the opener and the forced `PREFIX`: token for token the
    row `steward train lora --aux-context first` trains on (`first_message_rows` of the hindsight row). The first
    message runs on the base model and the trigger with the adapter, as in training (`--adapter-scope aux`): its
    logits equal a session built by hand that way, and differ from the full-context fork's. The main session is not
    touched."""
    import random

    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from kvsteward.serve.manager import thread as aux_mod
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.traces import hindsight as hs
    from kvsteward.synth.traces.dataset import HindsightConfig, PieceTokenizer, _aux_at
    from kvsteward.synth.traces.generate import generate_traces
    from kvsteward.train.data import first_message_rows

    base = tiny_model("llama", vocab=len(tok), seed=6)
    engine = Engine(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False)), tok, "notes", "first")
    trace = next(t for t in generate_traces(6, seed=5) if len(t.cursors()) >= 4)
    b = hs.boundaries(trace, 2)[1]
    ctx = hs.aux_context(trace, b, random.Random(0), mask_prob=0.0)
    row = _aux_at(trace, PieceTokenizer(tok), HindsightConfig(every=2, max_tokens=10**6, plan=False,
                                                              trigger="notes"), ctx)[0]
    cut = first_message_rows(Dataset.from_list([row]), tok)[0]
    main = engine.session("full")
    for m, ids in zip(ctx.messages, message_token_ids(tok, ctx.messages), strict=True):
        main.append(ids, kind=m["role"])
    key = main.history_key()
    heads = []
    real = aux_mod.first_message_session
    monkeypatch.setattr(aux_mod, "first_message_session", lambda *a: heads.append(real(*a)) or heads[-1])
    fork = main.fork(shared=True)
    fork.config.use_adapter = True
    steps = aux_mod.aux_steps(fork, tok, trace.messages[:b], ctx.open_cursors)
    next(steps), next(steps)  # the first message's prefill, then the trigger's
    (head,) = heads
    served_logits = head.last_logits.clone()
    next(steps)  # the forced opener
    first = next(i for i, t in enumerate(cut["labels"]) if t != -100)
    forced = len(tok.encode(aux_mod.PREFIX, add_special_tokens=False))
    assert head.tokens == cut["input_ids"][:first + forced]
    assert head.tokens[:cut["fork_at"]] == message_token_ids(tok, ctx.messages)[0]

    by_hand = engine.session("full")
    by_hand.append(cut["input_ids"][:cut["fork_at"]], kind="system")
    by_hand.config.use_adapter = True
    by_hand.append(cut["input_ids"][cut["fork_at"]:first], kind="user")
    torch.testing.assert_close(served_logits, by_hand.last_logits)
    wrong = engine.session("full")  # the adapter on the first message too: not what was trained
    wrong.config.use_adapter = True
    wrong.append(cut["input_ids"][:first], kind="user")
    assert not torch.allclose(served_logits, wrong.last_logits)
    engine.aux_context = "full"
    fork = main.fork(shared=True)
    fork.config.use_adapter = True
    next(aux_mod.aux_steps(fork, tok, trace.messages[:b], ctx.open_cursors))
    assert not torch.allclose(served_logits, fork.last_logits)
    assert main.history_key() == key


def test_the_first_message_is_prefilled_once_and_served_bit_for_bit(tok, monkeypatch):
    """`first_message_session` keeps the prefilled first message on the engine: a second decision (another fork, the
    same system prompt) runs no new session's prefill, and its trigger logits are bit for bit those of the first
    decision and of a cold cache. The kept head is never appended to; the cache holds at most `aux_head_tokens`
    tokens, least recently used out (a head longer than the cap is used and not kept)."""
    from peft import LoraConfig, get_peft_model

    from kvsteward.serve.manager import thread as aux_mod
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.traces.generate import generate_traces

    base = tiny_model("llama", vocab=len(tok), seed=6)
    engine = Engine(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False)), tok, "notes", "first")
    trace = next(t for t in generate_traces(6, seed=5) if len(t.cursors()) >= 4)
    msgs = trace.messages[:6]
    opened = [c for c in trace.cursors() if c < 6]
    main = engine.session("full")
    for m, ids in zip(msgs, message_token_ids(tok, msgs), strict=True):
        main.append(ids, kind=m["role"])
    built = []
    real_session = engine.session
    monkeypatch.setattr(engine, "session", lambda *a, **k: built.append(1) or real_session(*a, **k))

    def trigger_logits(messages):
        fork = main.fork(shared=True)
        fork.config.use_adapter = True
        heads = []
        real = aux_mod.first_message_session
        monkeypatch.setattr(aux_mod, "first_message_session", lambda *a: heads.append(real(*a)) or heads[-1])
        steps = aux_mod.aux_steps(fork, tok, messages, opened, keep_unread=False)
        next(steps), next(steps)  # the head, then the trigger's prefill
        monkeypatch.setattr(aux_mod, "first_message_session", real)
        return heads[0].last_logits.clone()

    cold = trigger_logits(msgs)
    assert len(built) == 1 and len(engine.aux_heads) == 1
    warm = trigger_logits(msgs)
    assert len(built) == 1  # no new prefill: the head's rows were copied
    assert torch.equal(cold, warm)
    (head,) = engine.aux_heads.values()
    first = message_token_ids(tok, msgs[:1])[0]
    assert head.tokens == first  # the trigger went into the copies only
    engine.aux_heads.clear()
    assert torch.equal(trigger_logits(msgs), cold) and len(built) == 2

    other = [{**msgs[0], "content": msgs[0]["content"] + " Be brief."}, *msgs[1:]]
    longer = message_token_ids(tok, other[:1])[0]
    engine.aux_head_tokens = len(longer) + 2  # room for one head of the two
    assert not torch.equal(trigger_logits(other), cold)
    assert [k[1] for k in engine.aux_heads] == [tuple(longer)]  # the older head went out
    engine.aux_head_tokens = 1
    assert torch.equal(trigger_logits(msgs), cold) and not engine.aux_heads
    engine.aux_head_tokens = 0  # `steward serve --aux-head-tokens 0`: every decision prefills its own head
    built.clear()
    assert torch.equal(trigger_logits(msgs), cold) and torch.equal(trigger_logits(msgs), cold)
    assert len(built) == 2 and not engine.aux_heads
