"""The `sglang.srt.plugins` entry point: registers the `kvsteward` radix-cache backend and the position hook.

SGLang's `load_plugins()` calls `register()` in every process it starts (engine, scheduler, detokenizer), before it
builds the tree cache, and then applies the registered hooks (`HookRegistry.apply_hooks`). `register` adds:
- the `kvsteward` radix-cache backend: `--radix-cache-backend kvsteward` selects `OpRadixCache`;
- an AROUND hook on `ForwardBatch.init_new` adding each request's position offset (a drop without reposition,
  `kvsteward.serve.sglang.positions`). It changes nothing for requests without an offset, and only the kvsteward
  tree sets offsets, so with another `--radix-cache-backend` it is inert.
Set `SGLANG_PLUGINS=kvsteward` to load only this plugin.
"""

from __future__ import annotations

NAME = "kvsteward"


def register() -> None:
    """Register `kvsteward` with SGLang's radix-cache registry and the position hook (idempotent)."""
    from kvsteward.serve.sglang.compat import prepare_sglang

    prepare_sglang()
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from kvsteward.serve.sglang.positions import register_hook
    from kvsteward.serve.sglang.tree import create_tree_cache

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, create_tree_cache)
    register_hook()
