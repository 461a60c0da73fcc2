"""The `sglang.srt.plugins` entry point: registers the `kvsteward` radix-cache backend and the position hook.

SGLang's `load_plugins()` calls `register()` in every process it starts (engine, scheduler, detokenizer), before it
builds the tree cache, and then applies the registered hooks (`HookRegistry.apply_hooks`). `register` adds:
- the `kvsteward` radix-cache backend: `--radix-cache-backend kvsteward` selects `OpRadixCache`;
- an AROUND hook on `ForwardBatch.init_new` adding each request's position offset (a drop without reposition,
  `kvsteward.serve.sglang.positions`). It changes nothing for requests without an offset, and only the kvsteward
  tree sets offsets, so with another `--radix-cache-backend` it is inert;
- two AROUND hooks that refuse, before any work, a request whose pre-op state the tree lost and that asked for it
  (`miss: "refuse"`, `kvsteward.serve.sglang.refusal`); inert for requests the tree did not mark.
Set `SGLANG_PLUGINS=kvsteward` to load only this plugin.

**Version.** The tree subclasses sglang's `RadixCache` and follows its private lifecycle (`insert_req`,
`cache_unfinished_req`, `on_release`, `_match_prefix_helper`, `_insert_helper`, ...), which changes between
releases (0.5.21 replaced `cache_finished_req` by `insert_req`; 0.5.23 replaces both by `checkpoint`). So the plugin
runs only on the versions it was written and tested against (`SUPPORTED`) and refuses any other, loudly: `register`
raises (sglang logs it as a failed plugin) and, where sglang's registry still imports, registers a backend whose
factory raises the same message, so `--radix-cache-backend kvsteward` stops the server at start with it instead of
serving with a tree whose hooks sglang no longer calls. `KVSTEWARD_SGLANG_ANY_VERSION=1` skips the check (porting).
"""

from __future__ import annotations

import logging
import os

NAME = "kvsteward"
SUPPORTED = ("0.5.21",)
logger = logging.getLogger(__name__)


class UnsupportedSglang(RuntimeError):
    """The installed sglang is not a version the kvsteward tree cache supports."""


def sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_version(found: str | None = None) -> None:
    """Raise `UnsupportedSglang` unless the installed sglang is one of `SUPPORTED` (or the check is switched off)."""
    found = sglang_version() if found is None else found
    if found in SUPPORTED or os.environ.get("KVSTEWARD_SGLANG_ANY_VERSION") == "1":
        return
    raise UnsupportedSglang(
        f"kvsteward's radix-cache backend supports sglang {', '.join(SUPPORTED)}; this environment has sglang "
        f"{found or '(not installed)'}. Install the pinned version (`make sglang-venv`, requirements-sglang-cpu.txt "
        f"on CPU; `pip install sglang=={SUPPORTED[-1]}` on a GPU server), or set KVSTEWARD_SGLANG_ANY_VERSION=1 "
        "to try anyway (docs/serving.md, 'SGLang deployment': what 0.5.23 changed)")


def _refusing_factory(error: UnsupportedSglang):
    def factory(ctx):
        raise error

    return factory


def register() -> None:
    """Register `kvsteward` with SGLang's radix-cache registry and the position hook (idempotent)."""
    try:
        check_version()
    except UnsupportedSglang as e:
        logger.error("%s", e)
        try:
            from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

            if get_radix_cache_factory(NAME) is None:
                register_radix_cache_backend(NAME, _refusing_factory(e))
        except Exception:  # the registry itself moved: sglang's own "unknown backend" error follows, after ours
            pass
        raise
    from kvsteward.serve.sglang.compat import prepare_sglang

    prepare_sglang()
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from kvsteward.serve.sglang.positions import register_hook
    from kvsteward.serve.sglang.refusal import register_hooks
    from kvsteward.serve.sglang.tree import create_tree_cache

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, create_tree_cache)
    register_hook()
    register_hooks()
