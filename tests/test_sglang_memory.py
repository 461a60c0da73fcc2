"""Issue 43: a drop gives the memory back. The kvsteward tree on sglang 0.5.21's own pools, allocator and
`RadixCache`, with sglang's own scheduler invariant checker (`SimServer.check`: the accounting equation that
`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY` asserts, the page invariants of `SGLANG_CHECK_KV_PAGE_INVARIANTS`,
plus: no slot owned twice, tree + free + private = the pool, no in-flight slot free).

A stand-in model writes K = RoPE(raw_k[token], position), V = raw_v[token] (as in tests/test_sglang_plugin.py), so
every served row is checked against the float64 truth at the engine's positions; free slots are filled with NaN
before each check, so a row that reads a freed slot fails.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from kvsteward.serve.sglang.compat import prepare_sglang

prepare_sglang()

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kvsteward.kernels.rope import apply_rope, rerotate, rope_spec  # noqa: E402
from kvsteward.serve.bench.sglang_memory import memory_in_use  # noqa: E402
from kvsteward.serve.sglang import aux  # noqa: E402
from kvsteward.serve.sglang.ops import parse_request, request_fields  # noqa: E402
from kvsteward.serve.sglang.sim import SimReq, SimServer  # noqa: E402
from kvsteward.serve.sglang.tree import OpNode  # noqa: E402

LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 64
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                     num_key_value_heads=HEADS, num_hidden_layers=LAYERS, intermediate_size=32,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4}, max_position_embeddings=512)
SPEC = rope_spec(CONFIG)
_g = torch.Generator().manual_seed(0)
RAW_K = torch.randn(VOCAB, LAYERS, HEADS, HEAD_DIM, generator=_g, dtype=torch.float64)
RAW_V = torch.randn(VOCAB, LAYERS, HEADS, HEAD_DIM, generator=_g, dtype=torch.float64)
A, B, C, D, E, TRIG = [1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [20, 21]


def true_k(ids, positions, layer: int) -> torch.Tensor:
    raw = RAW_K[torch.tensor(list(ids))][:, layer].transpose(0, 1)
    return apply_rope(raw, torch.as_tensor(positions, dtype=torch.int64), SPEC).transpose(0, 1)


def server(size: int = 256, free: str = "lazy", dtype: torch.dtype = torch.float32) -> SimServer:
    s = SimServer(size=size, free=free, rope=SPEC, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                  row_len=512)

    def prefill(slots, ids, positions):
        for layer in range(LAYERS):
            dt = s.pool.k_buffer[layer].dtype
            s.pool.k_buffer[layer][slots] = true_k(ids, positions, layer).to(dt)
            s.pool.v_buffer[layer][slots] = RAW_V[torch.tensor(list(ids))][:, layer].to(dt)

    s.prefill_fn = prefill
    return s


def req(messages, cache=None, **kw) -> SimReq:
    body = request_fields(messages, cache)
    return SimReq(body["input_ids"], body.get("sampling_params", {}).get("custom_params"), **kw)


def poison_free(s: SimServer) -> None:
    free = s.alloc.free_pages
    for k, v in zip(s.pool.k_buffer, s.pool.v_buffer, strict=True):
        k[free] = float("nan")
        v[free] = float("nan")


def assert_truth(s: SimServer, r: SimReq, atol: float = 2e-6) -> None:
    """The in-flight row holds K at the history's (the engine's) positions, V exact — after every free slot was
    overwritten."""
    poison_free(s)
    hist = parse_request(r.sampling_params.custom_params, None) if r.sampling_params.custom_params else None
    ids = list(r.origin_input_ids)
    positions = list(hist.positions) if hist is not None else list(range(len(ids)))
    row = s.rows.req_to_token[r.kv.req_pool_idx, : len(ids)].long()
    for layer in range(LAYERS):
        k = s.pool.k_buffer[layer][row].double()
        torch.testing.assert_close(k, true_k(ids, positions, layer), rtol=0, atol=atol)
        assert torch.equal(s.pool.v_buffer[layer][row].double(),
                           RAW_V[torch.tensor(ids)][:, layer].to(s.pool.v_buffer[layer].dtype).double())


def assert_all_returned(s: SimServer) -> None:
    s.evict_all()
    free = s.alloc.free_pages
    assert s.alloc.available_size() == s.size and torch.unique(free).numel() == s.size
    assert s.cache.total_size() == 0 and s.cache.evictable_size() == s.cache.protected_size() == 0


# ------------------------------------------------------------------------------------------ the table
@pytest.mark.parametrize("reposition_every", [0, 2, 1])
def test_tokens_in_use_while_turn_9_runs(reposition_every):
    """One agent session keeping its last 2 tool responses, tokens in use (`/v1/loads` num_used) while turn 9 runs.
    Before (freeing off, today's tree): every dropped token and every older version is locked. Now: plain drops use
    the physical row — the default radix cache's number — and repositions at most the row plus the repositioned
    survivors; once sglang evicts (or in eager mode) the allocated slots follow."""
    r = memory_in_use(turns=10, reposition_every=reposition_every)
    row = r["default"]["row"]
    assert r["default"]["used"] == row
    assert r["off"]["used"] > row + 300  # the bug, reproduced: dead KV locked
    for arm in ("lazy", "eager"):
        assert r[arm]["stats"]["reprefill"] == 0 and r[arm]["stats"]["freed"] > 0
        if reposition_every == 0:
            assert r[arm]["used"] == r[arm]["after_evict"] == row
        else:
            assert r[arm]["used"] == r[arm]["after_evict"] < 2 * row
    assert r["eager"]["allocated"] < r["off"]["allocated"] / 1.5


# ----------------------------------------------------------------------------------------------- frees
def test_a_drop_frees_exactly_the_dropped_tokens_while_its_request_runs():
    s = server()
    s.run(req([A, B, C]))
    r = req([A, B, C, D], {"drop": {"2": [1]}})
    s.start(r)
    s.check()
    # the dropped B is dead (no request, branch or op reads it): advertised as evictable, not in use
    assert s.cache.evictable_size() == len(B) and s.cache.protected_size() == len(A + C)
    assert s.used() == len(A + C + D)
    assert s.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == len(B)
    s.check()
    assert s.allocated() == len(A + C + D) and s.cache.stats["freed"] == len(B) and s.cache.stats["compactions"] == 1
    assert_truth(s, r)
    s.finish(r)
    s.check()
    # the same history again: continues the compacted node, nothing re-prefilled
    again = req([A, B, C, D], {"drop": {"2": [1]}})
    assert s.run(again).prefix_len == len(A + C + D) - 1 and s.cache.stats["reprefill"] == 0
    assert_all_returned(s)


def test_a_reposition_keeps_only_its_version_and_the_survivors_originals():
    s = server()
    s.run(req([A, B, C]))
    r = req([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    s.start(r)
    s.check()
    assert s.cache.free_dead() == len(B)
    s.check()
    node = r.last_node
    assert isinstance(node, OpNode) and node.op == ("reposition",) and node.parent is s.cache.root_node
    assert s.cache.protected_size() == 2 * len(A + C)  # the version and the model-written keys it rotates from
    assert_truth(s, r)
    s.finish(r)
    assert_all_returned(s)


@pytest.mark.parametrize("holder", ["pre_op_row", "sibling_branch", "aux_fork"])
def test_nothing_is_freed_while_the_pre_op_state_is_read(holder):
    s = server()
    s.run(req([A, B, C]))
    held = None
    if holder == "pre_op_row":  # a request whose row ends at the pre-op state is running
        held = req([A, B, C])
        s.start(held)
    elif holder == "sibling_branch":  # another continuation of the pre-op state is cached
        s.run(req([A, B, C, E]))
    else:  # the SideQuest pattern: an aux fork (LoRA request) reads the pre-op state while the drop is sent
        body = aux.fork_request([A, B, C], None, TRIG)
        held = SimReq(body["input_ids"], body["sampling_params"]["custom_params"], lora_id="adapter")
        s.start(held)
    r = req([A, B, C, D], {"drop": {"2": [1]}})
    s.start(r)
    s.check()
    assert s.cache.dead_size() == 0 and s.cache.free_dead() == 0 and s.cache.evictable_size() == (
        len(E) if holder == "sibling_branch" else 0)
    assert_truth(s, r)
    if held is not None:
        assert_truth(s, held) if holder == "pre_op_row" else None
        s.finish(held)
    # sglang asks for room: the dead B goes before any live leaf (a cached sibling is a live leaf: once it is
    # evicted, B is dead and goes next)
    s.cache.evict(EvictParams(num_tokens=1 + (len(E) if holder == "sibling_branch" else 0)))
    s.check()
    assert s.cache.stats["freed"] == len(B)
    assert_truth(s, r)
    s.finish(r)
    assert_all_returned(s)


def test_chained_bf16_repositions_rotate_from_the_model_written_keys_after_compaction():
    """Each turn drops one more message and repositions (eager freeing: every turn's dead KV goes at release). Every
    version is one rotation of the key the model wrote, bit for bit in bf16; superseded versions are freed."""
    s = server(dtype=torch.bfloat16, free="eager")
    msgs = [A, B, C, D, E, TRIG, [30, 31, 32], [33, 34], [35, 36, 37]]
    s.run(req(msgs[:4]))
    for k in range(3, len(msgs) - 1):
        cache = {"drop": {str(j): [j - 2] for j in range(3, k + 1)}, "reposition": list(range(3, k + 1))}
        r = req(msgs[: k + 2], cache)
        s.start(r)
        s.check()
        node = r.last_node
        while not (isinstance(node, OpNode) and node.op[0] == "reposition"):
            node = node.parent
        delta = node.positions - node.origin_pos
        for layer in range(LAYERS):
            k_orig = s.pool.k_buffer[layer][node.origin].transpose(0, 1).float()
            want = rerotate(k_orig, delta, SPEC, torch.bfloat16).transpose(0, 1)
            assert torch.equal(s.pool.k_buffer[layer][node.kv_row], want)
            assert torch.equal(s.pool.v_buffer[layer][node.kv_row], s.pool.v_buffer[layer][node.origin])
        assert_truth(s, r, atol=0.1)
        s.finish(r)
        s.check()
    assert s.cache.stats["compactions"] >= 4 and s.cache.stats["reprefill"] == 0
    # what stays: the last turn's version, its survivors' originals, and the tail; no older version
    assert s.allocated() <= 2 * len(r.origin_input_ids)
    assert_all_returned(s)


def test_a_compacted_state_is_reused_by_its_history_and_a_request_for_a_freed_state_is_counted():
    s = server(free="eager")
    s.run(req([A, B, C]))
    s.run(req([A, B, C, D], {"drop": {"2": [1]}}))
    s.run(req([A, B, C, D, E], {"drop": {"2": [1], "3": [0]}}))  # a second drop: the first one's chain is dead
    assert s.cache.stats["compactions"] >= 1
    assert s.run(req([A, B, C, D, E], {"drop": {"2": [1], "3": [0]}})).prefix_len == len(C + D + E) - 1
    assert s.cache.stats["reprefill"] == 0
    # the first drop's own state was compacted into the second's: another op after it cannot be served exactly
    other = s.run(req([A, B, C, D, E], {"drop": {"2": [1], "3": [2]}}))
    assert s.cache.stats["reprefill"] == 1 and s.cache.stats["compacted_miss"] == 1 and other.prefix_len == 0
    s.check()
    s.evict_all()  # the compacted state itself evicted (memory pressure): a miss now is an eviction's, as in sglang
    s.run(req([A, B, C, D, E, TRIG], {"drop": {"2": [1], "3": [0]}}))
    assert s.cache.stats["reprefill"] == 2 and s.cache.stats["compacted_miss"] == 1
    assert_all_returned(s)


def test_a_retracted_request_keeps_its_anchor_and_resumes_exactly():
    s = server()
    s.run(req([A, B, C]))
    r = req([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    s.start(r)
    s.decode(r, [40, 41, 42])
    s.retract(r)
    s.check()
    s.evict_all()  # memory pressure: everything evictable goes
    s.check()
    assert s.cache.stats["pinned"] == 1
    out = s.start(r)  # re-admitted: the pinned anchor (the reposition node) is still there
    assert out.prefix_len == len(A + C) and s.cache.stats["reprefill"] == 0
    assert_truth(s, r)
    s.finish(r)
    assert not s.cache._pins
    assert_all_returned(s)


def sealed(messages, cache=None, hold=True, **kw) -> SimReq:
    """A seal that asks the tree to hold the state it leaves (`hold: true`; "always" for a rebuild)."""
    body = request_fields(messages, cache, hold=hold)
    return SimReq(body["input_ids"], body["sampling_params"]["custom_params"], **kw)


def test_a_held_seal_survives_eviction_until_its_op_request_is_released():
    """A seal with `hold: true` locks the state it leaves: evicting everything keeps it, so the op request that
    continues it (a drop and a reposition) is served exactly, and takes the lock over; once that request is released
    the state is evictable again and every slot returns once. A request continuing it without an op takes nothing."""
    s = server()
    s.run(sealed([A, B, C]), [50])
    assert s.cache.stats["held"] == 1 and s.cache.protected_size() == len(A + B + C)
    s.evict_all()
    s.check()
    plain = req([A, B, C, E])  # no op after the held state: it does not take the hold
    s.run(plain, [51])
    assert s.cache.stats["hold_taken"] == 0 and s.cache.protected_size() == len(A + B + C)
    r = req([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    out = s.start(r)
    assert out.prefix_len == len(A + C) and s.cache.stats["reprefill"] == 0 and s.cache.stats["hold_taken"] == 1
    assert_truth(s, r)
    s.evict_all()  # the taken hold and the running request keep the pre-op state
    s.check()
    s.decode(r, [52])
    s.finish(r)
    assert not s.cache._holds and not s.cache._taken
    assert_all_returned(s)


def test_a_reposition_with_no_room_for_its_version_waits_instead_of_a_reprefill():
    """`miss: "refuse"`: the pre-op state is cached but the pool has no room for the reposition's version (every
    other slot is in flight, and freeing the drop's dead tokens is not enough). The request is deferred: it matches
    nothing, allocates nothing, and is marked (the batch hook holds it back, `refusal.py`). Once room frees, the
    same request is served exactly. A request the hook has given up on (`NO_DEFER_ATTR`) is re-prefilled, counted,
    as before."""
    from kvsteward.serve.sglang.refusal import DEFER_ATTR, NO_DEFER_ATTR

    s = server(size=32)
    s.run(req([A, B, C]))
    # in flight: every other slot. B's 4 dead slots (freed on demand) are fewer than the version's 5
    blocker = SimReq(list(range(30, 30 + 32 - len(A + B + C))))
    s.start(blocker)
    free = s.alloc.available_size()
    assert free == 0

    def refusing(**kw) -> SimReq:
        body = request_fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]}, miss="refuse")
        return SimReq(body["input_ids"], body["sampling_params"]["custom_params"], **kw)

    def match(r: SimReq):
        ids = r.origin_input_ids
        return s.cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, None, limit=len(ids) - 1), req=r))

    r = refusing()
    m = match(r)
    assert "reposition" in getattr(r, DEFER_ATTR) and len(m.device_indices) == 0
    assert s.cache.stats["deferred"] == 1 and s.cache.stats["reprefill"] == 0
    assert s.alloc.available_size() == free + len(B)  # nothing allocated; the looking freed the drop's dead tokens
    s.check()
    given_up = refusing(rid="g")
    setattr(given_up, NO_DEFER_ATTR, True)
    match(given_up)
    assert getattr(given_up, DEFER_ATTR) is None and s.cache.stats["reprefill"] == 1
    s.finish(blocker)  # room frees (its tokens are cached, unlocked)
    out = s.start(r)
    assert getattr(r, DEFER_ATTR) is None and out.prefix_len == len(A + C) and s.cache.stats["reprefill"] == 1
    assert_truth(s, r)
    s.finish(r)
    assert_all_returned(s)


def test_holds_stay_within_their_budget_expire_and_die_with_their_request():
    """Held tokens stay within `hold_budget`, first come first held (a seal that does not fit is not held), so holds
    never fill the pool, except rebuilds (`hold: "always"`, counted); a hold nobody took within `hold_ttl` is
    released; a hold taken by a request that is aborted while waiting is released by the next match."""
    import gc

    s = server()
    s.cache.hold_budget = len(A + B + C) + 1
    s.run(sealed([A, B, C]), [50])
    s.run(sealed([D, A, E]), [50])  # over the budget: not held; the first stays
    assert s.cache.stats["hold_over_budget"] == 1 and [t for t, _ in s.cache._holds.values()] == [len(A + B + C)]
    s.run(sealed([E, D], hold="always"), [50])  # a rebuild: held past the budget (and counted)
    assert [t for t, _ in s.cache._holds.values()] == [len(A + B + C), len(E + D)]
    assert s.cache._held_tokens == len(A + B + C + E + D) > s.cache.hold_budget
    s.run(sealed([B, E, D]), [50])  # over the budget: not held
    assert s.cache.stats["hold_over_budget"] == 2 and len(s.cache._holds) == 2
    s.cache.hold_ttl = 0.0
    s.run(req([A]))  # any match releases holds older than the ttl
    assert s.cache.stats["hold_expired"] == 2 and not s.cache._holds
    s.cache.hold_ttl = 60.0
    s.run(sealed([D, A, E]), [50])
    s.evict_all()
    s.check()
    r = req([D, A, E, B], {"drop": {"2": [1]}})
    s.cache.match_prefix(MatchPrefixParams(key=RadixKey(r.origin_input_ids, None, limit=len(r.origin_input_ids) - 1),
                                           req=r))  # matched while waiting, then aborted: never admitted
    assert s.cache.stats["hold_taken"] == 1 and s.cache._taken
    assert s.cache.release_holds() == 0 and s.cache._taken  # untaken holds only, unless asked
    del r
    gc.collect()
    s.run(req([A]))  # any match sweeps holds of requests that no longer exist
    assert not s.cache._taken and not s.cache._holds
    assert_all_returned(s)


def test_retraction_pins_are_bounded_and_die_with_their_request():
    import gc

    s = server()
    s.cache.max_pins = 1
    s.run(req([A, B, C]))
    r1, r2 = req([A, B, C, D], {"drop": {"2": [1]}}), req([A, B, C, E], {"drop": {"2": [0]}})
    for r in (r1, r2):
        s.start(r)
        s.retract(r)
    assert len(s.cache._pins) == 1  # the oldest pin went
    s.check()
    del r1, r2, r
    gc.collect()
    s.run(req([A]))  # any match sweeps pins of requests that no longer exist
    assert not s.cache._pins
    assert_all_returned(s)


def test_a_chunked_request_across_a_compaction():
    s = server()
    s.run(req([A, B, C]))
    r = req([A, B, C, D, E], {"drop": {"2": [1]}, "reposition": [2]})
    s.start(r)
    s.cache.cache_unfinished_req(r)  # a chunk boundary: the part computed so far enters the tree
    s.check()
    assert s.cache.free_dead() == len(B)
    s.check()
    assert torch.equal(r.prefix_indices, s.rows.req_to_token[r.kv.req_pool_idx, : len(A + C + D + E)].long())
    assert_truth(s, r)
    twin = req([A, B, C, D, E], {"drop": {"2": [1]}, "reposition": [2]})
    assert s.run(twin).prefix_len == len(A + C + D + E) - 1
    s.finish(r)
    assert_all_returned(s)


def test_advertised_dead_kv_is_what_evict_frees():
    s = server(size=512)
    sessions = [[A, B, C], [E, B, D], [C, B, A]]
    running = []
    for msgs in sessions:
        s.run(req(msgs))
        r = req(msgs + [TRIG], {"drop": {"2": [1]}})
        s.start(r)
        running.append(r)
    s.check()
    advertised = s.cache.evictable_size() - s.cache.evictable_size_
    assert advertised == 3 * len(B) == s.cache.dead_size()
    allocated = s.allocated()
    assert s.cache.evict(EvictParams(num_tokens=advertised)).num_tokens_evicted == advertised
    assert s.allocated() == allocated - advertised and s.cache.evictable_size() == s.cache.evictable_size_ == 0
    s.check()
    for r in running:
        assert_truth(s, r)
        s.finish(r)
    assert_all_returned(s)


# --------------------------------------------------------------------------- property: ops, locks, evictions
def random_session(rng: random.Random):
    n = rng.randint(4, 8)
    messages = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(n)]
    cache, resident = {"drop": {}, "reposition": []}, []
    for i in range(n - 1):
        resident.append(i)
        if len(resident) > 1 and rng.random() < 0.6:
            gone = rng.sample(resident, rng.randint(1, len(resident) - 1))
            cache["drop"][str(i)] = sorted(gone)
            resident = [j for j in resident if j not in gone]
        if rng.random() < 0.4:
            cache["reposition"].append(i)
    return messages, cache


def ops_before(cache, t):
    return {"drop": {k: v for k, v in cache["drop"].items() if int(k) < t},
            "reposition": [i for i in cache["reposition"] if i < t]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), free=st.sampled_from(["lazy", "eager"]), size=st.sampled_from([96, 160]))
def test_property_random_ops_locks_and_evictions(seed, free, size):
    """Three sessions advance turn by turn (each turn's request carries the ops at earlier boundaries) under random
    interleavings of admission, finishing, retraction (and re-admission), sibling branches, aux forks, evictions,
    frees and held seals, in a small pool. After every step: sglang's invariant checks and ownership hold, and every
    running row is the float64 truth at the engine's positions (free slots poisoned). At the end every slot returns
    exactly once."""
    rng = random.Random(seed)
    s = server(size=size, free=free)
    sessions = [random_session(rng) for _ in range(3)]
    turn = [0, 0, 0]
    running: dict[int, SimReq] = {}
    retracted: dict[int, SimReq] = {}
    exact: dict[int, bool] = {}
    forks: list[SimReq] = []
    actions = ["start"] * 4 + ["finish"] * 4 + ["retract", "evict", "free", "branch", "fork", "seal"]
    for _ in range(rng.randint(20, 60)):
        action, k = rng.choice(actions), rng.randrange(3)
        messages, cache = sessions[k]
        if action == "start" and k not in running and turn[k] < len(messages):
            r = retracted.pop(k, None) or req(messages[: turn[k] + 1], ops_before(cache, turn[k]))
            before = s.cache.stats["reprefill"]
            try:
                s.start(r)
            except MemoryError:
                retracted[k] = r  # no room while others run: it waits (sglang would not admit it)
                continue
            running[k] = r
            exact[k] = s.cache.stats["reprefill"] == before
        elif action == "finish" and k in running:
            s.finish(running.pop(k))
            turn[k] += 1
        elif action == "retract" and k in running:
            r = running.pop(k)
            s.retract(r)
            retracted[k] = r
        elif action == "evict":
            s.cache.evict(EvictParams(num_tokens=rng.randint(1, 60)))
        elif action == "free":
            s.cache.free_dead()
        elif action == "branch" and turn[k] > 0:  # a plain continuation of the session's last cached state
            tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
            try:
                s.run(req(messages[: turn[k]] + [tail], ops_before(cache, turn[k] - 1)))
            except MemoryError:
                pass
        elif action == "seal" and turn[k] > 0 and k not in running:  # held until the op request takes it
            try:
                s.run(sealed(messages[: turn[k]], ops_before(cache, turn[k] - 1)), [rng.randrange(VOCAB)])
            except MemoryError:
                pass
        elif action == "fork" and turn[k] > 0 and not forks:
            body = aux.fork_request(messages[: turn[k]], ops_before(cache, turn[k] - 1), TRIG)
            f = SimReq(body["input_ids"], body["sampling_params"]["custom_params"], lora_id="adapter")
            try:
                s.start(f)
                forks.append(f)
            except MemoryError:
                pass
        s.check()
        for kk, r in running.items():
            if exact[kk]:
                assert_truth(s, r)
        if forks and rng.random() < 0.3:
            s.finish(forks.pop())
    for f in forks:
        s.finish(f)
    for r in list(running.values()):
        s.finish(r)
    for r in retracted.values():  # re-admitted and finished (their pins go with them)
        try:
            s.start(r)
            s.finish(r)
        except MemoryError:
            s.cache._unpin(id(r))
    s.cache.release_holds()  # seals no request continued
    s.check()
    event(f"holds taken>0: {s.cache.stats['hold_taken'] > 0}")
    event(f"compactions>0: {s.cache.stats['compactions'] > 0}")
    event(f"pinned>0: {s.cache.stats['pinned'] > 0}")
    event(f"reprefill>0: {s.cache.stats['reprefill'] > 0}")
    assert_all_returned(s)
