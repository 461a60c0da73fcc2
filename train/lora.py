"""`train_lora`: one LoRA + distillation training run, end to end (data → PEFT model → Trainer → adapter → MLflow)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvsteward.models import write_adapter_meta
from kvsteward.synth.traces.hindsight import AUX_CONTEXTS
from kvsteward.train.data import (
    ADAPTER_SCOPES,
    Collator,
    DataError,
    check_fork_points,
    check_vocab,
    dataset_trigger,
    first_message_rows,
    fit_length,
    load_splits,
    select_envs,
    validation_rows,
    weigh_delete_rows,
)

# `--base-dtype`: the frozen base model's weights. bfloat16 halves their memory (what lets a bigger base fit); the
# LoRA weights, their gradients and the optimizer stay float32 (peft keeps adapter weights in float32 and casts the
# LoRA branch's input to them). Not a speed-up on the aux rows on a CPU: those casts outweigh the faster matmuls.
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BEST_METRICS = ("loss", "f1")  # `--best-metric`: what `--keep-best` chooses the delivered checkpoint by


class QuantizedModelError(ValueError):
    """The model still carries quantizer markers: Trainer cannot update it and the teacher would not be the base."""


@dataclass
class LoraRunConfig:
    data: str
    out: str
    model: str = "smollm2"
    max_steps: int = 100
    lr: float = 2e-4
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    lambda_kl: float = 1.0
    batch_size: int = 2
    grad_accum: int = 1
    max_len: int = 4096  # = `steward synth hindsight --max-tokens` default: nothing dropped unless asked
    deepspeed: str = "none"  # none | zero2 | zero3
    resume: bool = False
    save_steps: int = 50
    seed: int = 0
    tile_rows: int = 1024
    bf16: bool = False
    base_dtype: str = "float32"  # float32 | bfloat16: the frozen base weights (BASE_DTYPES)
    top_layers: int = 0  # LoRA only in the top N decoder layers; 0 = all
    max_minutes: float = 0.0  # wall-clock training budget of this process; 0 = none (stop at max_steps)
    hard_weight: int = 1  # repeat each `hard` deletion row this many times (`train.data.weigh_delete_rows`)
    skip_trivial: bool = False  # leave out deletion rows whose open cursors are all unread (never decoded)
    adapter_scope: str = "all"  # all | aux: the adapter on every token, or only on the aux thread's (train.trainer)
    aux_context: str = "full"  # full | first: an aux row's context as served, or its first message only
    eval_rows: int = 0  # held-out aux rows of the `validation` split scored during training (0 = no validation)
    eval_steps: int = 0  # score them every N steps (0 = at every checkpoint, `save_steps`)
    keep_best: bool = False  # deliver the best validation checkpoint (by `best_metric`) instead of the last state
    best_metric: str = "loss"  # loss: the lowest validation CE; f1: the highest decision F1 (`train.decisions`)
    envs: str = ""  # comma-separated environments whose rows train (and validate) the adapter; "" = every row
    mlflow: bool = True
    experiment: str = "kvsteward"
    register: bool = True
    callbacks: list = field(default_factory=list)  # extra TrainerCallbacks (tests use one to abort a run)

    def check(self) -> None:
        bad = [f"{k} must be ≥ 1 (got {getattr(self, k)})" for k in
               ("max_steps", "rank", "batch_size", "grad_accum", "save_steps", "tile_rows") if getattr(self, k) < 1]
        if self.lr <= 0:
            bad.append(f"lr must be > 0 (got {self.lr})")
        if self.base_dtype not in BASE_DTYPES:
            bad.append(f"base_dtype must be one of {tuple(BASE_DTYPES)} (got {self.base_dtype!r})")
        elif self.base_dtype != "float32" and self.deepspeed != "none":
            # ZeRO shards and casts parameters by its own precision config; a second precision knob would fight it.
            bad.append("base_dtype bfloat16 is for single-process runs; under DeepSpeed use --bf16")
        if self.top_layers < 0:
            bad.append(f"top_layers must be ≥ 0 (got {self.top_layers})")
        if not 0 <= self.dropout < 1:
            bad.append(f"lora dropout must be in [0, 1) (got {self.dropout})")
        if self.hard_weight < 1:
            bad.append(f"hard_weight must be ≥ 1 (got {self.hard_weight})")
        if self.max_minutes < 0:
            bad.append(f"max_minutes must be ≥ 0 (got {self.max_minutes})")
        if self.lambda_kl < 0:
            bad.append(f"lambda_kl must be ≥ 0 (got {self.lambda_kl})")
        if self.eval_rows < 0 or self.eval_steps < 0:
            bad.append(f"eval_rows and eval_steps must be ≥ 0 (got {self.eval_rows}, {self.eval_steps})")
        if self.eval_steps and not self.eval_rows:
            bad.append("eval_steps is set but eval_rows is 0: give --eval-rows N to score validation rows")
        if self.keep_best and not self.eval_rows:
            bad.append("keep_best needs validation rows to choose by: give --eval-rows N")
        elif self.keep_best and self.eval_steps and self.save_steps % self.eval_steps:
            # Trainer can only return to a checkpoint it scored: checkpoints must fall on validation steps.
            bad.append(f"keep_best needs save_steps ({self.save_steps}) to be a multiple of eval_steps "
                       f"({self.eval_steps})")
        if self.best_metric not in BEST_METRICS:
            bad.append(f"best_metric must be one of {BEST_METRICS} (got {self.best_metric!r})")
        elif self.best_metric == "f1" and not self.eval_rows:
            bad.append("best_metric f1 scores validation rows: give --eval-rows N")
        elif self.best_metric == "f1" and self.deepspeed != "none":
            # The decision score runs the engine on one process's whole model; ZeRO shards it across ranks.
            bad.append("best_metric f1 runs the served decoder on the whole model: not under DeepSpeed "
                       "(use --best-metric loss)")
        if self.deepspeed not in ("none", "zero2", "zero3"):
            bad.append(f"deepspeed must be none, zero2 or zero3 (got {self.deepspeed!r})")
        if self.adapter_scope not in ADAPTER_SCOPES:
            bad.append(f"adapter_scope must be all or aux (got {self.adapter_scope!r})")
        elif self.adapter_scope == "aux" and self.deepspeed == "zero3":
            # ZeRO-3 gathers weights collectively in every forward; the aux scope calls the model twice per aux row,
            # so ranks holding different numbers of aux rows would deadlock.
            bad.append("adapter_scope aux does not run under ZeRO-3 (ranks would call the model different numbers "
                       "of times); use zero2 or none")
        if self.aux_context not in AUX_CONTEXTS:
            bad.append(f"aux_context must be one of {AUX_CONTEXTS} (got {self.aux_context!r})")
        elif self.aux_context == "first" and self.adapter_scope != "aux":
            # Under scope all the adapter also runs on the context, whose cut would then change what it learns there.
            bad.append("aux_context first cuts the context the aux thread reads: it needs --adapter-scope aux")
        if bad:
            raise ValueError("; ".join(bad))


@dataclass
class LoraRunResult:
    mlflow_run_id: str | None
    adapter_dir: str
    final_ce_aux: float | None
    final_kl_main: float | None
    steps: int
    steps_this_process: int
    seconds_per_step: float | None
    eval_loss: float | None = None  # the last validation CE (None without --eval-rows)
    best_eval_loss: float | None = None  # the lowest validation CE
    best_step: int | None = None  # the best validation step by `best_metric` (the delivered adapter with keep_best)
    eval_f1: float | None = None  # the last decision F1 / precision / recall on the validation rows (`decisions`)
    eval_precision: float | None = None
    eval_recall: float | None = None
    best_eval_f1: float | None = None


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _refuse_quantized(config_or_model, where: str) -> None:
    model_marks = getattr(config_or_model, "is_quantized", False) or getattr(config_or_model, "hf_quantizer", None)
    config = getattr(config_or_model, "config", config_or_model)
    if model_marks or getattr(config, "quantization_config", None) is not None:
        raise QuantizedModelError(
            f"{where} is marked quantized (quantization_config / hf_quantizer): LoRA distillation needs a plain "
            "float model as its base. Convert it once (for the embedded model: `steward models pull smollm2`) and "
            "train from the resulting safetensors folder.")


def load_base(model: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer or None, resolved path). `model`: `smollm2`, a local folder, or a hub id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvsteward.models import from_pretrained, resolve

    path = resolve(model)
    _refuse_quantized(from_pretrained(AutoConfig, model), f"model {model!r} ({path})")  # a missing model: one line
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    _refuse_quantized(base, f"model {model!r} ({path})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # tiny test models ship without one; only the pad id is needed
    return base, tokenizer, path


def _pad_id(tokenizer, config) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None),
                  getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # padding sits outside the attention mask and the labels: any valid id works


def wrap_lora(base, cfg: LoraRunConfig):
    """LoRA on every linear projection of attention and MLP (peft's `all-linear` excludes the LM head), in every
    decoder layer or only the top `cfg.top_layers`: backward then stops at the lowest adapted layer, which is what
    makes a fixed CPU budget buy more steps."""
    from peft import LoraConfig, get_peft_model

    n_layers = base.config.num_hidden_layers
    if cfg.top_layers > n_layers:
        raise ValueError(f"top_layers={cfg.top_layers} but the model has {n_layers} decoder layers")
    layers = list(range(n_layers - cfg.top_layers, n_layers)) if cfg.top_layers else None
    # peft refuses `layers_to_transform` with the "all-linear" shorthand: spell out the same projection kinds.
    kinds = sorted({name.rsplit(".", 1)[-1] for name, mod in base.named_modules()
                    if isinstance(mod, torch.nn.Linear) and ".layers." in name}) if layers else "all-linear"
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=kinds,
                      layers_to_transform=layers, task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


def training_args(cfg: LoraRunConfig, ckpt_dir: Path):
    from transformers import TrainingArguments

    from kvsteward.train.deepspeed import config_path, init_cpu_state, prepare_launch_env

    ds = config_path(cfg.deepspeed)
    extra = {}
    if ds is not None:
        prepare_launch_env()
        if init_cpu_state():
            extra["accelerator_config"] = {"use_configured_state": True}
    if cfg.bf16 and ds is None and not torch.cuda.is_available():
        # CPU autocast to bf16: transformers refuses bf16 without a GPU unless told the run is on the CPU.
        extra["use_cpu"] = True
    return TrainingArguments(
        output_dir=str(ckpt_dir), max_steps=cfg.max_steps, learning_rate=cfg.lr,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, lr_scheduler_type="cosine", warmup_steps=0,
        logging_steps=1, save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=3,
        seed=cfg.seed, data_seed=cfg.seed, bf16=cfg.bf16, deepspeed=str(ds) if ds else None,
        remove_unused_columns=False, label_names=["labels"], report_to="none", disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(), dataloader_num_workers=0, **_validation_args(cfg), **extra)


def _validation_args(cfg: LoraRunConfig) -> dict:
    """Trainer's own evaluation loop on the validation rows; `metric_for_best_model` makes it track the best
    checkpoint (and keep it from `save_total_limit`'s deletion) whether or not it is loaded at the end."""
    if not cfg.eval_rows:
        return {"eval_strategy": "no"}
    return {"eval_strategy": "steps", "eval_steps": cfg.eval_steps or cfg.save_steps,
            "metric_for_best_model": f"eval_{cfg.best_metric}", "greater_is_better": cfg.best_metric == "f1",
            "load_best_model_at_end": cfg.keep_best}


def _params(cfg: LoraRunConfig, path: str, peft_model, n_train: int, dropped, truncated: int, trigger: str) -> dict:
    p = {k: v for k, v in asdict(cfg).items() if k not in ("callbacks", "out", "mlflow", "register")}
    trainable = sum(x.numel() for x in peft_model.parameters() if x.requires_grad)
    targets = {m.split(".")[-1] for m in peft_model.peft_config["default"].target_modules}  # full names → kinds
    p.update(model_path=path, train_rows=n_train, dropped_too_long=json.dumps(dict(dropped)),
             trigger=trigger,
             truncated_main_rows=truncated,
             target_modules=",".join(sorted(targets)),
             trainable_params=trainable, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return p


def train_lora(cfg: LoraRunConfig, log=lambda msg: None) -> LoraRunResult:
    """Train, save the adapter to `<out>/adapter`, log everything to MLflow (rank 0). Resumable with `cfg.resume`."""
    from transformers import set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from kvsteward.train.callbacks import AdapterMetaInCheckpoints, MlflowMetrics, RichProgress, WallClockBudget
    from kvsteward.train.trainer import StewardTrainer

    cfg.check()
    out = Path(cfg.out).expanduser().resolve()
    ckpt_dir, adapter_dir = out / "checkpoints", out / "adapter"
    set_seed(cfg.seed)
    args = training_args(cfg, ckpt_dir)  # before the model: under ZeRO-3 it makes from_pretrained partition weights

    splits = load_splits(cfg.data)
    if cfg.envs:
        splits = select_envs(splits, cfg.envs)
        log(f"--envs {cfg.envs}: {len(splits['train'])} train rows of those environments")
    train = splits["train"]
    trigger = dataset_trigger(cfg.data, train)  # the layout the adapter learns, recorded for the server
    if cfg.aux_context == "first":  # before fit_length: a cut row fits where its full context did not
        from kvsteward.models import load_tokenizer

        if trigger == "ids":  # the ids trigger's evidence is in the context it would cut
            raise DataError("--aux-context first needs rows with the notes or scores trigger (`steward synth "
                            "hindsight --trigger notes|scores`): with the ids trigger the evidence for each id is in "
                            "the context the cut removes")
        cut_tokenizer = load_tokenizer(cfg.model)
        train = first_message_rows(train, cut_tokenizer)
        cut_val = bool(cfg.eval_rows) and "validation" in splits
        if cut_val:  # scored as served: the adapter's server cuts its context too
            splits["validation"] = first_message_rows(splits["validation"], cut_tokenizer)
        log(f"--aux-context first: aux rows {'(training and validation) ' if cut_val else ''}cut to the "
            "conversation's first message before the trigger, as the adapter's server runs them")
    train, dropped, truncated = fit_length(train, cfg.max_len)
    if dropped or truncated:
        log(f"max_len={cfg.max_len}: dropped {dict(dropped) or 'none'}, left-truncated {truncated} main rows")
    train, difficulty = weigh_delete_rows(train, cfg.hard_weight, cfg.skip_trivial)
    if cfg.hard_weight > 1 or cfg.skip_trivial:
        log(f"deletion rows by difficulty {dict(difficulty)}: hard ×{cfg.hard_weight}"
            f"{', trivial left out' if cfg.skip_trivial else ''} → {len(train)} train rows")
    if cfg.adapter_scope == "aux":
        check_fork_points(train)
        is_aux = train["is_aux"]
        if not all(is_aux):  # the served main thread never runs the adapter: nothing to distil, so no use in training
            train = train.select([i for i, aux in enumerate(is_aux) if aux])
            log(f"--adapter-scope aux: {is_aux.count(False)} main rows left out (the main thread runs the base model)")
    val = validation_rows(splits, cfg.eval_rows, cfg.max_len, cfg.adapter_scope, cfg.seed) if cfg.eval_rows else None
    if val is not None:
        log(f"validation: {len(val)} aux rows of the 'validation' split, scored every "
            f"{cfg.eval_steps or cfg.save_steps} steps"
            f"{f' (the best checkpoint by {cfg.best_metric} is delivered)' if cfg.keep_best else ''}")
    base, tokenizer, path = load_base(cfg.model, BASE_DTYPES[cfg.base_dtype])
    check_vocab(train, base.config.vocab_size)
    if val is not None:
        check_vocab(val, base.config.vocab_size)
    decisions = _decision_rows(val, tokenizer, cfg, log) if val is not None else None
    model = wrap_lora(base, cfg)

    last = get_last_checkpoint(str(ckpt_dir)) if cfg.resume and ckpt_dir.is_dir() else None
    if cfg.resume and last is None:
        log(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
    main = is_main_process()
    tracking = cfg.mlflow and main
    run = None
    if tracking:
        import mlflow

        from kvsteward.train import tracking as trk

        trk.ensure_tracking(cfg.experiment)
        run = trk.start_run(out, resume=last is not None, run_name=out.name)
        trk.log_params_once(_params(cfg, path, model, len(train), dropped, truncated, trigger))
        if last is None:
            trk.log_dataset(train, name=f"{Path(cfg.data).name}:train", source=str(Path(cfg.data).resolve()))
            if val is not None:
                trk.log_dataset(val, name=f"{Path(cfg.data).name}:validation", source=str(Path(cfg.data).resolve()),
                                context="validation")
        else:
            mlflow.set_tag("resumed_from", Path(last).name)

    progress = RichProgress(cfg.max_steps)
    budget = [WallClockBudget(cfg.max_minutes)] if cfg.max_minutes > 0 else []
    # how it was trained, for the server: the trigger it writes, and the context it serves the aux thread on
    meta = {"trigger": trigger, "adapter_scope": cfg.adapter_scope, "aux_context": cfg.aux_context}
    envs = sorted({e for e in train["env"] if e}) if "env" in train.column_names else []
    if envs:  # the environments it saw (absent: rows without environments); eval fits its baselines on the same
        meta["train_envs"] = envs
    callbacks = [progress, AdapterMetaInCheckpoints(meta)] + ([MlflowMetrics()] if tracking else []) + budget + \
        list(cfg.callbacks)
    trainer = StewardTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                             data_collator=Collator(_pad_id(tokenizer, base.config)), lambda_kl=cfg.lambda_kl,
                             tile_rows=cfg.tile_rows, callbacks=callbacks, adapter_scope=cfg.adapter_scope,
                             decision_rows=decisions, decision_tokenizer=tokenizer if decisions else None)
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, which carries the CLI's JSON
    try:
        start_step = 0 if last is None else int(Path(last).name.split("-")[-1])
        t0 = time.perf_counter()
        trainer.train(resume_from_checkpoint=last)
        elapsed = time.perf_counter() - t0
        trainer.save_model(str(adapter_dir))  # gathers ZeRO-3 shards; PEFT writes only the adapter
        if main:
            (adapter_dir / "training_args.bin").unlink(missing_ok=True)  # a pickle: not part of the deliverable
            if tokenizer is not None:
                tokenizer.save_pretrained(str(adapter_dir))
            # How it was trained, for the server: the aux fork must write the trigger layout the rows used.
            write_adapter_meta(adapter_dir, meta)
        if tracking:
            trk.log_adapter(adapter_dir, register=cfg.register)
            mlflow.end_run()
    except BaseException:
        if tracking and mlflow.active_run():
            mlflow.end_run(status="FAILED")
        raise
    finally:
        progress.close()
    done = trainer.state.global_step - start_step
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    last_eval = evals[-1] if evals else {}
    # min / max keep the first of equal scores, as Trainer's own best-checkpoint choice does (strict improvement)
    best_ce = min(evals, key=lambda h: h["eval_loss"]) if evals else None
    scored = [h for h in evals if "eval_f1" in h]
    best_f1 = max(scored, key=lambda h: h["eval_f1"]) if scored else None
    best = best_f1 if cfg.best_metric == "f1" else best_ce
    return LoraRunResult(
        mlflow_run_id=run.info.run_id if run else None, adapter_dir=str(adapter_dir),
        final_ce_aux=trainer.last_parts.get("ce_aux"), final_kl_main=trainer.last_parts.get("kl_main"),
        steps=trainer.state.global_step, steps_this_process=done,
        seconds_per_step=elapsed / done if done else None, eval_loss=last_eval.get("eval_loss"),
        best_eval_loss=best_ce["eval_loss"] if best_ce else None, best_step=best["step"] if best else None,
        eval_f1=last_eval.get("eval_f1"), eval_precision=last_eval.get("eval_precision"),
        eval_recall=last_eval.get("eval_recall"), best_eval_f1=best_f1["eval_f1"] if best_f1 else None)


def _decision_rows(val, tokenizer, cfg: LoraRunConfig, log) -> list | None:
    """The validation rows as served-decoder inputs (`train.decisions`), or None where they cannot be scored that
    way (DeepSpeed, packed rows, no tokenizer, no deletion row), which `--best-metric f1` refuses."""
    from kvsteward.train.decisions import NEEDS, decision_rows

    why = None
    if missing := [c for c in NEEDS if c not in val.column_names]:
        why = f"the rows lack the hindsight columns {missing}"
    elif cfg.deepspeed != "none":
        why = "the served decoder runs the whole model on one process"
    elif tokenizer is None:
        why = "the model folder has no tokenizer"
    elif "segment" in val.column_names and any(val["segment"]):
        why = "packed rows hold many calls each (score them with `steward eval manager`)"
    rows = decision_rows(val, tokenizer) if why is None else None
    if rows is not None and not rows:
        why, rows = "the validation rows hold no deletion row", None
    if why is not None:
        if cfg.best_metric == "f1":
            raise DataError(f"--best-metric f1 cannot score these validation rows: {why}")
        log(f"validation: CE only, no decision scores ({why})")
    return rows
