"""DeepSpeed: the shipped ZeRO-2/3 configs resolve and validate; a 2-rank torchrun ZeRO-2 run trains on CPU (gloo)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.paths import data_dir
from kvsteward.train.deepspeed import config_path, resolved_config
from kvsteward.train.toy import random_ids_dataset

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _autos(node, path="") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _autos(v, f"{path}.{k}")]
    return [path] if node == "auto" else []


@pytest.mark.parametrize("stage,number", [("zero2", 2), ("zero3", 3)])
def test_config_resolves_through_training_arguments_and_validates(stage, number):
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    raw = json.loads(config_path(stage).read_text())
    assert _autos(raw), "the shipped config should leave batch/precision/bucket fields to Trainer (auto)"
    cfg = resolved_config(config_path(stage), model=tiny_model(), per_device_train_batch_size=2,
                          gradient_accumulation_steps=4, max_grad_norm=0.5)
    assert _autos(cfg) == []
    ds = DeepSpeedConfig(cfg)
    assert ds.zero_optimization_stage == number
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (8, 2, 4)
    assert ds.gradient_clipping == 0.5
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # hidden² from the model
    bad = copy.deepcopy(cfg)
    bad["zero_optimization"]["stage3_gather_weights_typo"] = True
    with pytest.raises(ValidationError, match="stage3_gather_weights_typo"):
        DeepSpeedConfig(bad)


def test_unknown_stage_is_named():
    with pytest.raises(ValueError, match="zero4"):
        config_path("zero4")


@pytest.mark.slow  # a 2-process launch: ~40–60 s on 2 busy cores once the shm op is cached (first build ~40 s more)
def test_torchrun_two_rank_zero2_smoke(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    tiny_model().save_pretrained(tmp_path / "tiny")
    random_ids_dataset(rows=24).save_to_disk(str(tmp_path / "ds"))
    env = dict(os.environ, OMP_NUM_THREADS="1", KVSTEWARD_HOME=str(tmp_path / "home"),
               # the JIT-built comm op is cached in the real data dir, not the per-test home
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(data_dir() / "torch_extensions")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "kvsteward.pipelines.cli", "train", "lora", "--model", str(tmp_path / "tiny"),
           "--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"), "--max-steps", "3", "--save-steps", "3",
           "--deepspeed", "zero2", "--no-mlflow", "--json", "--lr", "1e-2"]
    # Own process group: on a timeout the workers go too, not only the launcher.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"2-rank run timed out:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out  # rank 0 prints the JSON; rank 1 prints nothing
    result = json.loads(lines[0])
    assert result["steps"] == 3
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-3"
    assert (ckpt / "rng_state_0.pth").exists() and (ckpt / "rng_state_1.pth").exists()  # two ranks took part
    assert any(p.name.startswith("global_step") for p in ckpt.iterdir())  # a DeepSpeed engine checkpoint
    weights = load_file(os.path.join(result["adapter_dir"], "adapter_model.safetensors"))
    assert sum(v.abs().sum().item() for k, v in weights.items() if "lora_B" in k) > 0  # it trained
    PeftModel.from_pretrained(tiny_model(), result["adapter_dir"])  # and the adapter loads on the base
