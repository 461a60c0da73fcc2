"""Accuracy checks of RoPE re-rotation against a float64 truth (used by `steward engine check` and the tests).

Every check rotates random pre-RoPE keys directly (float64, `apply_rope`) to get both the stored key and the
truth, so errors are measured against exact math, never against another fp32 computation.
"""

from __future__ import annotations

import copy

import torch

from kvsteward.kernels.rope import LAYOUTS, SUPPORTED_ROPE_TYPES, RopeSpec, apply_rope, rerotate, rope_spec

# Below 2^-8 of its pair's norm an element is the result of cancellation: the float32 rotation (error ~2^-23 of the
# norm) cannot resolve a bf16 ulp there, so the ulp is taken at this floor instead of at the tiny value itself.
_CANCELLATION_FLOOR = 2.0**-8


def static_rope_parameters(config, rope_type: str) -> dict:
    """Sensible static parameters of `rope_type`, keeping the config's rope_theta (and partial rotary factor)."""
    params = copy.deepcopy(config).rope_parameters or {}
    keep = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
    original_max = config.max_position_embeddings // 4
    extra = {
        "default": {},
        "linear": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": original_max},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": original_max},
    }
    if rope_type not in extra:
        raise ValueError(f"no static test parameters for rope_type {rope_type!r}; known: {sorted(extra)}")
    return {"rope_type": rope_type, **keep, **extra[rope_type]}


def with_rope_type(config, rope_type: str):
    """A copy of `config` whose RoPE is `rope_type` with `static_rope_parameters`."""
    out = copy.deepcopy(config)
    out.rope_parameters = static_rope_parameters(config, rope_type)
    return out


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _sample(spec: RopeSpec, heads: int, n: int, max_pos: int, gen: torch.Generator):
    raw = torch.randn(heads, n, spec.head_dim, dtype=torch.float64, generator=gen)
    old = torch.randint(0, max_pos, (n,), generator=gen)
    new = torch.randint(0, max_pos, (n,), generator=gen)
    return raw, old, new


def _all_specs(config):
    for rope_type in SUPPORTED_ROPE_TYPES:
        typed = with_rope_type(config, rope_type)
        for layout in LAYOUTS:
            yield f"{rope_type}/{layout}", rope_spec(typed, layout)


def _rerotated_vs_truth(config, spec: RopeSpec, n: int, max_pos: int, gen: torch.Generator,
                        out_dtype: torch.dtype, device: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    raw, old, new = _sample(spec, _kv_heads(config), n, max_pos, gen)
    k_old = apply_rope(raw, old, spec).float().to(device)  # the fp32 reference key the engine keeps
    k_new = rerotate(k_old, (new - old).to(device), spec, out_dtype, backend=backend)
    return k_new.cpu().double(), apply_rope(raw, new, spec)


def rerotation_errors(config, n: int = 512, max_pos: int | None = None, seed: int = 0, device: str = "cpu",
                      backend: str = "auto") -> dict[str, float]:
    """Max abs error of fp32 re-rotation p -> p' vs the float64 direct rotation at p', per "<rope_type>/<layout>".

    device/backend: where and how the re-rotation runs (device="cuda" checks the Triton kernel); truth is CPU float64.
    """
    gen = torch.Generator().manual_seed(seed)
    max_pos = max_pos or config.max_position_embeddings
    out = {}
    for name, spec in _all_specs(config):
        got, truth = _rerotated_vs_truth(config, spec, n, max_pos, gen, torch.float32, device, backend)
        out[name] = (got - truth).abs().max().item()
    return out


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers (8 significant bits) at |x|: 2^(floor(log2|x|) - 7), for normal |x|."""
    _, exponent = torch.frexp(x.double().abs())  # |x| = m * 2^e with m in [0.5, 1): floor(log2|x|) = e - 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (exponent - 8).to(torch.int32))


def pair_norm(k: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Per element, the norm of the rotation pair it belongs to (invariant under rotation); |k| for the tail."""
    rot, tail = k[..., : spec.rotary_dim], k[..., spec.rotary_dim:]
    if spec.layout == "split_half":
        norm = torch.hypot(rot[..., : spec.half], rot[..., spec.half:])
        norm = torch.cat((norm, norm), dim=-1)
    else:
        norm = torch.hypot(rot[..., 0::2], rot[..., 1::2]).repeat_interleave(2, dim=-1)
    return torch.cat((norm, tail.abs()), dim=-1)


def ulp_error(got: torch.Tensor, truth: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """|got - truth| in bf16 ulps at the true value (ulp floored at 2^-8 of the pair norm, see _CANCELLATION_FLOOR)."""
    truth = truth.double()
    scale = torch.maximum(truth.abs(), _CANCELLATION_FLOOR * pair_norm(truth, spec))
    return (got.double() - truth).abs() / bf16_ulp(scale)


def bf16_rerotation_error(config, n: int = 512, max_pos: int | None = None, seed: int = 0, device: str = "cpu",
                          backend: str = "auto") -> float:
    """Max error, in bf16 ulps at the value, of re-rotation with bf16 output, over all rope types and layouts."""
    gen = torch.Generator().manual_seed(seed)
    max_pos = max_pos or config.max_position_embeddings
    worst = 0.0
    for _, spec in _all_specs(config):
        got, truth = _rerotated_vs_truth(config, spec, n, max_pos, gen, torch.bfloat16, device, backend)
        worst = max(worst, ulp_error(got, truth, spec).max().item())
    return worst


def renumber_drift(config, steps: int = 500, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   n: int = 256, max_pos: int | None = None, device: str = "cpu",
                   backend: str = "auto") -> dict[str, float]:
    """`steps` successive renumbers to random positions, stored in `dtype`, with the config's own RoPE.

    reference path: rotate the fp32 reference key (taken at the first position) by p_t - p_0 each time (the engine);
    chained path: rotate the stored `dtype` key by p_t - p_{t-1} each time (what the engine must never do).
    Errors vs the float64 direct rotation at p_t, max over all steps: "<path>_max_abs_err" and, in bf16 ulps at the
    value (`ulp_error`), "<path>_max_bf16_ulp", for path in reference, chained, single_renumber (the first step).
    """
    spec = rope_spec(config)
    gen = torch.Generator().manual_seed(seed)
    max_pos = max_pos or config.max_position_embeddings
    raw, pos0, _ = _sample(spec, _kv_heads(config), n, max_pos, gen)
    ref = apply_rope(raw, pos0, spec).float().to(device)
    chained, prev = ref.to(dtype), pos0
    worst = {"reference": [0.0, 0.0], "chained": [0.0, 0.0], "single_renumber": [0.0, 0.0]}  # [abs, ulp]
    for step in range(steps):
        pos = torch.randint(0, max_pos, (n,), generator=gen)
        truth = apply_rope(raw, pos, spec)
        from_ref = rerotate(ref, (pos - pos0).to(device), spec, dtype, backend=backend).cpu()
        chained = rerotate(chained.float(), (pos - prev).to(device), spec, dtype, backend=backend)
        prev = pos
        paths = {"reference": from_ref, "chained": chained.cpu()}
        if step == 0:
            paths["single_renumber"] = from_ref
        for name, got in paths.items():
            worst[name][0] = max(worst[name][0], (got.double() - truth).abs().max().item())
            worst[name][1] = max(worst[name][1], ulp_error(got, truth, spec).max().item())
    out = {f"{name}_max_abs_err": err for name, (err, _) in worst.items()}
    out.update({f"{name}_max_bf16_ulp": ulp for name, (_, ulp) in worst.items()})
    return out
