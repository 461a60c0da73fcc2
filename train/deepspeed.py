"""DeepSpeed ZeRO configs shipped in `train/` (`auto` fields are filled from TrainingArguments) and launch details."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvsteward.paths import data_dir

STAGES = {"zero2": "zero2.json", "zero3": "zero3.json"}


def config_path(stage: str) -> Path | None:
    """`none` → None; `zero2`/`zero3` → the JSON next to this module."""
    if stage == "none":
        return None
    if stage not in STAGES:
        raise ValueError(f"unknown DeepSpeed stage {stage!r}: use none, {', '.join(STAGES)}")
    return Path(__file__).with_name(STAGES[stage])


def resolved_config(path: Path, model=None, num_training_steps: int = 100, **training_args) -> dict:
    """The config with `auto` filled in as Trainer hands it to DeepSpeed: batch/accumulation/clipping/precision from
    the arguments, and with `model` also the hidden-size-based bucket sizes (Trainer's finalize stage)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    args = TrainingArguments(output_dir=training_args.pop("output_dir", "/tmp/kvsteward-ds-check"),
                             deepspeed=str(path), report_to="none", **training_args)
    try:
        hf_config = args.hf_deepspeed_config
        if model is not None:
            hf_config.trainer_config_finalize(args, model, num_training_steps)
        return hf_config.config
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config would otherwise make later from_pretrained calls partition


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cpu_state() -> bool:
    """On a machine without CUDA, set up accelerate's process state for DeepSpeed over gloo; True if done.

    accelerate 1.15 picks no backend on CPU when DeepSpeed is requested: DeepSpeed's comm then spans all ranks while
    accelerate reports 1 process, and DeepSpeed rejects the batch size (`2 != 2 * 1 * 2`). A state created with an
    explicit gloo backend reports the real world size; TrainingArguments must then reuse it
    (`accelerator_config={"use_configured_state": True}`).
    """
    import torch

    if torch.cuda.is_available():
        return False
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return True


def prepare_launch_env() -> None:
    """Make a single plain `python` process a valid 1-rank DeepSpeed job (else it falls back to mpi4py and fails);
    under torchrun the variables are already set and are left alone. Cache JIT-built ops (the CPU shm comm op takes
    ~40 s to compile) under the project's data dir."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(data_dir() / "torch_extensions"))
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
