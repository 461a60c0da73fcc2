"""Triton kernel: fused RoPE re-rotation + cast, both layouts, partial rotary (non-rotated tail copied).

cos/sin come precomputed from `rotation_cos_sin` (float64 angles, cast to float32), so every backend rotates by the
same angles; the kernel only does the float32 multiply-add and the single cast to the output dtype. FP fusion is
off so the GPU rounds x*cos and x'*sin separately, exactly as the torch reference does: both backends agree bit for
bit (given the same cos/sin), which keeps cache states reproducible across backends.

The kernel is jitted lazily, once per interpreter mode: triton decides between the compiler and the CPU
interpreter (TRITON_INTERPRET=1) when a function is decorated, so decorating at import time would freeze whatever
the environment said when this module was first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from kvsteward.kernels.rope import RopeSpec

_BLOCK_ROWS = 16
_KERNELS: dict[bool, object] = {}
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rerotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, n_slots,
                     HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                     OUT_BF16: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    # One program handles BLOCK_ROWS rows of the flattened [rows, HEAD_DIM] keys; row r is slot r % n_slots.
    # Every output column c is x[c] * cos + sign * x[partner(c)] * sin (partner/sign from the layout); columns past
    # ROT are copied. One formula for all columns keeps a single rounding + store path for the whole row.
    HALF: tl.constexpr = ROT // 2
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    slots = (rows % n_slots).to(tl.int64)
    base = rows.to(tl.int64)[:, None] * HEAD_DIM
    c = tl.arange(0, D_P2)
    if INTERLEAVED:
        j = c // 2
        partner = c ^ 1
        first = (c % 2) == 0
    else:
        first = c < HALF
        j = tl.where(first, c, c - HALF)
        partner = tl.where(first, c + HALF, c - HALF)
    is_rot = c < ROT
    partner = tl.where(is_rot, partner, c)
    mask = (rows < n_rows)[:, None] & (c < HEAD_DIM)[None, :]
    rot_mask = mask & is_rot[None, :]
    x = tl.load(x_ptr + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + base + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    cs = slots[:, None] * HALF + j[None, :]
    cos = tl.load(cos_ptr + cs, mask=rot_mask, other=1.0)
    sin = tl.load(sin_ptr + cs, mask=rot_mask, other=0.0)
    sin = tl.where(first[None, :], -sin, sin)
    y = tl.where(is_rot[None, :], x * cos + xp * sin, x)
    if OUT_BF16:
        # Round to nearest even by hand: the interpreter's float32 -> bfloat16 cast truncates, the GPU's rounds, and
        # both must agree with torch's .to(torch.bfloat16). out_ptr is the output viewed as int16.
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(y != y, 0x7FC00000, bits)  # keep NaN a NaN (the add could carry it into inf)
        tl.store(out_ptr + base + c[None, :], (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + base + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _kernel():
    interpret = bool(knobs.runtime.interpret)
    if interpret not in _KERNELS:
        _KERNELS[interpret] = triton.jit(_rerotate_kernel)
    return _KERNELS[interpret]


def rerotate_triton(ref_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """R(delta) ref_k with precomputed float32 cos/sin [n, rotary_dim // 2]; ref_k [..., n, head_dim], any leading
    dims (flattened). Returns a new contiguous tensor of ref_k's shape in out_dtype."""
    n = ref_k.shape[-2]
    if ref_k.shape[-1] != spec.head_dim:
        raise ValueError(f"ref_k last dim {ref_k.shape[-1]} != head_dim {spec.head_dim}")
    if cos.shape != (n, spec.half) or sin.shape != (n, spec.half):
        raise ValueError(f"cos/sin must be [{n}, {spec.half}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos/sin must be float32 (from rotation_cos_sin), got {cos.dtype} / {sin.dtype}")
    if cos.device != ref_k.device or sin.device != ref_k.device:
        raise ValueError(f"cos/sin on {cos.device}/{sin.device} but ref_k on {ref_k.device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    x = ref_k.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows = x.numel() // spec.head_dim
    if n_rows == 0:
        return out
    grid = (triton.cdiv(n_rows, _BLOCK_ROWS),)
    out_arg = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
    _kernel()[grid](x, cos.contiguous(), sin.contiguous(), out_arg, n_rows, n, **launch_constexprs(spec, out_dtype),
                    enable_fp_fusion=False)
    return out


def launch_constexprs(spec: RopeSpec, out_dtype: torch.dtype) -> dict:
    """Compile-time parameters of one kernel specialization (also used to compile ahead of time in tests)."""
    return dict(HEAD_DIM=spec.head_dim, D_P2=triton.next_power_of_2(spec.head_dim), ROT=spec.rotary_dim,
                INTERLEAVED=spec.layout == "interleaved", OUT_BF16=out_dtype == torch.bfloat16, BLOCK_ROWS=_BLOCK_ROWS)
