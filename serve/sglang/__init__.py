"""SGLang deployment of kvsteward's op-history cache (pinned to sglang==0.5.19).

- `ops`: the request convention (op history in `custom_params["kvsteward"]` or `extra_key`), no sglang import.
- `pool`: drop / reposition / position versions on SGLang's KV pool tensors (exact RoPE re-rotation).
- `tree`: `OpRadixCache`, a `RadixCache` whose tree holds drop and reposition nodes between token nodes.
- `plugin`: the `sglang.srt.plugins` entry point registering the `kvsteward` radix-cache backend.
- `aux`: the SideQuest auxiliary thread as a prefix fork, and its decision as the main thread's next drop.
- `compat`: what must run before importing sglang next to the project's CPU torch / newer transformers.
"""
