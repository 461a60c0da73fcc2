"""An aborted run resumes from its last checkpoint with no lost step, in the same MLflow run, and ends where an
uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from kvsteward.models import tiny_model
from kvsteward.train.lora import LoraRunConfig, train_lora
from kvsteward.train.toy import random_ids_dataset

torch.set_num_threads(1)


class Crash(RuntimeError):
    pass


class CrashAfter(TrainerCallback):
    """Dies right after optimizer step k, before that step is logged or checkpointed (like a killed process)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Crash(f"simulated crash after step {self.step}")


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tiny_model().save_pretrained(tmp_path / "tiny")
    random_ids_dataset(rows=40).save_to_disk(str(tmp_path / "ds"))

    def cfg(out: str, **kw) -> LoraRunConfig:
        base = dict(data=str(tmp_path / "ds"), out=str(tmp_path / out), model=str(tmp_path / "tiny"), max_steps=6,
                    save_steps=2, lr=1e-2, rank=4, alpha=8, batch_size=2, seed=3)
        return LoraRunConfig(**(base | kw))

    return cfg


def test_killed_run_resumes_without_losing_steps(setup, tmp_path):
    import mlflow

    with pytest.raises(Crash):
        train_lora(setup("run", callbacks=[CrashAfter(5)]))
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["checkpoint-2", "checkpoint-4"]
    assert not (tmp_path / "run" / "adapter").exists()
    first_run = mlflow.last_active_run()
    assert first_run.info.status == "FAILED"

    resumed = train_lora(setup("run", resume=True))
    assert resumed.steps == 6 and resumed.steps_this_process == 2  # steps 5 and 6, from checkpoint-4
    assert resumed.mlflow_run_id == first_run.info.run_id  # one MLflow run per training
    client = mlflow.MlflowClient()
    run = client.get_run(resumed.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from"] == "checkpoint-4"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [1, 2, 3, 4, 5, 6]  # every step logged exactly once across the two processes

    straight = train_lora(setup("straight", mlflow=False))
    a = load_file(f"{resumed.adapter_dir}/adapter_model.safetensors")
    b = load_file(f"{straight.adapter_dir}/adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # same data order, RNG and optimizer state: resuming changes nothing
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert straight.final_ce_aux == pytest.approx(resumed.final_ce_aux, rel=1e-5)


def test_resume_without_checkpoint_starts_fresh(setup):
    result = train_lora(setup("fresh", resume=True, max_steps=2, mlflow=False))
    assert result.steps == 2 and result.steps_this_process == 2


def test_wall_clock_budget_stops_with_a_saved_adapter(setup, tmp_path, monkeypatch):
    from kvsteward.train import callbacks

    clock = iter(range(0, 10_000, 40))  # every reading is 40 s later: the 1-minute budget ends after step 2
    monkeypatch.setattr(callbacks, "_now", lambda: next(clock))
    result = train_lora(setup("budget", max_minutes=1.0, mlflow=False))
    assert result.steps == 2
    assert (tmp_path / "budget" / "adapter" / "adapter_model.safetensors").exists()
    assert (tmp_path / "budget" / "checkpoints" / "checkpoint-2").exists()  # the stop also checkpoints


def test_top_layers_adapts_only_the_top_decoder_layers(setup, tmp_path):
    result = train_lora(setup("top", top_layers=1, max_steps=2, mlflow=False))
    names = load_file(f"{result.adapter_dir}/adapter_model.safetensors").keys()
    n_layers = tiny_model().config.num_hidden_layers
    assert names and all(f"layers.{n_layers - 1}." in k for k in names)
    with pytest.raises(ValueError, match="decoder layers"):
        train_lora(setup("bad", top_layers=n_layers + 1, mlflow=False))


class Watch(TrainerCallback):
    """Records the dtypes of the frozen and of the trainable parameters, and the loss of every step."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        params = list(model.parameters())
        self.frozen = {p.dtype for p in params if not p.requires_grad}
        self.trainable = {p.dtype for p in params if p.requires_grad}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def test_bfloat16_base_trains_a_float32_adapter_that_learns_as_the_float32_run(setup):
    bf, fp = Watch(), Watch()
    run_bf = train_lora(setup("bf", base_dtype="bfloat16", max_steps=12, mlflow=False, callbacks=[bf]))
    run_fp = train_lora(setup("fp", max_steps=12, mlflow=False, callbacks=[fp]))
    assert bf.frozen == {torch.bfloat16} and bf.trainable == {torch.float32}
    assert fp.frozen == fp.trainable == {torch.float32}
    a, b = (load_file(f"{r.adapter_dir}/adapter_model.safetensors") for r in (run_bf, run_fp))
    assert a.keys() == b.keys() and all(a[k].dtype == torch.float32 for k in a)
    # Same seed and rows: only the base's rounding differs. The first loss is the base model's in either precision;
    # the bf16-base run must learn about as much as the float32 one (a LoRA branch lost to a cast would not).
    assert bf.losses[0] == pytest.approx(fp.losses[0], rel=0.02)
    learned_bf, learned_fp = bf.losses[0] - min(bf.losses[-3:]), fp.losses[0] - min(fp.losses[-3:])
    assert learned_fp > 0.3 and learned_bf > 0.7 * learned_fp, (bf.losses, fp.losses)
    for bad, match in ((dict(base_dtype="float16"), "base_dtype must be one of"),
                       (dict(base_dtype="bfloat16", deepspeed="zero2"), "under DeepSpeed use --bf16")):
        with pytest.raises(ValueError, match=match):
            train_lora(setup("bad", mlflow=False, **bad))


# -- validation during training (`--eval-rows`, `--keep-best`) ---------------------------------------------------------

class Damage(TrainerCallback):
    """After optimizer step k, overwrite every LoRA B matrix with large noise: a state far worse than any before it,
    standing for a run that has drifted."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for name, w in model.named_parameters():
                    if "lora_B" in name:
                        w.copy_(torch.randn(w.shape, generator=gen))


def _reference_eval_loss(tmp_path, adapter_dir: str, rows) -> float:
    """Trainer's eval_loss recomputed without the trainer: the PEFT model's full logits, right-padded batches of 2 in
    the given order, CE over each batch's labelled tokens, batch means weighted by batch size."""
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny"), adapter_dir).eval()
    total, n = 0.0, 0
    for s in range(0, len(rows), 2):
        batch = rows.select(range(s, min(s + 2, len(rows))))
        width = max(len(x) for x in batch["input_ids"])
        ids = torch.tensor([x + [0] * (width - len(x)) for x in batch["input_ids"]])
        labels = torch.tensor([y + [-100] * (width - len(y)) for y in batch["labels"]])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        total += float(ce) * len(batch)
        n += len(batch)
    return total / n


def test_validation_loss_is_the_aux_ce_of_held_out_rows_and_is_logged(setup, tmp_path):
    import mlflow

    from kvsteward.train.data import load_splits, validation_rows

    result = train_lora(setup("val", max_steps=4, eval_rows=6))
    history = mlflow.MlflowClient().get_metric_history(result.mlflow_run_id, "eval_loss")
    assert sorted(m.step for m in history) == [2, 4]  # every checkpoint (save_steps 2) is scored
    assert result.eval_loss == pytest.approx(next(m.value for m in history if m.step == 4))
    rows = validation_rows(load_splits(tmp_path / "ds"), 6, 4096, "all", seed=3)
    assert len(rows) and all(rows["is_aux"])  # main rows of the validation split are not scored
    assert result.eval_loss == pytest.approx(_reference_eval_loss(tmp_path, result.adapter_dir, rows), rel=1e-4)
    assert result.best_eval_loss == min(m.value for m in history)


def test_keep_best_delivers_the_best_scored_checkpoint_not_a_drifted_last_state(setup, tmp_path):
    best = train_lora(setup("best", eval_rows=6, keep_best=True, callbacks=[Damage(3)], mlflow=False))
    last = train_lora(setup("last", eval_rows=6, callbacks=[Damage(3)], mlflow=False))
    assert best.steps == last.steps == 6 and best.best_step == last.best_step == 2
    assert best.eval_loss > best.best_eval_loss  # the damage shows in the later scores
    delivered = load_file(f"{best.adapter_dir}/adapter_model.safetensors")
    ckpt2 = load_file(f"{tmp_path}/best/checkpoints/checkpoint-2/adapter_model.safetensors")
    final = load_file(f"{last.adapter_dir}/adapter_model.safetensors")
    assert all(torch.equal(delivered[k], ckpt2[k]) for k in ckpt2)  # checkpoint-2 survived save_total_limit
    assert not all(torch.equal(final[k], ckpt2[k]) for k in ckpt2)  # without --keep-best: the last state


def test_wall_clock_stop_scores_the_last_state(setup, tmp_path, monkeypatch):
    import json

    from kvsteward.train import callbacks

    clock = iter(range(0, 10_000, 40))  # 40 s per reading: the 2-minute budget ends after step 3
    monkeypatch.setattr(callbacks, "_now", lambda: next(clock))
    result = train_lora(setup("budget_val", max_minutes=2.0, eval_rows=6, mlflow=False))
    assert result.steps == 3
    state = json.loads((tmp_path / "budget_val" / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    scored = [h["step"] for h in state["log_history"] if "eval_loss" in h]
    assert scored == [2, 3]  # step 3 is no multiple of eval_steps (2): scored because the budget stopped there


def test_validation_options_are_checked(setup, tmp_path):
    from datasets import DatasetDict, load_from_disk

    from kvsteward.train.data import DataError

    for kw, msg in [({"keep_best": True}, "keep_best needs validation rows"),
                    ({"eval_steps": 2}, "eval_steps is set but eval_rows is 0"),
                    ({"eval_rows": 4, "keep_best": True, "eval_steps": 3}, "multiple of eval_steps"),
                    ({"eval_rows": -1}, "eval_rows and eval_steps must be ≥ 0")]:
        with pytest.raises(ValueError, match=msg):
            train_lora(setup("bad", mlflow=False, **kw))
    ds = load_from_disk(str(tmp_path / "ds"))
    DatasetDict({"train": ds["train"]}).save_to_disk(str(tmp_path / "noval"))
    with pytest.raises(DataError, match="non-empty 'validation' split"):
        train_lora(setup("bad", data=str(tmp_path / "noval"), eval_rows=4, mlflow=False))
    main_only = ds["validation"].filter(lambda r: not r["is_aux"])
    DatasetDict({"train": ds["train"], "validation": main_only}).save_to_disk(str(tmp_path / "mainval"))
    with pytest.raises(DataError, match="no aux row of at most max_len"):
        train_lora(setup("bad", data=str(tmp_path / "mainval"), eval_rows=4, mlflow=False))
