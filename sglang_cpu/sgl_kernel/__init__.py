"""A stand-in for `sgl_kernel` on a CPU without AMX: the functions sglang's CPU path imports, in plain torch.

On CPU (`SGLANG_USE_CPU_ENGINE=1`) sglang 0.5.21 imports a few `*_cpu` functions from `sgl_kernel` at module level,
unconditionally (not gated on AMX). The package index has no CPU build of it (the `sglang-kernel` wheels hold only
CUDA objects; the source builds its AVX-512 code only with AMX-BF16). Every other `torch.ops.sgl_kernel.*_cpu` call
in sglang is gated on `cpu_has_amx_support()`, which reads whether those ops are registered: this package registers
none, so the check stays false and each layer uses its `forward_native` torch path.

- `assign_req_to_token_pool_cpu` (`srt/mem_cache/allocation.py`, every extend) and `copy_all_layer_kv_cache_cpu`
  (`kernels/ops/kvcache/cache_move.py`, KV moves between slots) are implemented here, exactly.
- The speculative-decoding helpers that `srt/speculative/*` and `kernels/ops/speculative/*` import are names only:
  calling one raises (speculative decoding on CPU needs the real AMX build; the kvsteward tree refuses it anyway).

Any other name fails to import with ImportError, as it would without the package.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+kvsteward.cpu"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """For each request i of the batch: `req_to_token[req_pool_indices[i], start[i]:end[i]]` = its slice of
    `out_cache_loc` (the slices are consecutive, in batch order). What sglang's Triton `assign_req_to_token_pool`
    kernel and the AMX `sgl_kernel` op write; `pool_len` (the row length) is implied by `req_to_token`."""
    del pool_len
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset: offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For each buffer b (base address `data_ptrs[b]`, `strides[b]` bytes per slot): slot `tgt_loc[i]` = slot
    `src_loc[i]` for all i, reading every source before writing (safe when the two sets overlap), as the Triton
    `copy_all_layer_kv_cache_tiled` kernel does."""
    import ctypes

    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    if not tgt:
        return
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def _unsupported(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding on CPU needs sgl_kernel's AMX build "
                                  "(this is kvsteward's plain-torch stand-in)")

    fn.__name__ = fn.__qualname__ = name
    return fn


for _name in ("assign_extend_cache_locs_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "rotate_input_ids_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu"):
    globals()[_name] = _unsupported(_name)
del _name
