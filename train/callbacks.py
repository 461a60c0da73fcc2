"""Trainer callbacks: per-step MLflow metrics into the run we started, and a rich progress bar on stderr."""

from __future__ import annotations

import math
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import TrainerCallback


class MlflowMetrics(TrainerCallback):
    """Log every numeric entry of each Trainer log (loss, ce_aux, kl_main, lr, grad_norm, ...) at its global step.

    Used instead of HF's MLflowCallback: that one re-logs ~100 config params per start (a resumed run with one
    changed value then fails: MLflow params are immutable) and, with HF_MLFLOW_LOG_ARTIFACTS, turns checkpoints into
    LoggedModels rather than run artifacts.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        import mlflow

        metrics = {k: float(v) for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if metrics:
            mlflow.log_metrics(metrics, step=state.global_step)


def _now() -> float:
    return time.monotonic()


class AdapterMetaInCheckpoints(TrainerCallback):
    """Write the adapter's `kvsteward.json` (trigger layout, scope) into every checkpoint folder: a checkpoint is an
    adapter folder too (`steward serve --adapter DIR/checkpoints/checkpoint-N`), and without the file the server would
    write the `ids` trigger for an adapter trained on `notes`."""

    def __init__(self, meta: dict):
        self.meta = meta

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from pathlib import Path

        from kvsteward.models import write_adapter_meta

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            write_adapter_meta(folder, self.meta)


class WallClockBudget(TrainerCallback):
    """Stop (with a final checkpoint) once this process has trained for `minutes`: a fixed compute budget.

    The check runs after each optimizer step, so a run overshoots by at most one step. A resumed run gets a fresh
    budget (it is a budget per process, which is what a time-limited job slot gives).
    """

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.t0: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = _now()

    def on_step_end(self, args, state, control, **kwargs):
        if self.t0 is not None and _now() - self.t0 >= self.seconds:
            control.should_training_stop = True
            control.should_save = True
            # With validation on, score the last state too, so a best-checkpoint choice can pick it.
            control.should_evaluate = args.eval_strategy != "no"


class RichProgress(TrainerCallback):
    """Progress bar (stderr, world process zero only) with the latest loss parts."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.progress: Progress | None = None
        self.task = None
        self.val = ""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True))
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.max_steps, completed=state.global_step, info="")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is None or not logs:
            return
        if "eval_loss" in logs:  # a validation log: keep it on the bar until the next one
            f1 = f" val_f1={logs['eval_f1']:.2f}" if "eval_f1" in logs else ""
            self.val = f" val_ce={logs['eval_loss']:.4f}{f1}@{state.global_step}"
        if "loss" not in logs:
            return
        parts = [f"{k}={logs[k]:.4f}" for k in ("loss", "ce_aux", "kl_main") if k in logs]
        self.progress.update(self.task, completed=state.global_step, info=" ".join(parts) + self.val)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Stop the live display (also after an aborted run: rich allows one live display per process)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
