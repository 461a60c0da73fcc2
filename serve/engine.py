"""The engine: one model (any HF Llama / Qwen3-style decoder with RoPE) and the sessions that run on it."""

from __future__ import annotations

import torch

from kvsteward.serve.blueprint import PlannedSpan, parse_blueprint
from kvsteward.serve.policies import ARMS, get_policy
from kvsteward.serve.session import Session, SessionConfig


class Engine:
    def __init__(self, model, tokenizer=None):
        from kvsteward.kernels.rope import rope_spec

        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.rope = rope_spec(cfg)  # raises UnsupportedRope for types a static re-rotation cannot make exact

    @classmethod
    def load(cls, model: str, dtype: torch.dtype = torch.float32) -> Engine:
        from kvsteward import models

        m, tok = models.load(model, dtype=dtype)
        return cls(m, tok)

    def session(self, policy: str = "full", budget: int | None = None, chunk: int = 512, limit: int | None = None,
                blueprint: str | list | None = None, **policy_overrides) -> Session:
        """A new session. `policy` is a policy name or a named arm (h2o, positions-only, retention-only, pace);
        arms with bounded positions need `limit`."""
        if policy in ARMS and policy not in ("full",):
            name, bounded = ARMS[policy]
            if bounded and limit is None:
                raise ValueError(f"arm {policy!r} uses bounded positions: give limit L")
            if not bounded:
                limit = None
        else:
            name = policy
        pol = get_policy(name, **policy_overrides)
        spans = blueprint if isinstance(blueprint, list) and all(isinstance(s, PlannedSpan) for s in blueprint) \
            else parse_blueprint(blueprint) if blueprint is not None else []
        cfg = SessionConfig(policy=pol, budget=budget if pol.evicts else None, chunk=chunk, limit=limit,
                            blueprint=spans)
        return Session(self, cfg)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8
