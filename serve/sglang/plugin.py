"""The `sglang.srt.plugins` entry point: registers the `kvsteward` radix-cache backend.

SGLang's `load_plugins()` calls `register()` in every process it starts (engine, scheduler, detokenizer), before it
builds the tree cache; `--radix-cache-backend kvsteward` then selects `OpRadixCache`. Set `SGLANG_PLUGINS=kvsteward`
to load only this plugin.
"""

from __future__ import annotations

NAME = "kvsteward"


def register() -> None:
    """Register `kvsteward` with SGLang's radix-cache registry (idempotent)."""
    from kvsteward.serve.sglang.compat import prepare_sglang

    prepare_sglang()
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from kvsteward.serve.sglang.tree import create_tree_cache

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, create_tree_cache)
