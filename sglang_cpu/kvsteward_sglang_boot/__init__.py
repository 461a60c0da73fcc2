"""Loaded at interpreter start in .venv-sglang (a `.pth` line written by `make sglang-venv`), so it runs in every
sglang process — the server, and the scheduler and detokenizer it spawns — before anything imports torchvision.

sglang imports `torchvision.io.decode_jpeg` at module level (`srt/utils/common.py`). The package index's torchvision
matching torch 2.13.0 (0.28.0) is a CUDA build: next to CPU torch its `_C` does not load, and its import then fails
with "operator torchvision::nms does not exist" (its meta registrations name those ops). Defining the two op schemas
with `torch.library` before torchvision is imported lets it import; image decoding is not used by a text model.

sglang's LoRA serving (`srt/lora/`) allocates its batch metadata with `pin_memory=True` and calls
`Tensor.pin_memory()` unconditionally; a CPU-only torch refuses both ("pin_memory=True requires a CUDA or other
accelerator backend"). Pinned host memory only speeds up copies to an accelerator: where torch has none, the boot
makes `pin_memory=True` a no-op in torch's tensor factories and `Tensor.pin_memory()` return the tensor itself, so
the same values land in ordinary memory (`unpin_without_accelerator`).

sglang's `torch_native` attention backend (the one a CPU without AMX runs) computes an extend by building, per
request, a query as long as the whole row (the cached prefix's rows left uninitialised) and running causal SDPA over
all of it, then keeping the new tokens' rows: an extend of 30 tokens on a 4,000-token cached row costs the attention
of 4,000 queries, so a prefix-cache hit saves almost nothing. `extend_new_queries` computes the same outputs from the
new tokens' queries only, with the causal mask offset by the cached length (`j <= prefix + i`); cross-attention,
encoder-only and sliding-window layers keep sglang's own path. It is installed when that module is first imported
(`KVSTEWARD_SGLANG_CPU_EXTEND=native` keeps sglang's path: the A/B switch).

Lazy: a meta-path finder waits for the first `import torchvision` or `import sglang`, so a process that imports
neither (pip, a plain python) does not pay for importing torch at start.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries: list = []  # a torch.library.Library's definitions vanish when it is collected


def define_torchvision_ops() -> None:
    """Define the torchvision op schemas its import needs, unless its own `_C` (or an earlier call) did."""
    import torch

    missing = []
    for name in SCHEMAS:
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(SCHEMAS[name])
        _libraries.append(lib)


_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided", "empty_like", "zeros_like",
              "ones_like")


def _has_accelerator(torch) -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def unpin_without_accelerator() -> bool:
    """Without an accelerator, drop `pin_memory=True` from torch's tensor factories and make `Tensor.pin_memory()`
    the identity (idempotent). Returns whether it patched."""
    import functools

    import torch

    if _has_accelerator(torch) or getattr(torch, "_kvsteward_unpinned", False):
        return False

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return fn(*args, **kwargs)

        return call

    for name in _FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch._kvsteward_unpinned = True
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in ("torchvision", "sglang"):
            sys.meta_path.remove(self)
            define_torchvision_ops()
            unpin_without_accelerator()
        return None  # the normal finders import it


def extend_new_queries(native):
    """A drop-in `_run_sdpa_forward_extend` that attends with the new tokens' queries only (see the module doc)."""
    import functools

    import torch
    from torch.nn.functional import scaled_dot_product_attention

    @functools.wraps(native)
    def run(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
            extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
            sliding_window_size=None):
        if encoder_lens is not None or not causal or is_cross_attn or (
                sliding_window_size is not None and sliding_window_size > -1):
            return native(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                          extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                          causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start = 0
        for i in range(seq_lens.shape[0]):
            n, prefix, total = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = heads_first[:, start : start + n]
            rows = req_to_token[req_pool_indices[i], :total]
            k = k_cache[rows].movedim(0, query.dim() - 2)
            v = v_cache[rows].movedim(0, query.dim() - 2)
            if not (q.dtype == k.dtype == v.dtype):
                k, v = k.to(q.dtype), v.to(q.dtype)
            # query i (absolute position prefix + i) sees keys 0..prefix + i; with no prefix that is plain causal
            mask = None if prefix == 0 else torch.ones(n, total, dtype=torch.bool, device=q.device).tril(prefix)
            out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                               enable_gqa=enable_gqa, scale=scaling, is_causal=mask is None)
            output[start : start + n] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start += n
        return output

    run.kvsteward_native = native
    return run


TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"


def patch_torch_native(module) -> bool:
    """Install `extend_new_queries` on the backend class (idempotent); False when switched off."""
    import os

    if os.environ.get("KVSTEWARD_SGLANG_CPU_EXTEND", "") == "native":
        return False
    cls = module.TorchNativeAttnBackend
    if not hasattr(cls._run_sdpa_forward_extend, "kvsteward_native"):
        cls._run_sdpa_forward_extend = extend_new_queries(cls._run_sdpa_forward_extend)
    return True


class _AfterTorchNative(importlib.abc.MetaPathFinder):
    """Finds sglang's torch_native backend module with the normal finders and patches it once it has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TORCH_NATIVE:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch_torch_native(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if TORCH_NATIVE in sys.modules:
        patch_torch_native(sys.modules[TORCH_NATIVE])
    elif not any(isinstance(f, _AfterTorchNative) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchNative())
    if "torchvision" in sys.modules or "sglang" in sys.modules:
        return
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
