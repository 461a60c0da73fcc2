"""`steward train ...` (owned by the training work)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)


def _fail(error: Exception) -> None:
    console.print(f"[red]error:[/red] {error}", soft_wrap=True)
    raise typer.Exit(2) from error


@app.command()
def lora(
    data: Path = typer.Option(..., help="hindsight DatasetDict folder (`steward synth hindsight` output)"),
    out: Path = typer.Option(..., help="run folder: checkpoints/, adapter/, mlflow_run.json"),
    model: str = typer.Option("smollm2", help="`smollm2`, a local HF folder, or a hub id"),
    max_steps: int = typer.Option(100, help="optimizer steps in total (a resumed run continues up to this)"),
    lr: float = typer.Option(2e-4, help="learning rate (cosine schedule)"),
    rank: int = typer.Option(16, help="LoRA rank"),
    alpha: int = typer.Option(32, help="LoRA alpha"),
    lambda_kl: float = typer.Option(1.0, help="weight of KL(student ‖ base) on main traces"),
    batch_size: int = typer.Option(2, help="micro-batch size per device"),
    grad_accum: int = typer.Option(1, help="gradient-accumulation steps"),
    max_len: int = typer.Option(4096, help="longer aux rows are dropped, longer main rows left-truncated"),
    deepspeed: str = typer.Option("none", help="none | zero2 | zero3 (launch with torchrun for several ranks)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint in OUT"),
    save_steps: int = typer.Option(50, help="checkpoint every N steps"),
    seed: int = typer.Option(0, help="seed for LoRA init, data order, dropout"),
    tile_rows: int = typer.Option(1024, help="LM-head rows per tile in the loss (memory bound for big vocabularies)"),
    lora_dropout: float = typer.Option(0.05, help="dropout on the LoRA branch's input (0 = none: faster on a CPU)"),
    bf16: bool = typer.Option(False, help="bf16 mixed precision (autocast; runs on a CPU, measured slower there)"),
    base_dtype: str = typer.Option("float32", help="float32 | bfloat16: the frozen base weights (bf16 halves their "
                                   "memory; LoRA weights and optimizer stay float32; measured 8 % slower per step "
                                   "on an AMX CPU, see docs/training.md)"),
    top_layers: int = typer.Option(0, help="LoRA only in the top N decoder layers (faster step); 0 = all"),
    max_minutes: float = typer.Option(0.0, help="stop (and save) after this many minutes of training; 0 = no limit"),
    hard_weight: int = typer.Option(1, help="repeat each hard deletion row (a read cursor still needed) N times"),
    skip_trivial: bool = typer.Option(False, "--skip-trivial",
                                      help="leave out deletion rows whose open cursors are all unread (never decoded)"),
    adapter_scope: str = typer.Option("all", help="all: the adapter on every token (main rows distilled); aux: only on "
                                      "the aux thread's tokens over the base model's context, as `steward serve` runs "
                                      "it (no KL term, main rows unused)"),
    aux_context: str = typer.Option("full", help="with --adapter-scope aux: full (an aux row's whole context, as "
                                    "served) or first (the context cut to the conversation's first message: "
                                    "shorter rows; the decision must be in the trigger, as with `--trigger notes`)"),
    eval_rows: int = typer.Option(0, help="score N held-out aux rows of the 'validation' split during training "
                                  "(eval_loss = their CE; eval_f1 / eval_precision / eval_recall = the served "
                                  "decoder's deletions against their targets; 0 = no validation)"),
    eval_steps: int = typer.Option(0, help="validation every N steps (0 = at every checkpoint)"),
    keep_best: bool = typer.Option(False, "--keep-best", help="deliver the best validation checkpoint (by "
                                   "--best-metric) instead of the last state (needs --eval-rows)"),
    best_metric: str = typer.Option("loss", help="what --keep-best chooses by: loss (the lowest validation CE) or f1 "
                                    "(the highest decision F1 of the served decoder on the validation rows)"),
    envs: str = typer.Option("", help="train only on the rows of these environments (comma-separated; default all): "
                             "leave one out to evaluate on it as a held-out environment"),
    track: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the run to MLflow and register the adapter"),
    as_json: bool = typer.Option(False, "--json", help="print only the result JSON on stdout"),
) -> None:
    """Train the memory-manager LoRA: CE on deletion/plan JSON targets + λ·KL to the base model on main traces."""
    from kvsteward.train.data import DataError
    from kvsteward.train.lora import LoraRunConfig, QuantizedModelError, is_main_process, train_lora

    cfg = LoraRunConfig(data=str(data), out=str(out), model=model, max_steps=max_steps, lr=lr, rank=rank, alpha=alpha,
                        lambda_kl=lambda_kl, dropout=lora_dropout, batch_size=batch_size, grad_accum=grad_accum,
                        max_len=max_len,
                        deepspeed=deepspeed, resume=resume, save_steps=save_steps, seed=seed, tile_rows=tile_rows,
                        bf16=bf16, base_dtype=base_dtype, max_minutes=max_minutes, top_layers=top_layers, mlflow=track,
                        hard_weight=hard_weight, skip_trivial=skip_trivial, adapter_scope=adapter_scope,
                        aux_context=aux_context, eval_rows=eval_rows, eval_steps=eval_steps, keep_best=keep_best,
                        best_metric=best_metric, envs=envs)
    try:
        cfg.check()
    except ValueError as e:
        _fail(e)
    try:
        # Libraries print to stdout (warnings, log dicts); stdout carries only the result.
        with contextlib.redirect_stdout(sys.stderr):
            result = train_lora(cfg, log=lambda m: console.print(f"[yellow]{m}"))
    except (DataError, QuantizedModelError) as e:  # bad input; anything else keeps its traceback
        _fail(e)
    if not is_main_process():
        return
    payload = {"mlflow_run_id": result.mlflow_run_id, "adapter_dir": result.adapter_dir,
               "final_ce_aux": result.final_ce_aux, "final_kl_main": result.final_kl_main, "steps": result.steps,
               "seconds_per_step": result.seconds_per_step, "eval_loss": result.eval_loss,
               "best_eval_loss": result.best_eval_loss, "best_step": result.best_step, "eval_f1": result.eval_f1,
               "eval_precision": result.eval_precision, "eval_recall": result.eval_recall,
               "best_eval_f1": result.best_eval_f1}
    if as_json:
        print(json.dumps(payload))
    else:
        for k, v in payload.items():
            print(f"{k}: {v}")


@app.command()
def soup(
    adapters: list[Path] = typer.Argument(..., help="adapter folders (`steward train lora`'s adapter/), 2 or more"),
    out: Path = typer.Option(..., help="folder for the soup adapter (must not exist, or be empty)"),
    model: str = typer.Option("smollm2", help="the adapters' base model: `smollm2`, a local folder, or a hub id"),
    weights: str = typer.Option(None, help="comma-separated weights, one per adapter (normalized); default uniform"),
    as_json: bool = typer.Option(False, "--json", help="print only the result JSON on stdout"),
) -> None:
    """One adapter whose weight delta is the weighted mean of the adapters' (e.g. seeds of one configuration):
    served at the cost of one. Calibrate its close bias afresh (`steward eval calibrate`)."""
    from kvsteward.models import ModelNotFound
    from kvsteward.train.soup import SoupError
    from kvsteward.train.soup import soup as make_soup

    try:
        shares = None if weights is None else [float(w) for w in weights.split(",")]
    except ValueError:
        _fail(SoupError(f"--weights must be comma-separated numbers, got {weights!r}"))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = make_soup(adapters, out, model=model, weights=shares)
    except (SoupError, ModelNotFound) as e:
        _fail(e)
    if as_json:
        print(json.dumps(result))
    else:
        console.print(f"soup of {len(adapters)} adapters (rank {result['rank']}) → {result['adapter_dir']}")
        print(result["adapter_dir"])


@app.command("toy-data")
def toy_data(
    out: Path = typer.Option(..., help="folder for the DatasetDict (train/validation/test)"),
    model: str = typer.Option("smollm2", help="tokenizer source: `smollm2`, a local folder, or a hub id"),
    rows: int = typer.Option(40, help="rows in total (80 % train, 10 % validation, 10 % test)"),
    seed: int = typer.Option(0, help="seed"),
) -> None:
    """A small chat dataset in the hindsight format (cursor lists → `{"del_cursors": [...]}`, plus Q&A main rows),
    for timing and smoke runs of `steward train lora` without the synthesis stage. Not training data."""
    from kvsteward.models import load_tokenizer
    from kvsteward.train.toy import chat_dataset

    ds = chat_dataset(load_tokenizer(model), rows=rows, seed=seed)
    with contextlib.redirect_stdout(sys.stderr):
        ds.save_to_disk(str(out))
    lengths = [len(x) for split in ds.values() for x in split["input_ids"]]
    console.print(f"{rows} rows, {min(lengths)}–{max(lengths)} tokens → {out}")
    print(out)
