"""Packed rows (synth/traces/packed.py + train/data.tree_mask): one forward over the trace and all its auxiliary calls
equals the serving engine (appends, drops, read-only forks), and the trainer's loss on it gathers the right tokens.

An unpacked forward per view (only the keys a group may see, recomputed) is *not* a reference: the engine keeps the
K/V a token got while it could still see a cursor dropped later, and so does the packed row."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.packed import NEVER, packed_row
from kvsteward.synth.traces.tokens import PieceTokenizer
from kvsteward.train.data import Collator, tree_mask

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trace():
    return next(t for t in generate_traces(8, seed=5) if len(hs.boundaries(t, 1)) >= 4)


@pytest.fixture(scope="module")
def row(tok, trace):
    # seed chosen so the history drops some cursors and keeps others open past their expiry
    r = packed_row(trace, PieceTokenizer(tok), every=1, mask_prob=0.5, seed=3, plan=True)
    assert r["dropped_at"] and any(c["masked"] for c in r["calls"])
    assert any(c["kind"] == "delete" and c["target"] != '{"del_cursors": []}' and
               set(c["masked"]) < set(r["dropped_at"]) for c in r["calls"])
    return r


def _packed_logits(model, row: dict) -> torch.Tensor:
    batch = Collator(pad_id=0)([{**row, "is_aux": True}])
    mask = batch["attention_mask"]
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=add, position_ids=batch["position_ids"]).logits[0]


def test_tree_mask_hand_worked():
    # trunk: message 0 (2 tokens, a cursor dropped at boundary 1), then a branch at boundary 1, then message 1
    seg = torch.tensor([[0, 0, 1, 1, 0, 0]])
    time = torch.tensor([[0, 0, 1, 1, 2, 2]])
    expire = torch.tensor([[2, 2, NEVER, NEVER, NEVER, NEVER]])
    m = tree_mask(seg, time, expire, torch.ones(1, 6, dtype=torch.bool))[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0],   # the branch still sees the cursor its own call drops
                 [1, 1, 1, 1, 0, 0],
                 [0, 0, 0, 0, 1, 0],   # step 1 sees neither the dropped cursor nor the branch
                 [0, 0, 0, 0, 1, 1]]
    padded = tree_mask(seg[:, :2], time[:, :2], expire[:, :2], torch.tensor([[True, False]]))[0, 0].int().tolist()
    assert padded == [[1, 0], [0, 1]]  # padding sees only itself


def test_drop_schedule_is_one_consistent_history(trace):
    bounds = hs.boundaries(trace, 1)
    contexts, dropped_at = hs.drop_schedule(trace, bounds, random.Random(0), 0.5)
    for ctx in contexts:
        assert ctx.masked == sorted(c for c, d in dropped_at.items() if d < ctx.boundary)
        assert not set(ctx.open_cursors) & set(ctx.masked)
    for c, d in dropped_at.items():  # only a call's own target is ever dropped, at that call
        ctx = next(x for x in contexts if x.boundary == d)
        assert c in hs.delete_target(ctx.open_cursors, trace, d)["del_cursors"]
    _, none = hs.drop_schedule(trace, bounds, random.Random(0), 0.0)
    assert none == {}
    ctxs, every = hs.drop_schedule(trace, bounds, random.Random(0), 1.0)
    for prev, ctx in zip(ctxs, ctxs[1:], strict=False):  # a manager that always deletes: nothing stays expired
        assert not set(ctx.open_cursors) & set(hs.expired(trace, prev.boundary))
    assert set(every) == set(hs.expired(trace, bounds[-1]))


def test_packed_row_is_the_serving_engine(tok, trace, row):
    """Trunk logits = the main session's (messages appended one by one, each call's drops applied after it);
    branch logits = a read-only fork's at that boundary (trigger + target appended). Positions keep the gaps of
    dropped tokens in both."""
    model = tiny_model("llama", vocab=len(tok), seed=4)
    packed = _packed_logits(model, row)
    seg, time, ids = (torch.tensor(row[k]) for k in ("segment", "time", "input_ids"))
    calls = {c["segment"]: c for c in row["calls"]}
    s = Engine(model, tok).session("full")
    span: dict[int, tuple[int, int]] = {}  # message → its logical token range in the main session
    i = 0
    for m, msg in enumerate(trace.messages):
        while seg[i] > 0:  # the calls at boundary m, each on a read-only fork
            k = int(seg[i])
            here = (seg == k).nonzero().view(-1)
            assert calls[k]["boundary"] == m
            got = s.fork(shared=True).append(ids[here].tolist(), kind="user", logits="all")
            assert torch.allclose(got, packed[here], atol=2e-4), (m, k)
            i = int(here[-1]) + 1
        for c in [c for c, d in row["dropped_at"].items() if d == m]:  # what the calls at m deleted, before step m
            s.drop(list(range(*span[c])))
        end = i
        while end < len(ids) and seg[end] == 0 and time[end] == 2 * m:
            end += 1
        span[m] = (s.n_logical, s.n_logical + end - i)
        got = s.append(ids[i:end].tolist(), kind=msg["role"], logits="all")
        assert torch.allclose(got, packed[i:end], atol=2e-4), m
        i = end
    assert i == len(ids) and len(s.resident_logical()) < s.n_logical  # drops really happened


def test_trainer_loss_on_packed_rows_matches_packed_logits(tmp_path, tok, row):
    from kvsteward.train.lora import LoraRunConfig, training_args, wrap_lora
    from kvsteward.train.trainer import StewardTrainer

    base = tiny_model("llama", vocab=len(tok), seed=4)
    pristine = tiny_model("llama", vocab=len(tok), seed=4)
    # LoRA on the top layer only: the teacher reuses the student's lower layer (share_trunk), under the tree mask
    cfg = LoraRunConfig(data="-", out=str(tmp_path), rank=4, alpha=8, dropout=0.0, max_steps=2, lr=5e-2,
                        batch_size=1, save_steps=1000, top_layers=1)
    model = wrap_lora(base, cfg)
    from datasets import Dataset

    cols = ("input_ids", "labels", "position_ids", "segment", "time", "expire")
    ds = Dataset.from_list([{**{k: row[k] for k in cols}, "is_aux": True}])
    trainer = StewardTrainer(model=model, args=training_args(cfg, tmp_path / "ck"), train_dataset=ds,
                             data_collator=Collator(pad_id=0))
    trainer.train()
    model.eval()
    batch = Collator(pad_id=0)([ds[0]])
    with torch.no_grad():
        _, parts = trainer.compute_loss(model, batch, return_outputs=True)
        assert trainer._first_adapted_layer() == 1 and trainer._share_trunk
        # the packed forward = the serving engine (test above); here: CE on branch targets, KL on trunk labels
        student, teacher = _packed_logits(model, row), _packed_logits(pristine, row)
    assert not torch.allclose(student, teacher, atol=1e-3)  # the adapter has moved
    labels, seg = torch.tensor(row["labels"]), torch.tensor(row["segment"])
    j = torch.arange(1, len(labels))
    aux = j[(labels[1:] != -100) & (seg[1:] > 0)]
    main = j[(labels[1:] != -100) & (seg[1:] == 0)]
    assert len(aux) and len(main)
    ce_ref = F.cross_entropy(student[aux - 1], labels[aux])
    ls, lt = F.log_softmax(student[main - 1], -1), F.log_softmax(teacher[main - 1], -1)
    kl_ref = (ls.exp() * (ls - lt)).sum(-1).mean()
    assert torch.allclose(parts["ce_aux"], ce_ref, rtol=1e-4)
    assert torch.allclose(parts["kl_main"], kl_ref, rtol=1e-3, atol=1e-7)


def test_packed_dataset_card_and_stats(tmp_path, tok):
    from kvsteward.synth.traces import dataset as dsm
    from kvsteward.synth.traces.stats import dataset_stats
    from kvsteward.synth.traces.trace import write_traces

    traces = generate_traces(6, seed=2)
    write_traces(tmp_path / "tr", traces, {})
    cfg = dsm.HindsightConfig(every=2, max_tokens=10**6, plan=True, pack=True)
    dd, skipped, lengths = dsm.build_dataset(traces, tok, cfg)
    card = dsm.card(traces, dd, skipped, cfg, str(tmp_path / "tr"), lengths)
    dsm.save(dd, tmp_path / "ds", card)
    n_calls = sum(len(hs.boundaries(t, 2)) for t in traces)
    assert sum(sum(c.values()) for c in card["packed_calls"].values()) == 2 * n_calls
    assert sum(len(dd[s]) for s in dd) == sum(bool(hs.boundaries(t, 2)) for t in traces)
    st = dataset_stats(tmp_path / "ds")
    assert st["packed"] == sum(len(dd[s]) for s in dd) and st["label_errors"] == 0

    # the re-check can fail: one delete call that also names a cursor a later step reads
    by_id = {t.task_id: t for t in traces}

    def spoil(row: dict) -> dict:
        calls = json.loads(row["target"])
        for c in calls:
            needed = [x for x in c["open_cursors"] if by_id[row["task_id"]].last_use()[x] >= c["boundary"]]
            if c["kind"] == "delete" and needed:
                c["target"] = json.dumps({"del_cursors": sorted(json.loads(c["target"])["del_cursors"] + needed[:1])})
                break
        return {"target": json.dumps(calls)}

    dd["train"] = dd["train"].map(spoil)
    dsm.save(dd, tmp_path / "bad", card)
    bad = dataset_stats(tmp_path / "bad", traces=tmp_path / "tr")
    kinds = bad["label_error_kinds"]
    assert kinds["harmful"] >= 1 and kinds["label_tokens"] == kinds["harmful"]


def test_packed_branches_carry_the_notes_trigger_the_served_fork_writes(tok, trace):
    """`--pack --trigger notes`: each call's branch holds the notes trigger of the served context (message indices =
    cursor ids, dropped messages included), records its text, and the dataset checker accepts it."""
    from kvsteward.synth.traces.packed import call_messages
    from kvsteward.synth.traces.stats import delete_row_errors

    r = packed_row(trace, PieceTokenizer(tok), every=1, mask_prob=0.5, seed=3, plan=False, trigger="notes")
    last = trace.last_use()
    for call in r["calls"]:
        want = hs.delete_trigger(call["open_cursors"], trace.messages[:call["boundary"]], "notes")
        assert call["trigger"] == want and "\nTask: " in want
        branch = [t for t, s in zip(r["input_ids"], r["segment"], strict=True) if s == call["segment"]]
        assert want in tok.decode(branch)
        assert not delete_row_errors(call_messages(trace.messages, call), call["boundary"], last)
