"""SGLang deployment of kvsteward's op-history cache (pinned to sglang==0.5.21; `plugin.SUPPORTED`).

- `ops`: the request convention (the op history as one JSON string in `custom_params["kvsteward"]`, or after a
  `kvsteward:` `extra_key`; the compact form and its server-side `HistoryStore`; `SglangHistory`, the client side).
  No sglang import.
- `pool`: drop / reposition / position versions on SGLang's KV pool tensors (exact RoPE re-rotation).
- `tree`: `OpRadixCache`, a `RadixCache` whose tree holds drop and reposition nodes between token nodes.
- `positions`: the `ForwardBatch.init_new` hook that adds a plain drop's position offset.
- `plugin`: the `sglang.srt.plugins` entry point registering the `kvsteward` radix-cache backend (version-checked).
- `manager`: the learned memory manager as a LoRA fork decoded by a custom logit processor (`steward serve`'s rule).
- `aux`: the SideQuest fork and its decision as the main thread's next drop (request helpers).
- `launch`: start / wait for / kill a real `sglang.launch_server` (from `.venv-sglang`), with the CPU flags.
- `compat`: what must run before importing sglang's KV-cache modules next to the project's CPU torch / transformers.
"""
