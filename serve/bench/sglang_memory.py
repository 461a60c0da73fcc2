"""Tokens in use while an agent session's turn runs, on sglang 0.5.21's own pools (`serve.sglang.sim`): the issue-43
measurement — one agent session (rolling drops keeping the last tool responses), tokens in use (`/v1/loads`'
num_used: total - available - evictable) and allocated while a turn runs, for the default radix cache and the
kvsteward tree (freeing off / lazy / eager).

    python -c "from kvsteward.serve.bench.sglang_memory import memory_in_use; print(memory_in_use(reposition_every=2))"
"""

from __future__ import annotations

import torch

from kvsteward.serve.sglang.sim import EvictParams, SimReq, SimServer, tiny_rope


def memory_in_use(turns: int = 10, keep: int = 2, reposition_every: int = 0, reply: int = 16, seed: int = 0,
                  sizes: dict | None = None, size: int = 65536) -> dict:
    """One agent session (`AgentSession`: rolling drops keeping the last `keep` tool responses, a reposition every
    `reposition_every`-th drop, 0 = never), turn by turn on a pool with no pressure; while the last turn is in flight
    (prefilled, before decoding): tokens in use (total - available - evictable: what `/v1/loads` reports and
    admission counts) and allocated (total - available), for sglang's radix cache (the same physical tokens, no ops)
    and the kvsteward tree with freeing off / lazy (advertised, freed on demand) / eager (freed at each release).
    Also `after_evict`: allocated once sglang asks the tree for every evictable slot while the turn runs."""
    from kvsteward.serve.bench.sglang import AgentSession
    from kvsteward.serve.sglang.ops import SglangHistory

    sizes = sizes or {"system": 40, "task": 30, "tool": 60, "prompt": 3}
    g = torch.Generator().manual_seed(seed)
    msgs: dict = {}

    def make(kind: str, k: int) -> list[int]:
        if (kind, k) not in msgs:
            msgs[(kind, k)] = torch.randint(10, 30000, (sizes[kind],), generator=g).tolist()
        return msgs[(kind, k)]

    rope = tiny_rope()
    replies = [torch.randint(10, 30000, (reply,), generator=g).tolist() for _ in range(turns)]
    out = {}
    for arm in ("default", "off", "lazy", "eager"):
        s = SimServer("radix" if arm == "default" else "kvsteward", size=size, free="lazy" if arm == "default" else arm,
                      rope=rope)
        session = AgentSession(make, keep=keep, reposition_every=reposition_every, ops=True, closing=[2, 3])
        client = SglangHistory()
        for t in range(turns):
            if arm != "default" and session.drops_next():
                seal = client.fields(*session.seal())
                s.run(SimReq(seal["input_ids"], seal["sampling_params"]["custom_params"]), [1])
            messages, cache = session.request()
            body = client.fields(messages, cache)
            req = SimReq(body["input_ids"], body["sampling_params"]["custom_params"] if arm != "default" else None)
            s.start(req)
            s.check()
            if t == turns - 1:
                row = len(body["input_ids"])
                used, allocated = s.used(), s.allocated()
                s.cache.evict(EvictParams(num_tokens=s.cache.evictable_size()))
                s.check()
                out[arm] = {"used": used, "allocated": allocated, "after_evict": s.allocated(), "row": row,
                            "stats": dict(getattr(s.cache, "stats", {}))}
            s.decode(req, replies[t])
            s.finish(req)
            session.reply(replies[t])
            s.check()
    return out
