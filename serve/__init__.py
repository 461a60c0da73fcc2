"""kvsteward.serve: the engine, the memory manager, the HTTP server, the SGLang plugin and the benchmarks.

| package | holds | may import |
|---|---|---|
| `engine/` | the exact cache engine (slots, attention, sessions, policies, positions, spill tiers, ops grammar) | — |
| `manager/` | the aux memory-manager thread (decode rules, planner, thread, worker) | engine |
| `server/` | the HTTP API (`steward serve`): completions, persistent sessions, metrics | engine, manager |
| `sglang/` | the SGLang radix-cache plugin | engine, manager |
| `bench/` | exactness checks and speed benchmarks | everything |

The direction is enforced by `tests/test_layers.py`.
"""
