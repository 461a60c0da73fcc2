"""`--adapter-scope aux`: the trainer's loss is the one the serving engine computes — main context through the base
model, only the aux fork with the adapter (`serve/engine/session.py`) — for per-boundary rows and packed rows alike."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from kvsteward.models import adapter_meta, tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.dataset import HindsightConfig, _aux_at
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.packed import packed_row
from kvsteward.synth.traces.tokens import PieceTokenizer
from kvsteward.train.data import Collator, DataError, check_fork_points, first_message_rows
from kvsteward.train.lora import LoraRunConfig, training_args, wrap_lora
from kvsteward.train.trainer import StewardTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trace():
    return next(t for t in generate_traces(8, seed=5) if len(hs.boundaries(t, 1)) >= 4)


def _moved_lora(tok, tmp_path, seed: int = 4):
    """A PEFT tiny Llama whose adapter is far from zero (LoRA B starts at 0, which would hide the scope)."""
    cfg = LoraRunConfig(data="-", out=str(tmp_path), rank=4, alpha=8, dropout=0.0, max_steps=1, batch_size=1)
    model = wrap_lora(tiny_model("llama", vocab=len(tok), seed=seed, layers=3), cfg)
    g = torch.Generator().manual_seed(seed)
    for name, w in model.named_parameters():
        if "lora_B" in name:
            w.data = torch.randn(w.shape, generator=g) * 0.5
    return model.eval(), cfg


def _trainer(model, cfg, tmp_path, scope: str) -> StewardTrainer:
    ds = Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "is_aux": True, "fork_at": 1}])
    return StewardTrainer(model=model, args=training_args(cfg, tmp_path / "ck"), train_dataset=ds,
                          data_collator=Collator(pad_id=0), adapter_scope=scope)


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction="sum")


def test_per_boundary_row_loss_is_the_serving_fork(tmp_path, tok, trace):
    """CE of a deletion row = CE of the same target under the engine's aux fork: main session on the base model,
    the fork (trigger, opener, target) with the adapter. Scope `all` gives another number (the test can fail)."""
    b = hs.boundaries(trace, 2)[1]
    ctx = hs.aux_context(trace, b, random.Random(0), mask_prob=0.5)
    row = _aux_at(trace, PieceTokenizer(tok), HindsightConfig(every=2, max_tokens=10**6, plan=False), ctx)[0]
    model, cfg = _moved_lora(tok, tmp_path)

    s = Engine(model, tok).session("full")
    for m, ids in zip(ctx.messages, message_token_ids(tok, ctx.messages), strict=True):
        s.append(ids, kind=m["role"])
    f = row["fork_at"]
    assert s.n_logical == f
    fork = s.fork(shared=True)
    fork.config.use_adapter = True
    logits = fork.append(row["input_ids"][f:], kind="user", logits="all")  # logits[k] predicts token f + k + 1
    labels = torch.tensor(row["labels"])
    j = (labels != -100).nonzero()[:, 0]
    assert j.min() > f
    ref = _ce(logits[j - f - 1], labels[j]) / len(j)

    batch = Collator(pad_id=0)([row])
    with torch.no_grad():
        _, parts = _trainer(model, cfg, tmp_path, "aux").compute_loss(model, batch, return_outputs=True)
        _, everywhere = _trainer(model, cfg, tmp_path, "all").compute_loss(model, batch, return_outputs=True)
    assert torch.allclose(parts["ce_aux"], ref, rtol=1e-4), (parts["ce_aux"], ref)
    # the adapter on the context changes the loss by far more than the float noise between the two aux paths
    assert (everywhere["ce_aux"] - ref).abs() > 1e-2 > 100 * (parts["ce_aux"] - ref).abs()
    assert "kl_main" not in parts


def test_packed_row_loss_is_the_serving_forks(tmp_path, tok, trace):
    """A packed row in scope aux: the trunk (with the history's drops and position gaps) through the base model,
    each branch with the adapter = the engine's main session plus one adapter fork per call."""
    row = packed_row(trace, PieceTokenizer(tok), every=1, mask_prob=0.5, seed=3, plan=False)
    assert row["dropped_at"]
    model, cfg = _moved_lora(tok, tmp_path, seed=6)
    seg, time, ids, labels = (torch.tensor(row[k]) for k in ("segment", "time", "input_ids", "labels"))
    s = Engine(model, tok).session("full")
    span: dict[int, tuple[int, int]] = {}
    total, count, i = torch.zeros(()), 0, 0
    for m, msg in enumerate(trace.messages):
        while seg[i] > 0:  # each call at boundary m on its own adapter fork
            here = (seg == seg[i]).nonzero().view(-1)
            fork = s.fork(shared=True)
            fork.config.use_adapter = True
            logits = fork.append(ids[here].tolist(), kind="user", logits="all")
            lab = labels[here]
            k = (lab[1:] != -100).nonzero()[:, 0] + 1
            total, count = total + _ce(logits[k - 1], lab[k]), count + len(k)
            i = int(here[-1]) + 1
        for c in [c for c, d in row["dropped_at"].items() if d == m]:
            s.drop(list(range(*span[c])))
        end = i
        while end < len(ids) and seg[end] == 0 and time[end] == 2 * m:
            end += 1
        span[m] = (s.n_logical, s.n_logical + end - i)
        s.append(ids[i:end].tolist(), kind=msg["role"])
        i = end
    assert count > 0

    cols = ("input_ids", "labels", "position_ids", "segment", "time", "expire")
    batch = Collator(pad_id=0)([{**{c: row[c] for c in cols}, "is_aux": True}])
    with torch.no_grad():
        _, parts = _trainer(model, cfg, tmp_path, "aux").compute_loss(model, batch, return_outputs=True)
    assert torch.allclose(parts["ce_aux"], total / count, rtol=1e-4), (parts["ce_aux"], total / count)


def test_aux_scope_backpropagates_and_averages_over_target_tokens(tmp_path, tok):
    """Gradients reach the LoRA weights; a batch of two rows of different lengths (padding) equals the mean over
    its rows' own target tokens; a batch without aux-thread tokens gives a zero loss that still backpropagates."""
    model, cfg = _moved_lora(tok, tmp_path)
    trainer = _trainer(model, cfg, tmp_path, "aux")
    g = random.Random(1)
    rows = []
    for n in (12, 20):
        ids = [g.randrange(5, len(tok) - 1) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [-100] * (n - 3) + ids[-3:], "is_aux": True, "fork_at": n - 5})
    both = trainer.compute_loss(model, Collator(pad_id=0)(rows))
    both.backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for n_, w in model.named_parameters()
               if "lora_A" in n_)
    with torch.no_grad():
        one = [trainer.compute_loss(model, Collator(pad_id=0)([r])) for r in rows]
    assert torch.allclose(both.detach(), (one[0] + one[1]) / 2, rtol=1e-5)  # 3 targets each
    main = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "is_aux": False, "fork_at": 0}
    zero = trainer.compute_loss(model, Collator(pad_id=0)([main]))
    assert zero.item() == 0.0 and zero.requires_grad


def test_rows_sharing_a_context_reuse_its_cache_exactly(tmp_path, tok):
    """Rows cut to the same first message run their context through the base model once: loss and LoRA gradients
    equal those of a trainer that recomputes it per row (reuse off), the reused cache is not changed by the aux
    forwards that extend it (a second batch gives the same numbers), and a different context is recomputed."""
    model, cfg = _moved_lora(tok, tmp_path)
    g = random.Random(2)
    ctx = [g.randrange(5, len(tok) - 1) for _ in range(9)]
    rows = []
    for n in (6, 10):
        own = [g.randrange(5, len(tok) - 1) for _ in range(n)]
        rows.append({"input_ids": ctx + own, "labels": [-100] * (len(ctx) + n - 3) + own[-3:], "is_aux": True,
                     "fork_at": len(ctx)})
    batch = Collator(pad_id=0)(rows)

    def run(trainer):
        calls = []
        hook = model.get_base_model().model.register_forward_hook(lambda *a: calls.append(1))
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        hook.remove()
        grads = {n_: w.grad.clone() for n_, w in model.named_parameters() if w.requires_grad}
        return loss.detach(), grads, len(calls)

    reusing = _trainer(model, cfg, tmp_path, "aux")
    fresh = _trainer(model, cfg, tmp_path / "fresh", "aux")
    fresh._share_trunk = False  # the base counts as possibly random: every context is recomputed
    (l1, g1, c1), (l2, g2, c2), (l0, g0, c0) = run(reusing), run(reusing), run(fresh)
    assert (c1, c2, c0) == (3, 2, 4)  # 2 aux forwards + 1 context forward, then the context from the cache
    assert torch.allclose(l1, l0, rtol=1e-6) and torch.allclose(l2, l0, rtol=1e-6)
    for name, grad in g0.items():
        assert torch.allclose(g1[name], grad, rtol=1e-5, atol=1e-7), name
        assert torch.allclose(g2[name], grad, rtol=1e-5, atol=1e-7), name
    other = [{**rows[0], "input_ids": [ctx[0] + 1] + rows[0]["input_ids"][1:]}]
    calls = []
    hook = model.get_base_model().model.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        reusing.compute_loss(model, Collator(pad_id=0)(other))
    hook.remove()
    assert len(calls) == 2


def test_aux_rows_without_a_fork_point_are_refused():
    ok = Dataset.from_list([{"input_ids": [1, 2], "labels": [-100, 2], "is_aux": True, "fork_at": 1},
                            {"input_ids": [1, 2], "labels": [-100, 2], "is_aux": False, "fork_at": 0}])
    check_fork_points(ok)
    with pytest.raises(DataError, match="fork_at"):
        check_fork_points(ok.remove_columns("fork_at"))
    with pytest.raises(DataError, match="1 aux rows"):
        check_fork_points(Dataset.from_list([{"input_ids": [1, 2], "labels": [-100, 2], "is_aux": True,
                                              "fork_at": 0}]))


def test_zero3_with_aux_scope_is_refused():
    with pytest.raises(ValueError, match="ZeRO-3"):
        LoraRunConfig(data="-", out="-", adapter_scope="aux", deepspeed="zero3").check()
    with pytest.raises(ValueError, match="adapter_scope"):
        LoraRunConfig(data="-", out="-", adapter_scope="fork").check()


def test_first_message_row_is_the_fork_on_that_message_alone(tmp_path, tok, trace):
    """`--aux-context first`: a notes row cut to its first message equals the engine's adapter fork on a session that
    holds only that message (the whole template piece of the full conversation, positions renumbered), and the cut
    changes the loss (the test can fail). Main and plan rows pass unchanged (the planner is served on the full fork);
    packed rows and foreign tokens are refused."""
    b = hs.boundaries(trace, 2)[-1]
    ctx = hs.aux_context(trace, b, random.Random(0), mask_prob=0.5)
    cfg_h = HindsightConfig(every=2, max_tokens=10**6, plan=False, trigger="notes")
    row = _aux_at(trace, PieceTokenizer(tok), cfg_h, ctx)[0]
    main = {**row, "is_aux": False, "kind": "main", "fork_at": 0}
    plan = _aux_at(trace, PieceTokenizer(tok), HindsightConfig(every=2, max_tokens=10**6, plan=True, trigger="notes"),
                   ctx)[1]
    assert plan["kind"] == "plan" and plan["is_aux"]
    cut, kept, plan_kept = first_message_rows(Dataset.from_list([row, main, plan]), tok)
    assert kept == Dataset.from_list([main, plan])[0] and plan_kept == Dataset.from_list([main, plan])[1]

    first = message_token_ids(tok, ctx.messages)[0]  # piece 0 of the whole conversation's rendering
    f, n = row["fork_at"], len(first)
    assert n < f and cut["fork_at"] == n
    assert cut["input_ids"] == first + row["input_ids"][f:] and cut["labels"] == [-100] * n + row["labels"][f:]
    assert cut["n_tokens"] == len(cut["input_ids"]) < len(row["input_ids"])

    model, cfg = _moved_lora(tok, tmp_path, seed=7)
    s = Engine(model, tok).session("full")
    s.append(first, kind="user")
    fork = s.fork(shared=True)
    fork.config.use_adapter = True
    logits = fork.append(row["input_ids"][f:], kind="user", logits="all")
    labels = torch.tensor(row["labels"][f:])
    j = (labels != -100).nonzero()[:, 0]
    ref = _ce(logits[j - 1], labels[j]) / len(j)
    trainer = _trainer(model, cfg, tmp_path, "aux")
    with torch.no_grad():
        _, short = trainer.compute_loss(model, Collator(pad_id=0)([cut]), return_outputs=True)
        _, full = trainer.compute_loss(model, Collator(pad_id=0)([row]), return_outputs=True)
    assert torch.allclose(short["ce_aux"], ref, rtol=1e-4), (short["ce_aux"], ref)
    assert (full["ce_aux"] - ref).abs() > 1e-2 > 100 * (short["ce_aux"] - ref).abs()

    with pytest.raises(DataError, match="another model"):
        first_message_rows(Dataset.from_list([{**row, "input_ids": [first[0] + 1] + row["input_ids"][1:]}]), tok)
    packed = packed_row(trace, PieceTokenizer(tok), every=1, mask_prob=0.5, seed=3, plan=False)
    with pytest.raises(DataError, match="packed"):
        first_message_rows(Dataset.from_list([{**row, "segment": packed["segment"][:len(row["input_ids"])]}]), tok)
    with pytest.raises(DataError, match="fork_at"):
        first_message_rows(Dataset.from_list([{k: v for k, v in row.items() if k != "fork_at"}]), tok)
    for bad, msg in ((dict(aux_context="first"), "needs --adapter-scope aux"), (dict(aux_context="trunk"), "one of")):
        with pytest.raises(ValueError, match=msg):
            LoraRunConfig(data="-", out=str(tmp_path), **bad).check()


def test_train_on_first_message_rows_keeps_rows_whose_full_context_is_too_long(tiny_folder, tok, tmp_path, monkeypatch):
    """`train_lora(aux_context="first")`: the cut happens before the length filter, so deletion rows whose full
    context exceeds `max_len` are trained on instead of dropped; the run says so and writes the adapter, which
    records `aux_context: first` for its server."""
    from kvsteward.synth.traces.dataset import build_dataset
    from kvsteward.train.data import fit_length
    from kvsteward.train.lora import train_lora

    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    dd, _, _ = build_dataset(generate_traces(20, seed=3), tok, HindsightConfig(every=2, plan=False, trigger="notes"))
    dd.save_to_disk(str(tmp_path / "ds"))
    delete = dd["train"].filter(lambda r: r["is_aux"])
    max_len = sorted(len(x) for x in delete["input_ids"])[len(delete) // 2]  # half the full rows are too long
    assert fit_length(delete, max_len)[1]["delete"] > 0
    logs: list[str] = []
    cfg = LoraRunConfig(data=str(tmp_path / "ds"), out=str(tmp_path / "run"), model=str(tiny_folder), max_steps=1,
                        batch_size=2, rank=4, alpha=8, mlflow=False, adapter_scope="aux", aux_context="first",
                        max_len=max_len, eval_rows=2)
    res = train_lora(cfg, log=logs.append)
    assert res.steps == 1 and (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
    assert any("--aux-context first: aux rows (training and validation) cut" in m for m in logs), logs
    # the adapter records the cut: its server runs the aux thread on the first message too (tests/test_aux.py)
    assert adapter_meta(tmp_path / "run" / "adapter")["aux_context"] == "first"
    assert not any("dropped" in m and "delete" in m for m in logs), logs
    # rows with the ids trigger keep the evidence in the context: the cut is refused by name, before any training
    dd, _, _ = build_dataset(generate_traces(20, seed=3), tok, HindsightConfig(every=2, plan=False, trigger="ids"))
    dd.save_to_disk(str(tmp_path / "ids"))
    with pytest.raises(DataError, match="needs rows with the notes or scores trigger"):
        train_lora(LoraRunConfig(**{**cfg.__dict__, "data": str(tmp_path / "ids"), "out": str(tmp_path / "run2")}))
    assert not (tmp_path / "run2").exists()
