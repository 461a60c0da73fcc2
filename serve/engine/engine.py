"""The engine: one model (any HF Llama / Qwen3-style decoder with RoPE) and the sessions that run on it."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext

import torch

from kvsteward.serve.engine.blueprint import PlannedSpan, parse_blueprint
from kvsteward.serve.engine.policies import (
    ARMS,
    PLAN_ONLY_REFRESH_ARMS,
    POLICIES,
    REFRESH_ARMS,
    TAIL_REFRESH_ARMS,
    TIERED_ARMS,
    get_policy,
)
from kvsteward.serve.engine.session import Session, SessionConfig
from kvsteward.serve.engine.spill import SpillStore, host_store


class Engine:
    def __init__(self, model, tokenizer=None, trigger_style: str = "ids", aux_context: str = "full",
                 close_bias: float = 0.0, min_confidence: float | None = None):
        from kvsteward.kernels.rope import detect_model_rope
        from kvsteward.models import check_close_bias, check_min_confidence
        from kvsteward.synth.traces.hindsight import check_aux_context, check_trigger_style

        self.model = model.eval()
        # The deletion trigger the aux thread writes, and the context it follows (the whole session, or its first
        # message): the layout the adapter was trained on (`adapter_meta`).
        self.trigger_style = check_trigger_style(trigger_style)
        self.aux_context = check_aux_context(aux_context)
        # The close bias chosen for this adapter on validation traces (`steward eval calibrate`): the aux thread's
        # default (`AuxConfig.close_bias`, `steward eval manager --close-bias` override it).
        self.close_bias = check_close_bias(close_bias)
        # ... and the confidence rule chosen with it (None: the greedy list; `AuxConfig.min_confidence`).
        self.min_confidence = check_min_confidence(min_confidence)
        # The aux thread's prefilled first messages (`serve.manager.thread.first_message_session`), by (role, token
        # ids, chunk): kept across decisions and sessions, least recently used out beyond `aux_head_tokens` tokens in
        # all.
        self.aux_heads: OrderedDict[tuple, Session] = OrderedDict()
        self.aux_head_tokens = 8192
        self.is_peft = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        self._tuner_layers: list | None = None  # the PEFT layers `_base_only` switches off (found on first use)
        self.tokenizer = tokenizer
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        if getattr(cfg, "num_key_value_heads", None) is None:
            raise ValueError(f"{cfg.model_type} ({type(model).__name__}) is not a model family the engine runs: its "
                             "config has no num_key_value_heads (the engine's attention path is the Llama / Qwen / "
                             "Mistral / Phi / GLM one)")
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # Each layer's layout and rotary dim as the model's own rotary code applies them (probed on the model: GLM
        # interleaves, HF's Llama ignores partial_rotary_factor, SmolLM3 skips RoPE in some layers, Gemma3's local
        # layers use other frequencies); raises UnsupportedRope, naming the layer, for types a static re-rotation
        # cannot make exact and for rotary code no spec reproduces.
        self.rope = detect_model_rope(model)
        self.sliding_window_layer, self.sliding_window = _sliding_window(model)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        self._spill: SpillStore | None = None

    @property
    def spill(self) -> SpillStore:
        """Where tiered arms keep evicted planned KV (host memory unless set, e.g. by the server to disk / Valkey)."""
        if self._spill is None:
            self._spill = host_store()
        return self._spill

    @spill.setter
    def spill(self, store: SpillStore) -> None:
        self._spill = store

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Where a greedy reply ends: the model's EOS ids plus the chat template's end-of-turn token, if any."""
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        return self.eos_ids + tuple(vocab[t] for t in ("<|im_end|>",) if t in vocab and vocab[t] not in self.eos_ids)

    def adapter(self, enabled: bool):
        """Context for one forward: a PEFT model runs with its adapter only when `enabled` (the aux thread);
        the main thread always sees the base model."""
        if self.is_peft and not enabled:
            return self._base_only()
        return nullcontext()

    @contextmanager
    def _base_only(self):
        """The adapter's layers off for one forward, set back after. By hand rather than PEFT's `disable_adapter()`:
        that walks every module twice per call (`get_model_status`, then `enable_adapter_layers`), 0.15 s on
        SmolLM2, and a main forward of a session runs under it: a third of an evaluation's wall time was that walk.
        This flips the same per-layer flag (`_disable_adapters`, what a LoRA layer's forward reads) on the layers
        found once."""
        if self._tuner_layers is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._tuner_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        layers = self._tuner_layers
        before = [layer._disable_adapters for layer in layers]
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer, was in zip(layers, before, strict=True):
                layer._disable_adapters = was

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32, adapter: str | None = None) -> Engine:
        """`model` as accepted by `kvsteward.models.resolve`; `adapter` a PEFT LoRA folder for the aux thread."""
        from kvsteward import models

        if adapter is not None:
            models.check_adapter(adapter)
        m, tok = models.load(model, dtype=dtype)
        if adapter is None:
            return cls(m, tok)
        from peft import PeftModel

        meta = models.adapter_meta(adapter)
        return cls(PeftModel.from_pretrained(m, adapter), tok, meta["trigger"], meta["aux_context"],
                   meta["close_bias"], meta["min_confidence"])

    def session(self, policy: str = "full", budget: int | None = None, chunk: int = 512, limit: int | None = None,
                blueprint: str | list | None = None, per_head: bool = False, per_layer: bool = False,
                **policy_overrides) -> Session:
        """A new session. `policy` is a policy name (positions bounded iff `limit` is given) or a named arm
        (positions-only, retention-only, pace, pace-tiered, pace-refresh: the arm fixes the position mode; bounded arms
        need `limit`; pace-tiered also keeps evicted planned spans in `self.spill` and rehydrates them; pace-refresh,
        when a step that reads a planned span opens, drops what is outside the plan, its readers and the first message
        and re-encodes the rest; pace-refresh-tail re-encodes only past the fresh prefix; pace-refresh-window keeps the
        recent window and re-encodes it with the plan). `per_head`: each (layer, KV head) keeps its own top-B slots by
        its own attention scores (the shared selection step run per head; `SessionConfig.per_head`); `per_layer`: each
        layer keeps its own top-B by its KV heads' averaged scores (`SessionConfig.per_layer`, on the per-head
        table)."""
        name = policy
        if policy in ARMS and policy not in POLICIES:  # a named arm = a policy + a position mode
            name, bounded = ARMS[policy]
            if bounded and limit is None:
                raise ValueError(f"arm {policy!r} uses bounded positions: give limit L")
            if not bounded and limit is not None:
                raise ValueError(f"arm {policy!r} has unbounded positions: do not give a limit")
        pol = get_policy(name, **policy_overrides)
        if blueprint is None:
            spans = []
        elif isinstance(blueprint, list) and all(isinstance(s, PlannedSpan) for s in blueprint):
            spans = blueprint
        else:
            spans = parse_blueprint(blueprint)
        cfg = SessionConfig(policy=pol, budget=budget if pol.evicts else None, chunk=chunk, limit=limit,
                            blueprint=spans, spill=self.spill if policy in TIERED_ARMS else None,
                            refresh=policy in REFRESH_ARMS, refresh_tail=policy in TAIL_REFRESH_ARMS,
                            refresh_plan_only=policy in PLAN_ONLY_REFRESH_ARMS, per_head=per_head or per_layer,
                            per_layer=per_layer)
        return Session(self, cfg)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


_KWARGS_PROBE = "kvsteward_attention_kwargs_probe"


def _attention_kwargs(model) -> dict[int, dict]:
    """What each layer's attention passes to the attention function (sliding_window, softcap), read by running the
    model once on two tokens with a recording attention (modules name their window in different places: Gemma3's
    attribute, Mistral's config)."""
    from transformers import AttentionInterface

    from kvsteward.kernels.rope import ProbeCache

    seen: dict[int, dict] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = {k: kwargs.get(k) for k in ("sliding_window", "softcap")}
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    AttentionInterface.register(_KWARGS_PROBE, record)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = _KWARGS_PROBE
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), past_key_values=ProbeCache(),
                  use_cache=True)
    finally:
        config._attn_implementation = previous
    return seen


def _sliding_window(model) -> tuple[int | None, int | None]:
    """(layer, window) of the smallest sliding window among the model's attention layers, or (None, None).

    The engine's attention has no window: it is exact for a sliding-window layer only while the resident tokens fit
    in it (sessions check this before every forward). Logit soft-capping (Gemma2) it does not implement at all, so
    such a model is refused here, naming the layer."""
    best: tuple[int | None, int | None] = (None, None)
    for layer, kwargs in sorted(_attention_kwargs(model).items()):
        if kwargs["softcap"]:
            raise ValueError(f"{model.config.model_type} layer {layer} soft-caps its attention logits, which the "
                             f"engine's attention does not do: this model family is not one the engine runs")
        window = kwargs["sliding_window"]
        if window and (best[1] is None or window < best[1]):
            best = (layer, int(window))
    return best
