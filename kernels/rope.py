"""Exact RoPE re-rotation: RopeSpec from an HF config, float64 angles, torch reference, direct float64 truth.

A key stored after RoPE at position p is moved to p' as K' = R(p') R(p)^-1 K = R(p' - p) K. The engine always
rotates from an fp32 *reference* key (never by chaining rotations), and the angles delta * inv_freq are computed in
float64 and only then cast: in fp32, p * theta loses about p * 6e-8 rad, i.e. ~5e-4 rad at position 8K.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
LAYOUTS = ("split_half", "interleaved")
BACKENDS = ("auto", "torch", "triton")
# transformers evaluates inv_freq in float32 (pow, divide, blend): a few float32 ulps from the float64 value.
_HF_RTOL = 1e-6

# Why each known-but-unsupported type cannot be re-rotated exactly by a static delta rotation.
_UNSUPPORTED_WHY = {
    "dynamic": "dynamic NTK scaling recomputes inv_freq from the current sequence length, so the rotation of a "
               "stored key depends on when it was computed and a static re-rotation by a delta cannot be exact",
    "longrope": "longrope switches between short and long frequency factors by sequence length, so the rotation "
                "of a stored key depends on the sequence length at the time it was computed",
}


class UnsupportedRope(ValueError):
    """The model's RoPE cannot be re-rotated exactly (dynamic / sequence-length dependent, or unknown type)."""


@dataclass(frozen=True, eq=False)  # eq=False: a tensor field makes `==` ambiguous; specs compare by identity
class RopeSpec:
    inv_freq: torch.Tensor  # float64 [rotary_dim // 2], static scaling of the rope type already applied
    head_dim: int
    rotary_dim: int  # == head_dim unless partial rotary; only the first rotary_dim dims are rotated
    layout: str  # "split_half" (HF rotate_half) or "interleaved" (GPT-J rotate_every_two)
    rope_type: str
    attention_scaling: float  # applied by the model to cos/sin; a re-rotation by a delta must not apply it again

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown RoPE layout {self.layout!r}: use one of {LAYOUTS}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.inv_freq.dtype != torch.float64 or self.inv_freq.shape != (self.rotary_dim // 2,):
            raise ValueError(f"inv_freq must be float64 of shape ({self.rotary_dim // 2},), got "
                             f"{self.inv_freq.dtype} {tuple(self.inv_freq.shape)}")

    @property
    def half(self) -> int:
        return self.rotary_dim // 2


# ---------------------------------------------------------------------------------------------------- spec from config

def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _flat_rope_parameters(config, layer_type: str | None) -> dict:
    """The (standardized) rope parameter dict of `config`, picking `layer_type` when the config nests them."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise UnsupportedRope(f"{type(config).__name__} has no rope_parameters: is this a RoPE model?")
    config.standardize_rope_params()
    params = config.rope_parameters
    nested = _nested_keys(config, params)
    if nested:
        if layer_type is None:
            raise UnsupportedRope(f"rope_parameters are per layer type {nested}: pass layer_type= to rope_spec")
        return params[layer_type]
    if layer_type is not None:
        raise ValueError(f"layer_type={layer_type!r} given but rope_parameters are not nested by layer type")
    return params


def _nested_keys(config, params: dict) -> list[str]:
    """The keys `rope_parameters` is nested under (per layer type), or [] for one flat dict.

    transformers 5.23 (this project's pin) has `PreTrainedConfig.nested_rope_parameter_keys`; 5.12.1 (sglang
    0.5.19-0.5.21's pin, in an SGLang server's environment) has not, and its `standardize_rope_params` treats the
    parameters as nested exactly when the config declares `layer_types` and every key is one of them: the same rule
    here."""
    method = getattr(config, "nested_rope_parameter_keys", None)
    if method is not None:
        return method(params)
    labels = getattr(config, "layer_types", None) or ()
    return list(params) if labels and params and set(params) <= set(labels) else []


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3_inv_freq(params: dict, dim: int) -> torch.Tensor:
    # Same formula as transformers' _compute_llama3_parameters, evaluated in float64.
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(params: dict, dim: int, max_position_embeddings: int) -> torch.Tensor:
    # Same formula as transformers' _compute_yarn_parameters, evaluated in float64.
    base = params["rope_theta"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _hf_reference(config, rope_type: str, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """transformers' own (float32 inv_freq, attention_scaling) for a non-default rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)


def _check_against_hf(inv_freq: torch.Tensor, hf_inv_freq: torch.Tensor, rope_type: str) -> None:
    hf = hf_inv_freq.detach().cpu().double()
    if hf.shape != inv_freq.shape or not torch.allclose(inv_freq, hf, rtol=_HF_RTOL, atol=0.0):
        worst = (inv_freq - hf).abs().div(inv_freq).max().item() if hf.shape == inv_freq.shape else float("nan")
        raise RuntimeError(f"float64 inv_freq for rope_type {rope_type!r} disagrees with transformers' float32 one "
                           f"(max rel err {worst:.2e}): did transformers change its formula? update kernels/rope.py")


def rope_spec(config, layout: str = "split_half", layer_type: str | None = None,
              rotary_dim: int | None = None) -> RopeSpec:
    """RopeSpec of an HF PretrainedConfig (`config.rope_parameters`), with inv_freq in float64.

    `layout` and `rotary_dim` (default: head_dim x the config's partial_rotary_factor) are what the model's rotary
    code does, which the config alone does not say (GLM interleaves; HF's Llama ignores partial_rotary_factor):
    `detect_rope_spec(model)` finds both by probing the model itself.

    transformers' init functions hard-code float32 (`dtype=torch.float`), so their inv_freq is off by up to ~6e-8
    relative, i.e. ~1e-3 rad at position 32K. We therefore evaluate the same formulas in float64 here, take
    attention_scaling from transformers itself, and check our float64 inv_freq rounds to transformers' float32 one:
    if transformers ever changes a formula, this raises instead of silently rotating by different frequencies.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown RoPE layout {layout!r}: use one of {LAYOUTS}")
    config = copy.deepcopy(config)  # HF's helpers standardize (mutate) the config they are given
    params = _flat_rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = _UNSUPPORTED_WHY.get(rope_type, "it is not one of the statically verified types")
        raise UnsupportedRope(f"rope_type {rope_type!r} is not supported for exact re-rotation: {why} "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    head_dim = _head_dim(config)
    if rotary_dim is None:
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    elif rotary_dim != int(head_dim * params.get("partial_rotary_factor", 1.0)):
        # transformers' init functions read the factor from the config: give them the rotary dim asked for.
        params["partial_rotary_factor"] = rotary_dim / head_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedRope(f"rotary dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor) must be even "
                              f"and at most head_dim")
    if rope_type == "default":
        # "default" is not in ROPE_INIT_FUNCTIONS (each model class carries its own copy of the same formula, with
        # attention_scaling 1.0); tests anchor it to LlamaRotaryEmbedding and GPTNeoXRotaryEmbedding (partial rotary).
        return RopeSpec(inv_freq=_default_inv_freq(params["rope_theta"], rotary_dim), head_dim=head_dim,
                        rotary_dim=rotary_dim, layout=layout, rope_type=rope_type, attention_scaling=1.0)
    if rope_type == "linear":
        inv_freq = _default_inv_freq(params["rope_theta"], rotary_dim) / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(params, rotary_dim)
    else:
        inv_freq = _yarn_inv_freq(params, rotary_dim, config.max_position_embeddings)
    hf_inv_freq, attention_scaling = _hf_reference(config, rope_type, layer_type)
    _check_against_hf(inv_freq, hf_inv_freq, rope_type)
    return RopeSpec(inv_freq=inv_freq, head_dim=head_dim, rotary_dim=rotary_dim, layout=layout,
                    rope_type=rope_type, attention_scaling=float(attention_scaling))


# ---------------------------------------------------------------------------------------------------------- rotation

def _check_positions(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.int64 or x.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int64 tensor, got {x.dtype} of shape {tuple(x.shape)}")


def _angles(positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """float64 [n, rotary_dim // 2]: exact integer positions times float64 frequencies."""
    return positions.to(torch.float64)[:, None] * spec.inv_freq.to(positions.device)[None, :]


def rotation_cos_sin(delta: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of delta * inv_freq as float32 [n, rotary_dim // 2]: angles and cos/sin in float64, cast once."""
    _check_positions("delta", delta)
    # A renumber moves whole runs of slots by the same delta: evaluate the float64 cos/sin once per distinct delta.
    distinct, index = torch.unique(delta, return_inverse=True)
    angles = _angles(distinct, spec)
    return angles.cos().float()[index], angles.sin().float()[index]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate pairs of x[..., n, head_dim] by per-slot cos/sin [n, half]; the non-rotated tail is copied."""
    rot, tail = x[..., : spec.rotary_dim], x[..., spec.rotary_dim:]
    if spec.layout == "split_half":
        x1, x2 = rot[..., : spec.half], rot[..., spec.half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, tail), dim=-1) if tail.shape[-1] else out


def _check_keys(k: torch.Tensor, n: int, spec: RopeSpec) -> None:
    if not k.is_floating_point() or k.dim() < 2:
        raise TypeError(f"keys must be a floating tensor [..., n, head_dim], got {k.dtype} {tuple(k.shape)}")
    if k.shape[-1] != spec.head_dim or k.shape[-2] != n:
        raise ValueError(f"keys of shape {tuple(k.shape)} do not match [..., n={n}, head_dim={spec.head_dim}]")


def rerotate_reference(ref_k: torch.Tensor, delta: torch.Tensor, spec: RopeSpec,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """torch reference of R(delta) ref_k: ref_k [..., n, head_dim] (slot dim -2), delta int64 [n].

    The multiply-add runs in float32 (float64 if ref_k is float64) and is cast once to out_dtype at the end.
    """
    _check_positions("delta", delta)
    _check_keys(ref_k, delta.shape[0], spec)
    return _rerotate_torch(ref_k, *rotation_cos_sin(delta.to(ref_k.device), spec), spec, out_dtype)


def _rerotate_torch(ref_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec,
                    out_dtype: torch.dtype) -> torch.Tensor:
    compute = torch.promote_types(ref_k.dtype, torch.float32)
    return _rotate(ref_k.to(compute), cos.to(compute), sin.to(compute), spec).to(out_dtype)


def _pick_backend(ref_k: torch.Tensor, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "auto":
        return "triton" if ref_k.is_cuda or interpret else "torch"
    if backend == "triton" and not (ref_k.is_cuda or interpret):
        raise ValueError("backend='triton' needs a CUDA tensor, or TRITON_INTERPRET=1 to run the kernel on CPU")
    return backend


def rerotate(ref_k: torch.Tensor, delta: torch.Tensor, spec: RopeSpec, out_dtype: torch.dtype,
             backend: str = "auto", cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """R(delta) ref_k cast to out_dtype. backend: "torch", "triton", or "auto" (triton on CUDA or under
    TRITON_INTERPRET=1, torch otherwise). cos/sin always come from rotation_cos_sin (float64 angles); pass
    cos_sin=rotation_cos_sin(delta, spec) to reuse them across layers that move by the same delta."""
    _check_positions("delta", delta)
    _check_keys(ref_k, delta.shape[0], spec)
    cos, sin = cos_sin if cos_sin is not None else rotation_cos_sin(delta.to(ref_k.device), spec)
    if cos.shape != (delta.shape[0], spec.half) or sin.shape != cos.shape:
        raise ValueError(f"cos_sin must be two [{delta.shape[0]}, {spec.half}] tensors from rotation_cos_sin")
    cos, sin = cos.to(ref_k.device), sin.to(ref_k.device)
    if _pick_backend(ref_k, backend) == "torch":
        return _rerotate_torch(ref_k, cos, sin, spec, out_dtype)
    from kvsteward.kernels.rerotate_triton import rerotate_triton

    return rerotate_triton(ref_k, cos, sin, spec, out_dtype)


def apply_rope(raw_k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Direct RoPE of pre-RoPE keys raw_k [..., n, head_dim] at absolute positions (int64 [n]), float64 throughout,
    including spec.attention_scaling on the rotated dims: the model's own rotary embedding, without fp32 error."""
    _check_positions("positions", positions)
    _check_keys(raw_k, positions.shape[0], spec)
    angles = _angles(positions.to(raw_k.device), spec)
    cos, sin = angles.cos() * spec.attention_scaling, angles.sin() * spec.attention_scaling
    return _rotate(raw_k.to(torch.float64), cos, sin, spec)


# ------------------------------------------------------------------------------------------------ per-layer specs

@dataclass(frozen=True, eq=False)
class ModelRope:
    """The rotary spec of every layer of a model. A layer's spec is None when it applies no RoPE (SmolLM3's
    `no_rope_layers`): its keys do not depend on position, so a reposition leaves them as they are. Layers that
    rotate alike share one RopeSpec object (Gemma3: one for the local layers, one for the global ones), so the float64
    cos/sin of a move are evaluated once per distinct spec, not once per layer."""

    layers: tuple[RopeSpec | None, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a ModelRope needs at least one layer")
        dims = {s.head_dim for s in self.layers if s is not None}
        if len(dims) > 1:
            raise ValueError(f"layers disagree on head_dim: {sorted(dims)}")

    @classmethod
    def uniform(cls, spec: RopeSpec, n_layers: int) -> ModelRope:
        return cls((spec,) * n_layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> RopeSpec | None:
        return self.layers[layer]

    @property
    def specs(self) -> list[RopeSpec]:
        """The distinct specs, in order of first use."""
        return list({id(s): s for s in self.layers if s is not None}.values())

    @property
    def single(self) -> RopeSpec:
        """The one spec every layer uses; raises for a model whose layers differ (or that skip RoPE somewhere)."""
        specs = self.specs
        if len(specs) != 1 or any(s is None for s in self.layers):
            raise ValueError(f"the layers of this model rotate differently ({self.describe()}): use the per-layer "
                             f"spec (rope[layer])")
        return specs[0]

    # The common one-spec case reads like a RopeSpec (the float64 reference, reports).
    inv_freq = property(lambda self: self.single.inv_freq)
    layout = property(lambda self: self.single.layout)
    rotary_dim = property(lambda self: self.single.rotary_dim)
    head_dim = property(lambda self: self.single.head_dim)

    def describe(self) -> str:
        """e.g. 'split_half/default rotary_dim=64 theta-set 0 (layers 0-2, 4-6), no RoPE (layers 3, 7)'."""
        groups: dict[int, tuple[str, list[int]]] = {}
        for i, s in enumerate(self.layers):
            label = "no RoPE" if s is None else f"{s.layout}/{s.rope_type} rotary_dim={s.rotary_dim} " \
                                                f"inv_freq[0..1]={s.inv_freq[:2].tolist()}"
            groups.setdefault(id(s), (label, []))[1].append(i)
        return "; ".join(f"{label} (layers {_ranges(idx)})" for label, idx in groups.values())

    def rotations(self, delta: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin of `delta` for every distinct spec (keyed by id), evaluated once each (float64, cast once)."""
        return {id(s): rotation_cos_sin(delta, s) for s in self.specs}

    def rerotate_layer(self, layer: int, ref_k: torch.Tensor, delta: torch.Tensor, out_dtype: torch.dtype,
                       rotations: dict | None = None, backend: str = "auto") -> torch.Tensor:
        """R(delta) ref_k with layer `layer`'s spec; a layer without RoPE returns its keys unchanged (cast)."""
        spec = self.layers[layer]
        if spec is None:
            return ref_k.to(out_dtype)
        cos_sin = rotations.get(id(spec)) if rotations is not None else None
        return rerotate(ref_k, delta, spec, out_dtype, backend=backend, cos_sin=cos_sin)


def _ranges(idx: list[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None], strict=True):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def as_model_rope(rope: RopeSpec | ModelRope, n_layers: int) -> ModelRope:
    return rope if isinstance(rope, ModelRope) else ModelRope.uniform(rope, n_layers)


def _layer_types(config) -> list[str | None]:
    """Each layer's rope-parameter key (Gemma3: 'sliding_attention' / 'full_attention'), or None per layer when the
    config's rope parameters are one flat dict."""
    n = config.num_hidden_layers
    cfg = copy.deepcopy(config)
    params = getattr(cfg, "rope_parameters", None)
    if not params:
        return [None] * n
    cfg.standardize_rope_params()
    nested = _nested_keys(cfg, cfg.rope_parameters)
    if not nested:
        return [None] * n
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != n or any(t not in nested for t in types):
        raise UnsupportedRope(f"rope_parameters are nested by {nested} but layer_types {types} do not name one for "
                              f"each of the {n} layers")
    return types


def config_model_rope(config, layout: str = "split_half") -> ModelRope:
    """Per-layer specs read from an HF config alone (no model to probe: the SGLang backend): `no_rope_layers`
    (SmolLM3: 0 = the layer applies no RoPE) and rope parameters nested by `layer_types` (Gemma3). Every other
    per-layer rotary difference is invisible in a config: `detect_model_rope` probes a model instead."""
    n = config.num_hidden_layers
    use_rope = getattr(config, "no_rope_layers", None)
    if use_rope is not None and len(use_rope) != n:
        raise UnsupportedRope(f"no_rope_layers has {len(use_rope)} entries for {n} layers")
    by_type: dict[str | None, RopeSpec] = {}
    layers: list[RopeSpec | None] = []
    for i, layer_type in enumerate(_layer_types(config)):
        if use_rope is not None and not use_rope[i]:
            layers.append(None)
            continue
        if layer_type not in by_type:
            by_type[layer_type] = rope_spec(config, layout, layer_type)
        layers.append(by_type[layer_type])
    return ModelRope(tuple(layers))


# ------------------------------------------------------------------------------------------------ spec from a model

# Tolerance of the probe (max abs error / max |key|) by the model's dtype: a few roundings of the key and of cos/sin
# (and, for a model cast with .to(dtype), of its inv_freq buffer: at most |delta| * 2^-9 rad in bf16). A wrong layout
# or rotary dim misses by O(0.1-1) at these deltas.
_PROBE_TOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_PROBE_TOKENS = 24


class ProbeCache:
    """The cache protocol the engine gives the model (`update` per layer): keeps every layer's keys, caches
    nothing (each forward is a fresh prefill)."""

    is_compileable = False

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.keys[layer_idx] = key_states.detach()
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    # Attention's output is not needed: every layer's input is made equal across the two rows anyway (see _keys).
    return torch.zeros_like(query).transpose(1, 2).contiguous(), None


_PROBE_ATTENTION = "kvsteward_rope_probe"


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and type(m).__name__.endswith("Attention")]


def _same_input_hook(module, args, kwargs):
    """Row 1 of the probe batch gets row 0's hidden states: each layer's keys then differ between the rows by the
    rotation of their positions alone, not by what earlier layers made of those positions."""
    if "hidden_states" in kwargs:
        h = kwargs["hidden_states"].clone()
        h[1] = h[0]
        return args, {**kwargs, "hidden_states": h}
    h = args[0].clone()
    h[1] = h[0]
    return (h, *args[1:]), kwargs


def _keys(model, tokens: torch.Tensor, positions: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every layer's keys [2, kv_heads, n, head_dim] for `tokens` at positions[0] (row 0) and positions[1] (row 1),
    as each attention hands them to the cache (after its RoPE), both rows computed from the same layer input.

    Runs under a registered attention name with no mask function (as the engine's own "steward" attention), so
    transformers builds no mask from the stub cache."""
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_ATTENTION, _probe_attention)
    cache = ProbeCache()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = _PROBE_ATTENTION
    hooks = [m.register_forward_pre_hook(_same_input_hook, with_kwargs=True) for m in _attention_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids=tokens[None].expand(2, -1), position_ids=positions, past_key_values=cache, use_cache=True)
    finally:
        config._attn_implementation = previous
        for h in hooks:
            h.remove()
    return cache.keys


def _candidates(config, layer_type: str | None):
    """(layout x rotary_dim) specs: rotary_dim = the config's (head_dim x partial_rotary_factor) and head_dim.
    The config's own spec is built first so an unsupported rope type raises UnsupportedRope as from rope_spec."""
    first = rope_spec(config, LAYOUTS[0], layer_type)
    yield first
    for layout in LAYOUTS:
        for rotary_dim in dict.fromkeys((first.rotary_dim, first.head_dim)):
            if (layout, rotary_dim) == (first.layout, first.rotary_dim):
                continue
            try:
                yield rope_spec(config, layout, layer_type, rotary_dim=rotary_dim)
            except (UnsupportedRope, RuntimeError):  # e.g. transformers' yarn formula cannot take this rotary dim
                continue


def _layer_spec(name: str, layer: int, k_old: torch.Tensor, k_new: torch.Tensor, delta: torch.Tensor,
                candidates: list[RopeSpec], tol: float) -> RopeSpec | None:
    """The candidate (or None: no RoPE) with R(delta) K_old == K_new at this layer; UnsupportedRope naming the layer
    when none does."""
    if candidates and candidates[0].head_dim != k_old.shape[-1]:
        raise UnsupportedRope(f"{name}: layer {layer}'s keys have {k_old.shape[-1]} dims but the config says "
                              f"head_dim {candidates[0].head_dim}")
    scale = k_new.abs().max().item() or 1.0
    tried = [((k_old - k_new).abs().max().item() / scale, None)]
    for spec in candidates:
        err = (rerotate_reference(k_old, delta, spec, torch.float64) - k_new).abs().max().item() / scale
        tried.append((err, spec))
    err, best = min(tried, key=lambda t: t[0])
    if err > tol:
        got = ", ".join("no RoPE: " if s is None else f"{s.layout}/rotary_dim={s.rotary_dim}: " + f"{e:.1e}"
                        for e, s in tried)
        raise UnsupportedRope(f"{name}: at layer {layer} no exact re-rotation reproduces the model's own rotary code "
                              f"(relative error {got}; tolerance {tol:.0e}), so the engine cannot reposition its keys "
                              f"exactly")
    return best


def detect_model_rope(model, seed: int = 0) -> ModelRope:
    """The rotary spec of every layer, found by probing the model itself.

    The config does not say how a model applies RoPE: GLM rotates interleaved pairs of the first half of the head,
    HF's Llama ignores a `partial_rotary_factor` in its config and rotates the whole head, Phi / StableLM rotate a
    leading slice, SmolLM3 skips RoPE in every 4th layer, Gemma3 uses other frequencies in its local layers. So the
    same tokens run at positions p (batch row 0) and p' (row 1), every attention's input made equal across the rows,
    and per layer the spec (no RoPE, or layout x rotary dim of the layer type's parameters) with
    R(p' - p) K(p) == K(p') is taken. A layer none matches (or a model not handing keys to the cache) raises
    UnsupportedRope naming the layer: the engine refuses what it cannot re-rotate exactly.
    """
    config = model.config
    name = f"{getattr(config, 'model_type', '?')} ({type(model).__name__})"
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    n = _PROBE_TOKENS
    tokens = torch.randint(0, config.vocab_size, (n,), generator=gen)
    old = 16 + 3 * torch.arange(n)  # distinct, moderate positions: fp32 angle error stays ~1e-6
    delta = torch.randint(-13, 14, (n,), generator=gen)
    keys = _keys(model, tokens.to(param.device), torch.stack([old, old + delta]).to(param.device))
    n_layers = config.num_hidden_layers
    missing = [i for i in range(n_layers) if i not in keys]
    if missing:
        raise UnsupportedRope(f"{name}: its attention does not hand keys to past_key_values.update (layers "
                              f"{_ranges(missing)}), so the engine cannot read (or re-rotate) its keys")
    tol = _PROBE_TOL.get(param.dtype, 5e-2)
    candidates: dict[str | None, list[RopeSpec]] = {}
    layers = []
    for i, layer_type in enumerate(_layer_types(config)):
        if layer_type not in candidates:
            candidates[layer_type] = list(_candidates(config, layer_type))
        k = keys[i].double().cpu()
        layers.append(_layer_spec(name, i, k[0], k[1], delta, candidates[layer_type], tol))
    return ModelRope(tuple(layers))


def detect_rope_spec(model, seed: int = 0) -> RopeSpec:
    """The one RopeSpec every layer of `model` uses (`detect_model_rope(model).single`)."""
    return detect_model_rope(model, seed).single
