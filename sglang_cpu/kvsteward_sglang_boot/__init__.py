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


def install() -> None:
    if "torchvision" in sys.modules or "sglang" in sys.modules:
        return
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
