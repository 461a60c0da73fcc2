"""Make sglang 0.5.21 importable next to the project's pins (CPU torch 2.13.0, transformers 5.23).

Two things break a plain `import sglang.srt.mem_cache.radix_cache` here, and both are fixed before the import:

1. torchvision. `sglang.srt.utils.common` does `from torchvision.io import decode_jpeg` at import time (image
   inputs; nothing in the KV cache calls it). PyPI's torchvision is a CUDA build whose `_C.so` cannot load next to
   CPU torch, so its import fails with "operator torchvision::nms does not exist" — and once it is installed,
   *every* `from transformers import LlamaConfig` in the venv fails the same way (transformers imports torchvision
   when it is installed), so this project does not install it. Then:
   - torchvision not installed (this project's venv): stub `torchvision.*` modules stand in during the sglang
     import only (sglang's multimodal helpers take names from it at import time); calling any of them raises.
   - torchvision installed but its `_C` does not load: the schemas of `torchvision::nms` / `qnms` are defined
     first, which lets torchvision import.
2. sglang pins transformers 5.12.1 and registers its own configs (e.g. `qwen3_asr`) with `AutoConfig.register`;
   transformers 5.23 already ships some of those names and refuses them. During the sglang import we register with
   `exist_ok=True`, which keeps sglang's config class for the name — what sglang sees under its own pin.

On a GPU machine with sglang's own dependency set (CUDA torchvision that loads, transformers 5.12.1) both steps are
no-ops: torchvision imports with its own ops, and no name collides.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch

_TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries: list[torch.library.Library] = []  # kept alive: a Library's definitions vanish when it is collected


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define_torchvision_ops() -> None:
    """Define the torchvision op schemas its meta registrations need, unless its own `_C` (or an earlier call)
    already did. Must run before torchvision is first imported."""
    missing = [name for name in _TORCHVISION_SCHEMAS if not _op_exists(name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(_TORCHVISION_SCHEMAS[name])
    _libraries.append(lib)


class _Missing:
    """Any name sglang takes from the stubbed torchvision: usable in annotations, raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (kvsteward stubs it so that sglang's KV "
                           "cache imports on CPU); image inputs need a real torchvision")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `torchvision` and every `torchvision.*` to stub packages."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


@contextlib.contextmanager
def _torchvision_for_import() -> Iterator[None]:
    """Stub torchvision while sglang imports when it is absent; define its op schemas when its _C won't load."""
    if importlib.util.find_spec("torchvision") is not None:
        define_torchvision_ops()
        yield
        return
    try:  # transformers caches "is torchvision available?" on first ask: ask now, before the stub can answer
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    except (ImportError, AttributeError):
        pass
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:  # only sglang's import-time references see the stub; later imports find no torchvision again
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            if isinstance(sys.modules[name], _StubModule):
                del sys.modules[name]


@contextlib.contextmanager
def _lenient_auto_config() -> Iterator[None]:
    from transformers import AutoConfig

    original = AutoConfig.register

    def register(model_type, config, exist_ok=False):  # sglang's names win, as under its own transformers pin
        return original(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register)
    try:
        yield
    finally:
        AutoConfig.register = staticmethod(original)


_MODULES = (
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.registry",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.model_executor.forward_batch_info",
)


def prepare_sglang() -> None:
    """Import the sglang modules the plugin uses, with the two fixes above. Idempotent; raises ImportError (with
    sglang's own message) when sglang or one of its import-time dependencies is missing."""
    with _torchvision_for_import(), _lenient_auto_config():
        for name in _MODULES:
            importlib.import_module(name)
