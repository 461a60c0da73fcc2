"""The per-request position offset in SGLang's forward batch: what makes a plain `drop` exact (sglang==0.5.21).

SGLang builds the positions of every forward in `ForwardBatch.init_new` (model_executor/forward_batch_info.py):

- extend (prefill, chunked prefill, MIXED, SPLIT_PREFILL): `compute_position(...)` = for each request in batch order,
  `arange(prefix_len, prefix_len + extend_len)` — request i owns the `extend_seq_lens_cpu[i]` consecutive entries;
- decode: `clamp_position(batch.seq_lens)` = `seq_len - 1`, one entry per request in batch order.

So position = row index. After a plain drop (no reposition) AKV keeps every position, so a token at row index i sits
at position i + d, where d is the number of tokens dropped since the last reposition on the request's op path. The
tree (`OpRadixCache.match_prefix`) sets d on the request as `req.kvsteward_position_offset`; this module's AROUND
hook on `ForwardBatch.init_new` runs the original and then adds each request's offset to all of that request's
positions. Requests without an offset (plain requests, or any batch where every offset is 0) are left untouched:
the returned `ForwardBatch` is the original, bit for bit.

Every later consumer reads `forward_batch.positions` after `init_new` returned: the model's RoPE
(`forward(input_ids, positions, forward_batch)`), and the CUDA-graph runners, which copy `forward_batch.positions`
into their static `buffers.positions` before each replay (decode_cuda_graph_runner.py `replay_prepare` /
`load_batch`; runner_utils/buffers.py `populate_from_forward_batch`), so the offset reaches graph replays too.

Not supported (the hook raises rather than compute a wrong position; `create_tree_cache` refuses plain drops up
front for these configurations): speculative decoding (positions come from `spec_info`), dLLM, M-RoPE models
(`mrope_positions` is computed separately), decode context parallelism (`attn_dcp_size > 1` shards KV by
position).
"""

from __future__ import annotations

from typing import Any

import torch

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
OFFSET_ATTR = "kvsteward_position_offset"


def request_offsets(reqs: Any) -> list[int]:
    return [int(getattr(r, OFFSET_ATTR, 0) or 0) for r in reqs]


def token_offsets(forward_batch: Any, batch: Any, offsets: list[int]) -> torch.Tensor:
    """Per-position offsets of a forward batch, in the order of `forward_batch.positions`."""
    mode = forward_batch.forward_mode
    if mode.is_decode():
        return torch.tensor(offsets, dtype=torch.int64)
    if mode.is_extend_or_draft_extend_or_mixed():  # EXTEND, MIXED, SPLIT_PREFILL
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if lens is None:
            lens = batch.extend_lens
        if isinstance(lens, torch.Tensor):
            lens = lens.tolist()
        return torch.repeat_interleave(torch.tensor(offsets, dtype=torch.int64),
                                       torch.tensor(list(lens), dtype=torch.int64))
    raise RuntimeError(f"kvsteward: a request with a position offset (a drop without reposition) reached a "
                       f"{mode.name} forward, which this plugin does not support")


def offset_positions(original, cls, batch, model_runner, *args, **kwargs):
    """AROUND hook on the classmethod `ForwardBatch.init_new(cls, batch, model_runner, ...)`."""
    ret = original(cls, batch, model_runner, *args, **kwargs)
    reqs = getattr(batch, "reqs", None) or []
    offsets = request_offsets(reqs)
    if not any(offsets) or ret.positions is None or ret.forward_mode.is_idle():
        return ret
    if getattr(batch, "spec_info", None) is not None or getattr(batch, "dllm_config", None) is not None:
        raise RuntimeError("kvsteward: position offsets (drop without reposition) do not support speculative "
                           "decoding or dLLM")
    if getattr(model_runner.model_config, "model_is_mrope", False):
        raise RuntimeError("kvsteward: position offsets (drop without reposition) do not support M-RoPE models")
    if (getattr(model_runner, "attn_dcp_size", 1) or 1) > 1:
        raise RuntimeError("kvsteward: position offsets (drop without reposition) do not support decode context "
                           "parallelism")
    delta = token_offsets(ret, batch, offsets)
    if delta.numel() != ret.positions.numel():
        raise RuntimeError(f"kvsteward: {ret.positions.numel()} positions for {delta.numel()} request tokens")
    ret.positions = ret.positions + delta.to(device=ret.positions.device, dtype=ret.positions.dtype)
    return ret


def register_hook() -> None:
    """Register the hook with SGLang's `HookRegistry` (idempotent); `load_plugins()` applies it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is offset_positions for _, h, _ in HookRegistry._hooks.get(TARGET, [])):
        HookRegistry.register(TARGET, offset_positions, HookType.AROUND)


def hook_applied() -> bool:
    """Whether `ForwardBatch.init_new` is currently wrapped by `offset_positions`."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    fn = ForwardBatch.__dict__["init_new"]
    fn = getattr(fn, "__func__", fn)
    while fn is not None:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is offset_positions:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False
