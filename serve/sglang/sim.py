"""SGLang's scheduler steps on sglang 0.5.21's own pools and tree, in this process (no model): the memory side of the
kvsteward tree, checked with sglang's own scheduler invariant checker.

`SimServer` runs a request as the scheduler does — match, lock, allocate the uncached part, (optionally) write KV,
decode (one slot per generated token but the last), release (insert, free the row, unpin) — or retracts it (release
without insert, as `retract_decode` does). `check()` runs sglang's `SchedulerInvariantChecker` on the live state: the
accounting equation (available + evictable + protected + uncached == total, what `SGLANG_ENABLE_STRICT_MEM_CHECK_
DURING_BUSY` asserts) and the KV page invariants (`SGLANG_CHECK_KV_PAGE_INVARIANTS`: no in-flight row slot in the free
pool, no duplicate free page), plus what they do not see: every slot owned by exactly one tree node, and tree + free
+ in-flight private slots = the pool.

The issue-43 measurement on it (tokens in use while an agent session's turn runs) is
`kvsteward.serve.bench.sglang_memory.memory_in_use`.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import torch

from kvsteward.serve.sglang.compat import prepare_sglang

prepare_sglang()

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402


class SimKV(SimpleNamespace):
    """The fields of sglang's per-request KV record that the tree, `free_kv_row` and the invariant checker read."""

    def get_evicted_seqlen(self, component_type) -> int:
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        return 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None


class SimReq:
    """The fields of sglang's Req that the tree caches read."""

    def __init__(self, ids, custom=None, extra_key=None, lora_id=None, rid: str = "r"):
        self.rid = rid
        self.origin_input_ids, self.output_ids = array("q", ids), array("q")
        self.sampling_params = SimpleNamespace(custom_params=custom)
        self.lora_id = lora_id
        if lora_id is not None:  # what sglang's Req.__init__ does
            extra_key = (extra_key or "") + lora_id
        self.extra_key, self.cache_salt, self.priority = extra_key, None, 0
        self.kv = SimKV(req_pool_idx=None, cache_protected_len=0, kv_allocated_len=0, kv_committed_len=0)
        self.last_node = None
        self.prefix_indices = None
        self.finished_reason = None
        self.beam_group = None

    def get_fill_ids(self):
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None


class SimServer:
    """One sglang scheduler's KV side on real pools (CPU). `cache`: "kvsteward" (an `OpRadixCache`, `free` mode) or
    "radix" (sglang's own `RadixCache`). `prefill(slots, ids, positions)` writes KV if given (a stand-in model)."""

    def __init__(self, cache: str = "kvsteward", size: int = 4096, free: str = "lazy", rope: Any = None,
                 layers: int = 1, heads: int = 1, head_dim: int = 8, dtype: torch.dtype = torch.float32,
                 rows: int = 32, row_len: int = 8192, prefill=None):
        from kvsteward.serve.sglang.tree import OpRadixCache

        self.size = size
        self.pool = MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=heads, head_dim=head_dim,
                                     layer_num=layers, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(size, dtype, "cpu", self.pool, need_sort=False)
        self.rows = ReqToTokenPool(rows, row_len, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
                                 page_size=1)
        self.cache = OpRadixCache(params, rope=rope, free=free) if cache == "kvsteward" else RadixCache(params)
        self.prefill_fn = prefill
        self.inflight: list[SimReq] = []
        self._checker = None

    # -- the scheduler's steps ---------------------------------------------------------------------------------------
    def start(self, req: SimReq) -> SimpleNamespace:
        """Admit `req`: match, lock, allocate the uncached part (evicting for room as sglang does), write the row."""
        ids = req.origin_input_ids
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, req.extra_key, limit=len(ids) - 1),
                                                      req=req))
        n = len(m.device_indices)
        self.cache.inc_lock_ref(m.last_device_node)
        req.last_node, req.kv.cache_protected_len = m.last_device_node, n
        new = self._alloc(len(ids) - n)
        req.kv.req_pool_idx = self.rows.alloc_rows(1)[0]
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        row[:n], row[n: len(ids)] = m.device_indices.to(torch.int32), new.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(ids)
        req.prefix_indices = m.device_indices
        off = getattr(req, "kvsteward_position_offset", 0)  # what the ForwardBatch.init_new hook adds
        if self.prefill_fn is not None:
            self.prefill_fn(new, list(ids[n:]), list(range(n + off, len(ids) + off)))
        self.inflight.append(req)
        return SimpleNamespace(prefix_len=n, row=row[: len(ids)].long().clone(), node=m.last_device_node)

    def _alloc(self, n: int) -> torch.Tensor:
        if self.alloc.available_size() < n:  # sglang's alloc path: evict the shortfall first
            self.cache.evict(EvictParams(num_tokens=n - self.alloc.available_size()))
        new = self.alloc.alloc(n)
        if new is None:
            raise MemoryError(f"{n} slots wanted, {self.alloc.available_size()} free after eviction")
        return new

    def decode(self, req: SimReq, output_ids) -> None:
        """Generate `output_ids`: one new slot per token but the last (its KV is never computed)."""
        for t in output_ids:
            if req.output_ids:  # the previous token's KV is computed by this step
                slot = self._alloc(1)
                self.rows.req_to_token[req.kv.req_pool_idx, req.kv.kv_allocated_len] = int(slot)
                req.kv.kv_allocated_len += 1
                req.kv.kv_committed_len += 1
            req.output_ids.append(int(t))

    def finish(self, req: SimReq, insert: bool = True) -> None:
        """sglang 0.5.21's `mem_cache.common.release_kv_cache`: insert, free the rest of the row, unpin, release."""
        n = req.kv.kv_allocated_len
        if insert:
            req.finished_reason = "length"
            self.cache.insert_req(req, up_to=n)
        self.cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
        self.cache.unpin(req)
        self.cache.on_release(req, inserted=insert)
        self.rows.free_rows([req.kv.req_pool_idx])
        req.kv.req_pool_idx = None
        req.kv.kv_allocated_len = req.kv.kv_committed_len = 0
        self.inflight.remove(req)

    def retract(self, req: SimReq) -> None:
        """`retract_decode`: the row and lock released, nothing inserted; the request waits to be re-admitted."""
        self.finish(req, insert=False)
        req.output_ids = array("q")
        req.kv.cache_protected_len = 0

    def run(self, req: SimReq, output_ids=()) -> SimpleNamespace:
        out = self.start(req)
        self.decode(req, output_ids)
        self.finish(req)
        return out

    # -- what sglang's scheduler reports ----------------------------------------------------------------------------
    def used(self) -> int:
        """`/v1/loads` num_used: total - available - evictable."""
        return self.size - self.alloc.available_size() - self.cache.evictable_size()

    def allocated(self) -> int:
        return self.size - self.alloc.available_size()

    def check(self) -> None:
        """sglang's busy-time checks on the live state, then ownership: AssertionError / RuntimeError on a leak."""
        checker = self.checker()
        full_uncached, _ = checker._get_total_uncached_sizes()
        ps = SimpleNamespace(full_available_size=self.alloc.available_size(),
                             full_evictable_size=self.cache.evictable_size(), full_capacity=self.size)
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(dcp_enabled=False):  # nothing published in this process: a single rank
            leak, msg = checker._check_full_pool(ps, uncached=full_uncached)
        assert not leak, f"Full Pool Mem Leak Detected! {msg}"
        checker._check_kv_page_invariants()
        owned = self.tree_slots()
        assert owned.numel() == torch.unique(owned).numel(), "a slot is owned by two tree nodes"
        free = self.alloc.free_pages
        assert not bool(torch.isin(owned, free).any()), "a tree slot is in the free pool"
        private = sum(r.kv.kv_allocated_len - r.kv.cache_protected_len for r in self.inflight)
        assert owned.numel() + free.numel() + private == self.size, (owned.numel(), free.numel(), private)
        for r in self.inflight:
            row = self.rows.req_to_token[r.kv.req_pool_idx, : r.kv.kv_allocated_len].long()
            assert not bool(torch.isin(row, free).any()), f"in-flight request {r.rid} reads a free slot"

    def checker(self):
        if self._checker is None:
            from sglang.srt.disaggregation.utils import DisaggregationMode
            from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

            batch = SimpleNamespace(reqs=self.inflight)
            self._checker = SchedulerInvariantChecker(
                is_hybrid_swa=False, is_hybrid_ssm=False, disaggregation_mode=DisaggregationMode.NULL, page_size=1,
                full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=self.size,
                tree_cache=self.cache, token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.rows,
                pool_stats_observer=SimpleNamespace(session_held_tokens=lambda: 0),
                get_last_batch=lambda: batch, get_running_batch=lambda: None, scheduler_stage_metrics=None)
        return self._checker

    def tree_slots(self) -> torch.Tensor:
        """Every slot a tree node owns (its `value`), one entry per owner."""
        out, stack = [], [self.cache.root_node]
        while stack:
            node = stack.pop()
            if node is not self.cache.root_node and node.value is not None:
                out.append(torch.as_tensor(node.value, dtype=torch.int64))
            stack.extend(node.children.values())
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def evict_all(self) -> int:
        return self.cache.evict(EvictParams(num_tokens=10 ** 9)).num_tokens_evicted


def tiny_rope(head_dim: int = 8, theta: float = 1e4):
    """The float64 RoPE spec of a one-layer, one-head Llama with `head_dim` (the pool's shape in `memory_in_use`)."""
    from transformers import LlamaConfig

    from kvsteward.kernels.rope import config_model_rope

    return config_model_rope(LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1,
                                         num_hidden_layers=1, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": theta}))
