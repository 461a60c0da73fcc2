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
