"""RoPE re-rotation: the float64 truth is anchored to transformers' own rotary code, and every re-rotation is
compared with a direct float64 rotation at the new position (never with another fp32 computation)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.gptj import modeling_gptj as gptj
from transformers.models.llama import modeling_llama as llama

from kvsteward.kernels import check
from kvsteward.kernels.rope import (
    LAYOUTS,
    SUPPORTED_ROPE_TYPES,
    RopeSpec,
    UnsupportedRope,
    apply_rope,
    rerotate,
    rerotate_reference,
    rope_spec,
    rotation_cos_sin,
)

TYPES_X_LAYOUTS = [(t, lay) for t in SUPPORTED_ROPE_TYPES for lay in LAYOUTS]


def llama_config(rope_type: str = "default", head_dim: int = 64, kv_heads: int = 3) -> LlamaConfig:
    """SmolLM2-like geometry (theta 1e5, 8K positions), tiny otherwise; rope params from the check's static set."""
    base = LlamaConfig(vocab_size=64, hidden_size=head_dim * kv_heads, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    return check.with_rope_type(base, rope_type)


def spec_of(rope_type: str, layout: str = "split_half", **kw) -> RopeSpec:
    return rope_spec(llama_config(rope_type, **kw), layout)


# ------------------------------------------------------------------------------------- anchored to transformers

@pytest.mark.parametrize("rope_type", SUPPORTED_ROPE_TYPES)
def test_inv_freq_and_scaling_match_llama_rotary_embedding(rope_type):
    config = llama_config(rope_type)
    hf = llama.LlamaRotaryEmbedding(config)
    spec = rope_spec(config)
    assert spec.inv_freq.dtype == torch.float64 and spec.rope_type == rope_type
    torch.testing.assert_close(spec.inv_freq.float(), hf.inv_freq, rtol=1e-6, atol=0)
    assert spec.attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    if rope_type == "yarn":  # factor 4: mscale 0.1 ln 4 + 1, must be carried (and only applied by apply_rope)
        assert spec.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


def _hf_llama_keys(config, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    rotary = llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(raw.float(), positions[None])
    _, k = llama.apply_rotary_pos_emb(raw.float()[None], raw.float()[None], cos, sin)
    return k[0].double()


@pytest.mark.parametrize("rope_type", SUPPORTED_ROPE_TYPES)
def test_apply_rope_matches_hf_llama(rope_type):
    config = llama_config(rope_type)
    spec = rope_spec(config)
    raw = torch.randn(3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    near = torch.arange(64)  # angles < 64 rad: HF's float32 angles are within ~64 * 6e-8 rad
    err = (apply_rope(raw, near, spec) - _hf_llama_keys(config, raw, near)).abs().max().item()
    assert err < 3e-5
    # Up to 8K HF's own fp32 angles drift by ~pos * 6e-8 rad; anything structurally wrong would be O(1).
    far = torch.randint(0, 8192, (64,), generator=torch.Generator().manual_seed(2))
    err_far = (apply_rope(raw, far, spec) - _hf_llama_keys(config, raw, far)).abs().max().item()
    assert 3e-5 < err_far < 3e-3, "HF's fp32 rotation at 8K should be measurably off (our fp32 re-rotation: 1e-5)"


def test_partial_rotary_matches_gpt_neox():
    config = GPTNeoXConfig(vocab_size=64, hidden_size=128, num_attention_heads=2, num_hidden_layers=1,
                           intermediate_size=32, partial_rotary_factor=0.25, max_position_embeddings=4096)
    spec = rope_spec(config)
    assert (spec.head_dim, spec.rotary_dim) == (64, 16)
    hf_inv, _ = neox.GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    torch.testing.assert_close(spec.inv_freq.float(), hf_inv, rtol=1e-6, atol=0)
    raw = torch.randn(2, 32, 64, dtype=torch.float64)
    pos = torch.arange(32)
    cos, sin = neox.GPTNeoXRotaryEmbedding(config)(raw.float(), pos[None])
    _, k = neox.apply_rotary_pos_emb(raw.float()[None], raw.float()[None], cos, sin)
    ours = apply_rope(raw, pos, spec)
    assert (ours - k[0].double()).abs().max().item() < 5e-6
    assert torch.equal(ours[..., 16:], raw[..., 16:])  # the pass-through tail is untouched


def test_interleaved_matches_gptj():
    head_dim, rotary_dim, n = 48, 32, 40
    spec = RopeSpec(inv_freq=1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)),
                    head_dim=head_dim, rotary_dim=rotary_dim, layout="interleaved", rope_type="default",
                    attention_scaling=1.0)
    raw = torch.randn(1, n, 2, head_dim)  # GPT-J's layout: [batch, seq, heads, head_dim]
    sincos = gptj.create_sinusoidal_positions(n, rotary_dim)[None]
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    k_rot = gptj.apply_rotary_pos_emb(raw[..., :rotary_dim], sin, cos)
    hf = torch.cat((k_rot, raw[..., rotary_dim:]), dim=-1)[0].transpose(0, 1)  # -> [heads, seq, head_dim]
    ours = apply_rope(raw[0].transpose(0, 1).double(), torch.arange(n), spec)
    assert (ours - hf.double()).abs().max().item() < 5e-6


def test_hand_worked_quarter_and_half_turns():
    # pair 0 turns by pi/2 per position, pair 1 by pi: (x, y) -> (-y, x) and (x, y) -> (-x, -y) at delta 1.
    inv = torch.tensor([math.pi / 2, math.pi], dtype=torch.float64)
    k = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    delta = torch.tensor([1])
    split = RopeSpec(inv, 4, 4, "split_half", "default", 1.0)  # pairs (0, 2) and (1, 3)
    inter = RopeSpec(inv, 4, 4, "interleaved", "default", 1.0)  # pairs (0, 1) and (2, 3)
    torch.testing.assert_close(rerotate_reference(k, delta, split, torch.float32),
                               torch.tensor([[-3.0, -2.0, 1.0, -4.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rerotate_reference(k, delta, inter, torch.float32),
                               torch.tensor([[-2.0, 1.0, -3.0, -4.0]]), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------- re-rotation vs the truth

@pytest.mark.parametrize("max_pos", [8192, 32768])
def test_fp32_rerotation_equals_direct_rotation(max_pos):
    errors = check.rerotation_errors(llama_config(), n=256, max_pos=max_pos, seed=max_pos)
    assert set(errors) == {f"{t}/{lay}" for t, lay in TYPES_X_LAYOUTS}
    assert max(errors.values()) <= 1e-5, errors


def test_float32_angles_would_fail_the_bound():
    # The bound above is meaningful: the same re-rotation with angles computed in float32 misses it at 32K.
    spec = spec_of("default")
    raw = torch.randn(3, 256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    old, new = torch.zeros(256, dtype=torch.int64), torch.randint(16384, 32768, (256,))
    angles32 = (new - old).float()[:, None] * spec.inv_freq.float()[None]
    k_old = apply_rope(raw, old, spec).float()
    bad = torch.cat((k_old[..., :32] * angles32.cos() - k_old[..., 32:] * angles32.sin(),
                     k_old[..., 32:] * angles32.cos() + k_old[..., :32] * angles32.sin()), dim=-1)
    truth = apply_rope(raw, new, spec)
    assert (bad.double() - truth).abs().max().item() > 1e-4
    assert (rerotate(k_old, new - old, spec, torch.float32).double() - truth).abs().max().item() <= 1e-5


def test_bf16_ulp_helper_hand_worked():
    ulp = check.bf16_ulp(torch.tensor([1.0, 1.5, 2.0, 0.75, -3.0]))
    assert ulp.tolist() == [2**-7, 2**-7, 2**-6, 2**-8, 2**-6]
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    assert (one + 2**-7).item() == 1 + 2**-7 and (one + 2**-9).item() == 1.0  # 8 significant bits


def test_bf16_rerotation_within_one_rounding_step():
    assert check.bf16_rerotation_error(llama_config(), n=256, seed=4) <= 1.0
    # Independent of the ulp helper: the bf16 output is bf16(truth) or its neighbour (bit patterns 1 apart).
    spec = spec_of("yarn", "interleaved")
    raw = torch.randn(3, 256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    old, new = torch.randint(0, 8192, (256,)), torch.randint(0, 8192, (256,))
    got = rerotate(apply_rope(raw, old, spec).float(), new - old, spec, torch.bfloat16)
    truth = apply_rope(raw, new, spec)
    clear = truth.abs() > 1e-2  # away from cancellation (see check._CANCELLATION_FLOOR)
    steps = (got.view(torch.int16).int() - truth.to(torch.bfloat16).view(torch.int16).int()).abs()
    assert steps[clear].max().item() <= 1
    assert (got.double() - truth)[~clear].abs().max().item() <= 2**-14


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_500_renumbers_reference_path_does_not_drift_chained_does(rope_type):
    drift = check.renumber_drift(llama_config(rope_type, head_dim=16, kv_heads=2), steps=500, n=64, seed=6)
    # every renumber is a single rounding from the fp32 reference: the same <= 1 ulp bound as one renumber (the abs
    # error may still double vs step 0 when a later step puts a value in a higher binade, hence ulps here)
    assert drift["single_renumber_max_bf16_ulp"] <= 1.0 and drift["reference_max_bf16_ulp"] <= 1.0, drift
    # bf16 roundings accumulate along the chain
    assert drift["chained_max_bf16_ulp"] > 4.0, drift
    assert drift["chained_max_abs_err"] > 5 * drift["reference_max_abs_err"], drift


# -------------------------------------------------------------------------------------------- triton kernel

TRITON_CASES = [(lay, hd, rd) for lay in LAYOUTS for hd, rd in ((64, 64), (80, 40), (12, 8))]


def _triton_case(layout: str, head_dim: int, rotary_dim: int) -> tuple[RopeSpec, torch.Tensor, torch.Tensor]:
    """A spec and random keys / deltas for one kernel case (leading dims of the keys are flattened by the kernel)."""
    inv = 1.0 / (1e5 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    spec = RopeSpec(inv, head_dim, rotary_dim, layout, "default", 1.0)
    gen = torch.Generator().manual_seed(7)
    ref_k = torch.randn(2, 3, 37, head_dim, generator=gen)
    return spec, ref_k, torch.randint(-32768, 32768, (37,), generator=gen)


@pytest.mark.parametrize("layout,head_dim,rotary_dim", TRITON_CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_interpreter_equals_torch_reference(monkeypatch, layout, head_dim, rotary_dim, out_dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel is jitted lazily, so this takes effect here
    spec, ref_k, delta = _triton_case(layout, head_dim, rotary_dim)
    got = rerotate(ref_k, delta, spec, out_dtype)  # "auto" picks triton under TRITON_INTERPRET=1
    want = rerotate_reference(ref_k, delta, spec, out_dtype)
    assert got.dtype == out_dtype and got.shape == ref_k.shape
    assert (got.float() - want.float()).abs().max().item() <= 1e-6
    assert torch.equal(got, want)  # same cos/sin, same unfused float32 ops, same rounding: bit-identical
    assert torch.equal(got[..., rotary_dim:], ref_k[..., rotary_dim:].to(out_dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the Triton kernel for a real GPU")
@pytest.mark.parametrize("layout,head_dim,rotary_dim", TRITON_CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_equals_torch_on_cuda_and_the_cpu_reference(monkeypatch, layout, head_dim, rotary_dim,
                                                                    out_dtype):
    """The GPU check (skipped without CUDA): the compiled kernel against the torch path on the same device, and
    against the CPU reference within float32 rounding of the float64 angles."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec, ref_k, delta = _triton_case(layout, head_dim, rotary_dim)
    got = rerotate(ref_k.cuda(), delta.cuda(), spec, out_dtype)  # "auto" picks triton for a CUDA tensor
    same_device = rerotate(ref_k.cuda(), delta.cuda(), spec, out_dtype, backend="torch")
    assert got.is_cuda and got.dtype == out_dtype
    assert torch.equal(got, same_device)  # same cos/sin, unfused float32 ops on both paths
    want = rerotate_reference(ref_k, delta, spec, torch.float32).double()
    tol = torch.full_like(want, 1e-5) if out_dtype == torch.float32 else check.bf16_ulp(want)
    assert ((got.cpu().double() - want).abs() <= tol).all()


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = spec_of("default")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rerotate(torch.zeros(1, 2, 64), torch.zeros(2, dtype=torch.int64), spec, torch.float32, backend="triton")


def test_triton_kernel_compiles_for_hopper_without_fma():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvsteward.kernels import rerotate_triton as rt

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton's nvidia backend is not installed")
    spec = RopeSpec(torch.ones(20, dtype=torch.float64), 80, 40, "interleaved", "default", 1.0)
    signature = {"x_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*i16", "n_rows": "i32",
                 "n_slots": "i32"}
    constexprs = rt.launch_constexprs(spec, torch.bfloat16)
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn=triton.jit(rt._rerotate_kernel), signature=signature,
                                        constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    assert "cubin" in compiled.asm and "fma.rn.f32" not in compiled.asm["ptx"]


# ---------------------------------------------------------------------------------------- errors and properties

@pytest.mark.parametrize("rope_type,extra", [("dynamic", {"factor": 2.0}),
                                             ("longrope", {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8})])
def test_sequence_length_dependent_rope_is_refused(rope_type, extra):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                         rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, **extra})
    with pytest.raises(UnsupportedRope, match=rope_type):
        rope_spec(config)


def test_bad_inputs_are_named():
    spec = spec_of("default")
    with pytest.raises(TypeError, match="delta"):
        rerotate(torch.zeros(2, 64), torch.zeros(2, dtype=torch.int32), spec, torch.float32)
    with pytest.raises(ValueError, match="head_dim=64"):
        rerotate(torch.zeros(2, 32), torch.zeros(2, dtype=torch.int64), spec, torch.float32)
    with pytest.raises(ValueError, match="layout"):
        rope_spec(llama_config(), layout="gptj")
    with pytest.raises(ValueError, match="backend"):
        rerotate(torch.zeros(2, 64), torch.zeros(2, dtype=torch.int64), spec, torch.float32, backend="cuda")


def test_precomputed_cos_sin_are_reused_exactly():
    spec = spec_of("linear")
    k = torch.randn(4, 3, 10, 64)  # e.g. [layers, heads, slots, head_dim]: any leading dims
    delta = torch.randint(-5000, 5000, (10,))
    cos_sin = rotation_cos_sin(delta, spec)
    assert torch.equal(rerotate(k, delta, spec, torch.bfloat16, cos_sin=cos_sin),
                       rerotate_reference(k, delta, spec, torch.bfloat16))
    with pytest.raises(ValueError, match="cos_sin"):
        rerotate(k, delta, spec, torch.float32, cos_sin=(cos_sin[0][:5], cos_sin[1][:5]))


def test_rotation_cos_sin_is_float64_exact_then_cast():
    spec = spec_of("llama3")
    delta = torch.tensor([0, 1, 8191, -32767])
    cos, sin = rotation_cos_sin(delta, spec)
    angles = delta.double()[:, None] * spec.inv_freq[None]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (4, 32)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())


@functools.cache
def small_spec(rope_type: str, layout: str) -> RopeSpec:
    return spec_of(rope_type, layout, head_dim=16, kv_heads=2)


_deltas = st.lists(st.integers(-32768, 32768), min_size=5, max_size=5)


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(TYPES_X_LAYOUTS), a=_deltas, b=_deltas, seed=st.integers(0, 2**16))
def test_composition_and_identity(which, a, b, seed):
    spec = small_spec(*which)
    k = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed))
    a, b = torch.tensor(a), torch.tensor(b)
    twice = rerotate(rerotate(k, a, spec, torch.float32), b, spec, torch.float32)
    torch.testing.assert_close(twice, rerotate(k, a + b, spec, torch.float32), atol=2e-6, rtol=0)
    assert torch.equal(rerotate(k, torch.zeros(5, dtype=torch.int64), spec, torch.float32), k)
