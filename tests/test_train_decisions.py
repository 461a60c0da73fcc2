"""Decision-level validation (`train.decisions`, `steward train lora --eval-rows --best-metric f1`): the served
decoder on held-out rows, compared with the server itself, pooled by hand, and wired into Trainer's checkpoint
choice."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kvsteward.models import adapter_meta, tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.manager.thread import run_aux
from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.traces.dataset import HindsightConfig, build_dataset
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.train import decisions
from kvsteward.train.data import DataError
from kvsteward.train.decisions import DecisionRow, decide, decision_rows, score
from kvsteward.train.lora import LoraRunConfig, train_lora, wrap_lora

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def traces():
    return generate_traces(20, seed=3)


def _moved_lora(tok, seed: int = 4):
    """A PEFT tiny Llama whose adapter is far from zero, so the adapter's decisions differ from the base model's."""
    cfg = LoraRunConfig(data="-", out="-", rank=4, alpha=8, dropout=0.0, max_steps=1, batch_size=1)
    model = wrap_lora(tiny_model("llama", vocab=len(tok), seed=seed, layers=2), cfg)
    g = torch.Generator().manual_seed(seed)
    for name, w in model.named_parameters():
        if "lora_B" in name:
            w.data = torch.randn(w.shape, generator=g) * 0.5
    return model.eval()


@pytest.mark.parametrize("trigger", ["ids", "notes"])
def test_row_decision_is_the_servers_decision(tok, traces, trigger):
    """With nothing pre-masked, the decoder run on a training row's own tokens decides exactly what the server's aux
    thread (`run_aux` on a session replayed from the trace's messages) decides at that boundary, ids and all."""
    dd, _, _ = build_dataset(traces[:8], tok, HindsightConfig(every=2, plan=False, main=False, mask_prob=0.0,
                                                              trigger=trigger))
    rows = dd["train"].select(range(10))
    engine = Engine(_moved_lora(tok), tok, trigger_style=trigger)
    by_id = {t.task_id: t for t in traces}
    decided = []
    for row, d in zip(rows, decision_rows(rows, tok), strict=True):
        ctx = by_id[row["task_id"]].messages[:row["step"]]
        s = engine.session("full")
        for m, ids in zip(ctx, message_token_ids(tok, ctx), strict=True):
            s.append(ids, kind=m["role"], logits="last")
        served = run_aux(s, tok, ctx, list(row["open_cursors"])).del_cursors
        assert decide(engine, d) == served, (row["task_id"], row["step"])
        assert set(d.deletable) <= set(row["open_cursors"]) and d.target == set(json.loads(row["target"])
                                                                                 ["del_cursors"])
        decided.append(served)
    assert any(decided) and not all(decided)  # the comparison covers both "delete some" and "delete none"


def test_scores_pool_over_rows_as_worked_by_hand(monkeypatch):
    """Rows {3, 5} and {7}, decisions {3, 9} and {}: tp 1, fp 1, fn 2 → precision 1/2, recall 1/3, F1 2/(2+1+2)."""
    rows = [DecisionRow([1], [2], [3, 5, 9], frozenset({3, 5})), DecisionRow([1], [2], [7], frozenset({7}))]
    answers = iter([[3, 9], []])
    monkeypatch.setattr(decisions, "decide", lambda engine, row: next(answers))
    assert score(None, rows) == {"f1": pytest.approx(0.4), "precision": 0.5, "recall": pytest.approx(1 / 3),
                                 "deleted": 2.0}
    monkeypatch.setattr(decisions, "decide", lambda engine, row: [])
    assert score(None, rows)["precision"] == 0.0  # deleting nothing is not precision 1


def test_rows_the_decoder_cannot_replay_are_refused(tok, traces):
    dd, _, _ = build_dataset(traces[:4], tok, HindsightConfig(every=2, plan=False, main=False))
    rows = dd["train"]
    with pytest.raises(DataError, match="hindsight columns"):
        decision_rows(rows.remove_columns(["fork_at"]), tok)
    with pytest.raises(DataError, match="no fork point"):
        decision_rows(rows.map(lambda r: {"fork_at": 0}), tok)
    with pytest.raises(DataError, match="serving opener"):
        decision_rows(rows.map(lambda r: {"labels": [-100] * (len(r["labels"]) - 2) + r["input_ids"][-2:]}), tok)


def test_best_metric_f1_scores_every_checkpoint_and_delivers_the_best(tiny_folder, tok, traces, tmp_path, monkeypatch):
    """`--eval-rows --best-metric f1 --keep-best`: each logged eval_f1 is the decision score recomputed from that
    checkpoint's saved adapter, best_step is the first step of the highest F1, and the delivered adapter is that
    checkpoint's. Every checkpoint carries the adapter's `kvsteward.json`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    dd, _, _ = build_dataset(traces, tok, HindsightConfig(every=2, plan=False, trigger="notes"))
    dd.save_to_disk(str(tmp_path / "ds"))
    cfg = LoraRunConfig(data=str(tmp_path / "ds"), out=str(tmp_path / "run"), model=str(tiny_folder), max_steps=3,
                        save_steps=1, batch_size=2, lr=5e-2, rank=4, alpha=8, mlflow=False, eval_rows=6,
                        keep_best=True, best_metric="f1", adapter_scope="aux")
    res = train_lora(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    from kvsteward.train.data import load_splits, validation_rows

    rows = decision_rows(validation_rows(load_splits(cfg.data), 6, cfg.max_len, "aux", cfg.seed), tok)
    logged = {}
    for step in (1, 2, 3):
        base = AutoModelForCausalLM.from_pretrained(str(tiny_folder))
        engine = Engine(PeftModel.from_pretrained(base, str(ckpts / f"checkpoint-{step}")), tok)
        logged[step] = score(engine, rows)["f1"]
        # every checkpoint is a servable adapter folder: it records the trigger layout it was trained on (and, never
        # calibrated, is served greedy at close bias 0)
        assert adapter_meta(ckpts / f"checkpoint-{step}") == {"trigger": "notes", "adapter_scope": "aux",
                                                                 "aux_context": "full", "close_bias": 0.0,
                                                                 "min_confidence": None}
    assert len(set(logged.values())) > 1  # the choice is a real one (on this seed: F1 0, 0.5, 0.5)
    assert res.eval_f1 == pytest.approx(logged[3])
    assert res.best_eval_f1 == pytest.approx(max(logged.values()))
    assert res.best_step == max(logged, key=logged.get)
    delivered = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    chosen = load_file(str(ckpts / f"checkpoint-{res.best_step}" / "adapter_model.safetensors"))
    assert delivered.keys() == chosen.keys() and all(torch.equal(delivered[k], chosen[k]) for k in delivered)


def test_best_metric_option_errors():
    base = {"data": "-", "out": "-"}
    with pytest.raises(ValueError, match="best_metric must be one of"):
        LoraRunConfig(**base, eval_rows=2, best_metric="accuracy").check()
    with pytest.raises(ValueError, match="give --eval-rows"):
        LoraRunConfig(**base, best_metric="f1").check()
    with pytest.raises(ValueError, match="not under DeepSpeed"):
        LoraRunConfig(**base, eval_rows=2, best_metric="f1", deepspeed="zero2").check()
