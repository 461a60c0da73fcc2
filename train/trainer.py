"""`StewardTrainer`: a `transformers.Trainer` whose loss is CE(aux targets) + λ·KL(student ‖ teacher)(main traces).

The teacher is the same PEFT model with its adapter disabled (`disable_adapter()`), so there is no second copy of
the weights; its forward runs on every micro-batch on every rank, even when the batch holds no main row, because
ZeRO-3 gathers parameters collectively and ranks that call the model a different number of times deadlock.

`adapter_scope="aux"` trains the manager as `steward serve` runs it: the main context through the base model, only the
aux thread's own tokens with the adapter (`_aux_thread_loss`).
"""

from __future__ import annotations

import copy

import torch
from transformers import Trainer

from kvsteward.train.data import ADAPTER_SCOPES
from kvsteward.train.loss import IGNORE, ce_sum, kl_sum, target_positions


class HeadMismatchError(RuntimeError):
    """The model's logits are not `lm_head(decoder output)` (e.g. soft-capped), so gathered-row logits would lie."""


class StewardTrainer(Trainer):
    # compute_loss returns a per-micro-batch mean: let Trainer divide by the gradient-accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, lambda_kl: float = 1.0, tile_rows: int = 1024, kl_temperature: float = 1.0,
                 share_trunk: bool = True, adapter_scope: str = "all", decision_rows: list | None = None,
                 decision_tokenizer=None, **kwargs):
        super().__init__(*args, **kwargs)
        if decision_rows is not None and decision_tokenizer is None:
            raise ValueError("decision_rows need the tokenizer the served decoder reads its candidates from")
        # `train.decisions`: the served decoder on validation rows, scored beside eval_loss at every evaluation.
        self.decision_rows = decision_rows
        self.decision_tokenizer = decision_tokenizer
        if lambda_kl < 0:
            raise ValueError(f"lambda_kl must be ≥ 0, got {lambda_kl}")
        if adapter_scope not in ADAPTER_SCOPES:
            raise ValueError(f"adapter_scope must be one of {ADAPTER_SCOPES}, got {adapter_scope!r}")
        self.adapter_scope = adapter_scope
        if tile_rows < 1:
            raise ValueError(f"tile_rows must be ≥ 1, got {tile_rows}")
        self.lambda_kl = lambda_kl
        self.tile_rows = tile_rows
        self.kl_temperature = kl_temperature
        self._head_checked = False
        self._first_adapted: int | None = None
        self._last_context: tuple | None = None  # (key, KV cache) of the last aux row's context (_context_cache)
        # Sharing the frozen lower layers with the teacher is exact only if nothing in them is random.
        cfg = self._peft().config
        self._share_trunk = share_trunk and not getattr(cfg, "attention_dropout", 0.0) and \
            not getattr(cfg, "hidden_dropout", 0.0)
        # Running sums over the current logging window: [ce sum, ce batches, kl sum, kl batches] (kept on device,
        # no per-step host sync).
        self._window: torch.Tensor | None = None
        self.last_parts: dict[str, float] = {}

    # -- forward passes -------------------------------------------------------------------------------------------
    def _hidden(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, catch_trunk: bool = False,
                past_key_values=None) -> tuple[torch.Tensor, tuple[torch.Tensor, dict] | None]:
        """Final (post-norm) hidden states, caught at the decoder's output by a hook; with `catch_trunk`, also the
        input to the lowest adapted layer (hidden states, layer kwargs) for `_upper_layers`, else None.

        The model runs whole (so DeepSpeed's engine and hooks see an ordinary forward) but computes logits for the
        last position only; `output_hidden_states` would instead keep every layer's states alive, which for the
        no-grad teacher is pure waste. A 4-D boolean mask (packed rows) becomes an additive one (`_additive`).
        `past_key_values`: a cache the tokens continue (the aux scope's context).
        """
        if attention_mask.dim() == 4:
            attention_mask = self._additive(attention_mask)
        caught: list[torch.Tensor] = []
        trunk: list[tuple[torch.Tensor, dict]] = []
        decoder = self._peft().get_base_model().get_decoder()
        handles = [decoder.register_forward_hook(lambda _m, _i, out: caught.append(out[0]))]
        first = self._first_adapted_layer()
        if catch_trunk and first:  # the student's input to the lowest adapted layer, for the teacher to reuse
            def keep(_m, args, kwargs):
                trunk.append((args[0].detach() if args else kwargs["hidden_states"].detach(), kwargs))
            handles.append(decoder.layers[first].register_forward_pre_hook(keep, with_kwargs=True))
        try:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        logits_to_keep=1, use_cache=past_key_values is not None, past_key_values=past_key_values)
        finally:
            for h in handles:
                h.remove()
        hidden = caught[-1]
        if not self._head_checked:
            self._check_head(hidden, out.logits)
        return hidden, (trunk[-1] if trunk else None)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean 4-D mask (True = may attend) as an additive one in the model's dtype, which every attention
        implementation reads the same way (eager adds it; SDPA accepts it)."""
        dtype = self._head().weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed.bool(), torch.finfo(dtype).min)

    def _check_head(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        with torch.no_grad():
            ours = self._head()(hidden[:, -1:]).float()
        # Mixed precision (accelerate runs the forward under autocast, this check runs outside it) or bf16 weights
        # round the two matmuls differently; soft-capping or a logit scale moves logits by far more than bf16's
        # ~3 significant digits.
        low = self.args.bf16 or self.args.fp16 or hidden.dtype != torch.float32
        atol, rtol = (0.25, 2e-2) if low else (1e-4, 1e-3)
        if not torch.allclose(ours, logits.float(), atol=atol, rtol=rtol):
            raise HeadMismatchError(
                "the model's logits differ from lm_head(decoder output) (logit soft-capping or scaling?); "
                "the gathered-row loss supports plain LM heads only")
        self._head_checked = True

    def _peft(self):
        return self.accelerator.unwrap_model(self.model)

    def _head(self):
        return self._peft().get_output_embeddings()

    def _first_adapted_layer(self) -> int:
        """Index of the lowest decoder layer with LoRA weights (0 when every layer has them)."""
        if self._first_adapted is None:
            layers = self._peft().get_base_model().get_decoder().layers
            adapted = [i for i, layer in enumerate(layers) if any("lora_" in n for n, _ in layer.named_parameters())]
            self._first_adapted = min(adapted, default=0)
        return self._first_adapted

    def _teacher_hidden(self, model, inputs: dict, main_rows: torch.Tensor,
                        trunk: tuple[torch.Tensor, dict] | None = None) -> torch.Tensor:
        """Teacher hidden states for the main rows (or row 0 when there is none: the call itself must happen).

        With LoRA on the top layers only (`--top-layers`), the layers below compute the same function with the
        adapter on or off, so given `trunk`, the student's input to the lowest adapted layer (from
        `_hidden(catch_trunk=True)`), the teacher runs only the layers above it: its cost drops by the share of
        frozen layers. Exact only without dropout in the shared layers, which is checked on the config.
        """
        sel = main_rows.nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            sel = torch.zeros(1, dtype=torch.long, device=main_rows.device)
        peft = self._peft()
        was_training = peft.training
        peft.eval()  # the teacher is the deterministic base model: no dropout
        try:
            with torch.no_grad(), peft.disable_adapter():
                if trunk is not None:
                    hidden = self._upper_layers(trunk, sel, main_rows.shape[0])
                else:
                    pos = inputs.get("position_ids")
                    hidden, _ = self._hidden(model, inputs["input_ids"][sel], inputs["attention_mask"][sel],
                                             None if pos is None else pos[sel])
        finally:
            peft.train(was_training)
        full = hidden.new_zeros((main_rows.shape[0],) + hidden.shape[1:])
        full[sel] = hidden
        return full

    def _upper_layers(self, trunk: tuple[torch.Tensor, dict], sel: torch.Tensor, batch: int) -> torch.Tensor:
        """The decoder from the lowest adapted layer up (and its final norm), on the kept input of rows `sel`."""
        hidden, kwargs = trunk

        def rows(x):  # per-row tensors follow `sel`; broadcast ones (batch dim 1) and non-tensors pass as they are
            if isinstance(x, tuple):
                return tuple(rows(t) for t in x)
            return x[sel] if torch.is_tensor(x) and x.dim() and x.shape[0] == batch and batch > 1 else x

        kw = {k: rows(v) for k, v in kwargs.items()}
        h = hidden[sel]
        decoder = self._peft().get_base_model().get_decoder()
        for layer in decoder.layers[self._first_adapted_layer():]:
            h = layer(h, **kw)
            h = h[0] if isinstance(h, tuple) else h
        return decoder.norm(h)

    # -- loss -----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.adapter_scope == "aux":
            return self._aux_thread_loss(model, inputs, return_outputs)
        labels = inputs["labels"]
        aux = inputs.get("aux_tokens")
        if aux is None:  # a batch from another collator: every labelled token of an is_aux row is a CE target
            aux = (labels != IGNORE) & inputs["is_aux"].bool()[:, None]
        main = (labels != IGNORE) & ~aux  # the KL mask: main rows, and the trunk of packed rows
        student, trunk = self._hidden(model, inputs["input_ids"], inputs["attention_mask"],
                                      inputs.get("position_ids"), catch_trunk=self._share_trunk)
        teacher = self._teacher_hidden(model, inputs, main.any(dim=1), trunk)
        head = self._head()

        ab, at, ay = target_positions(labels, aux)
        ce = ce_sum(head, student[ab, at], ay, self.tile_rows) / max(ab.numel(), 1)
        mb, mt, _ = target_positions(labels, main)
        kl = kl_sum(head, student[mb, mt], teacher[mb, mt], self.tile_rows, self.kl_temperature)
        kl = kl / max(mb.numel(), 1)
        # `+ 0·sum(student)` keeps every trainable parameter in the graph when a batch has no labelled token at all.
        loss = ce + self.lambda_kl * kl + 0.0 * student.sum()

        self._accumulate(ce.detach(), ab.numel() > 0, kl.detach(), mb.numel() > 0)
        return (loss, {"ce_aux": ce.detach(), "kl_main": kl.detach()}) if return_outputs else loss

    def _aux_thread_loss(self, model, inputs, return_outputs=False):
        """CE of the aux targets exactly as the server computes them (`serve/engine/session.py`: main threads run the
        base model, the aux fork runs the adapter). Per row: the main context (tokens before `fork_at`, a packed row's
        trunk under its tree mask) goes through the base model without grad into a KV cache; the aux thread's tokens
        (trigger, opener, target; a packed row's branches) run with the adapter on that cache, each seeing what its
        mask allows. Only those few dozen tokens carry gradients, so a row costs about one no-grad forward of its
        context. The main thread never runs the adapter, so there is nothing to distil: no KL term (kl_main unset).
        """
        ids, labels, thread = inputs["input_ids"], inputs["labels"], inputs["aux_thread"].bool()
        mask, pos = inputs["attention_mask"], inputs.get("position_ids")
        head = self._head()
        total, count = None, 0
        for i in range(ids.shape[0]):
            n = int(inputs["lengths"][i])
            run = thread[i, :n]
            if not run.any():
                continue
            ctx, own = (~run).nonzero()[:, 0], run.nonzero()[:, 0]
            allowed = mask[i, 0, :n, :n].bool() if mask.dim() == 4 else \
                torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            p = pos[i, :n] if pos is not None else torch.arange(n, device=ids.device)
            cache = self._context_cache(model, ids[i, ctx], p[ctx], allowed[ctx][:, ctx])
            keys = torch.cat([ctx, own])  # the cache holds the context's keys, then the aux tokens' own
            hidden, _ = self._hidden(model, ids[i, own][None], allowed[own][:, keys][None, None], p[own][None],
                                     past_key_values=cache)
            lab = labels[i, own]
            k = (lab[1:] != IGNORE).nonzero()[:, 0] + 1  # token k is predicted at k − 1, which must be its own
            if not k.numel():
                continue
            if not bool((own[k - 1] == own[k] - 1).all()):
                raise ValueError(f"row {i}: a labelled aux token follows a main-context token; the aux thread's "
                                 "first token must be unlabelled (its trigger header)")
            part = ce_sum(head, hidden[0, k - 1], lab[k], self.tile_rows)
            total = part if total is None else total + part
            count += k.numel()
        if total is None:  # no aux-thread token in the batch: a zero loss that still reaches every trainable weight
            total = sum(0.0 * w.sum() for w in model.parameters() if w.requires_grad)
        ce = total / max(count, 1)
        self._accumulate(ce.detach(), count > 0, ce.new_zeros(()), False)
        return (ce, {"ce_aux": ce.detach()}) if return_outputs else ce

    def _context_cache(self, model, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor):
        """KV cache of a row's main context through the base model, without grad. The base is frozen and (when
        `_share_trunk`) has no dropout, so the cache is a function of (tokens, positions, mask): rows with the same
        context (`--aux-context first` cuts every row to the same first message) reuse the last one, copied because
        the aux forward appends to it. Never under DeepSpeed: ZeRO-3 gathers parameters collectively, and a rank that
        skipped a forward its peers make would deadlock them."""
        reuse = self._share_trunk and not self.is_deepspeed_enabled
        key = (tuple(ids.tolist()), tuple(pos.tolist()), allowed.cpu().numpy().tobytes()) if reuse else None
        if reuse and self._last_context is not None and self._last_context[0] == key:
            return copy.deepcopy(self._last_context[1])
        with torch.no_grad(), self._peft().disable_adapter():
            cache = model(input_ids=ids[None], position_ids=pos[None], use_cache=True, logits_to_keep=1,
                          attention_mask=self._additive(allowed[None, None])).past_key_values
        if reuse:
            self._last_context = (key, copy.deepcopy(cache))
        return cache

    # -- logging --------------------------------------------------------------------------------------------------
    def _accumulate(self, ce: torch.Tensor, has_ce: bool, kl: torch.Tensor, has_kl: bool) -> None:
        step = torch.stack([ce * has_ce, ce.new_tensor(float(has_ce)), kl * has_kl, kl.new_tensor(float(has_kl))])
        self._window = step.double() if self._window is None else self._window + step.double()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training-step log; every rank reaches it, so the all-reduce below is safe
            window = self._window if self._window is not None else torch.zeros(4, dtype=torch.float64)
            if self.args.world_size > 1:
                window = self.accelerator.reduce(window.to(self.args.device), reduction="sum")
            self._window = None
            ce_s, ce_n, kl_s, kl_n = window.tolist()
            if ce_n:
                logs["ce_aux"] = self.last_parts["ce_aux"] = ce_s / ce_n
            if kl_n:
                logs["kl_main"] = self.last_parts["kl_main"] = kl_s / kl_n
        super().log(logs, start_time)

    def evaluation_loop(self, dataloader, *args, metric_key_prefix: str = "eval", **kwargs):
        out = super().evaluation_loop(dataloader, *args, metric_key_prefix=metric_key_prefix, **kwargs)
        if self.decision_rows is not None:
            out.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self._score_decisions().items()})
        return out

    def _score_decisions(self) -> dict[str, float]:
        from kvsteward.serve.engine import Engine
        from kvsteward.train.decisions import score

        model = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():  # Engine() puts the model in eval mode; `training_step` puts it back in train mode
            return score(Engine(model, self.decision_tokenizer), self.decision_rows)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Evaluation (`--eval-rows`): the aux CE alone, so `eval_loss` reads the same in both scopes (the validation
        # rows are aux rows; a packed row's trunk would add a KL term under scope `all`), and no logits (they would
        # be batch × time × vocab). The training-log window is left untouched.
        saved = self._window
        with torch.no_grad():
            _, parts = self.compute_loss(model, inputs, return_outputs=True)
        self._window = saved
        return parts["ce_aux"].detach(), None, None
