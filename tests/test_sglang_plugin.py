"""The SGLang plugin against SGLang 0.5.21's own RadixCache, MHATokenToKVPool(device="cpu") and allocator.

A stand-in "model" computes each token's KV exactly as SGLang stores it: K = RoPE(raw_k[token], position) with the
position = the token's row index, V = raw_v[token]. So the KV row of any served state can be checked against the
float64 truth: K = apply_rope(raw_k[physical ids], 0..n-1), V = raw_v[physical ids].

sglang must be importable (CI installs requirements-sglang.txt): an ImportError here is a failure, not a skip.
A real server runs in tests/test_sglang_server.py and tests/test_sglang_manager.py.
"""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kvsteward.serve.sglang.compat import prepare_sglang

prepare_sglang()

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from kvsteward.kernels.rope import apply_rope, rope_spec  # noqa: E402
from kvsteward.serve.engine.ops import OpsError  # noqa: E402
from kvsteward.serve.sglang import aux  # noqa: E402
from kvsteward.serve.sglang.ops import parse_request, request_fields  # noqa: E402
from kvsteward.serve.sglang.pool import drop_from_row, reposition_row  # noqa: E402
from kvsteward.serve.sglang.sim import SimReq  # noqa: E402
from kvsteward.serve.sglang.tree import OpNode, OpRadixCache, create_tree_cache  # noqa: E402

LAYERS, HEADS, HEAD_DIM, VOCAB, SLOTS = 2, 2, 16, 64, 256
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                     num_key_value_heads=HEADS, num_hidden_layers=LAYERS, intermediate_size=32,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4}, max_position_embeddings=512)
SPEC = rope_spec(CONFIG)
_g = torch.Generator().manual_seed(0)
RAW_K = torch.randn(VOCAB, LAYERS, HEADS, HEAD_DIM, generator=_g, dtype=torch.float64)
RAW_V = torch.randn(VOCAB, LAYERS, HEADS, HEAD_DIM, generator=_g, dtype=torch.float64)


def true_k(ids, positions, layer: int) -> torch.Tensor:
    """float64 K of pre-RoPE keys raw_k[ids] rotated at `positions`: [n, heads, head_dim]."""
    raw = RAW_K[torch.tensor(list(ids))][:, layer].transpose(0, 1)
    return apply_rope(raw, torch.as_tensor(positions, dtype=torch.int64), SPEC).transpose(0, 1)


# sglang's per-request KV record and Req, as the tree caches read them: the simulator's own stand-ins
Req = SimReq


class Server:
    """SGLang's scheduler steps for one request, on real pools: match, lock, allocate, 'prefill', cache."""

    def __init__(self, cache_cls=OpRadixCache, size: int = SLOTS, dtype: torch.dtype = torch.float32):
        self.pool = MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=HEADS,
                                     head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(size, dtype, "cpu", self.pool, need_sort=False)
        self.rows = ReqToTokenPool(16, 128, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
                                 page_size=1)
        self.cache = cache_cls(params, rope=SPEC) if cache_cls is OpRadixCache else cache_cls(params)

    def prefill(self, slots: torch.Tensor, ids, positions) -> None:
        for layer in range(LAYERS):
            dtype = self.pool.k_buffer[layer].dtype
            self.pool.k_buffer[layer][slots] = true_k(ids, positions, layer).to(dtype)
            self.pool.v_buffer[layer][slots] = RAW_V[torch.tensor(list(ids))][:, layer].to(dtype)

    def run(self, req: Req, finish: bool = True):
        ids = req.origin_input_ids
        req.kv.req_pool_idx = self.rows.alloc_rows(1)[0]
        m = self.cache.match_prefix(MatchPrefixParams(
            key=RadixKey(ids, req.extra_key, limit=len(ids) - 1), req=req))
        n = len(m.device_indices)
        self.cache.inc_lock_ref(m.last_device_node)
        req.last_node, req.kv.cache_protected_len = m.last_device_node, n
        new = self.alloc.alloc(len(ids) - n)
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        row[:n], row[n: len(ids)] = m.device_indices.to(torch.int32), new.to(torch.int32)
        off = getattr(req, "kvsteward_position_offset", 0)  # what the ForwardBatch.init_new hook adds
        self.prefill(new, ids[n:], range(n + off, len(ids) + off))
        out = SimpleNamespace(prefix_len=n, row=row[: len(ids)].long().clone(), node=m.last_device_node)
        if finish:
            self.finish(req)
        return out

    def finish(self, req: Req, insert: bool = True) -> None:
        """sglang 0.5.21's `mem_cache.common.release_kv_cache`: insert, free the rest of the row, unpin, release."""
        n = len(req.origin_input_ids) + len(req.output_ids)
        if insert:
            self.cache.insert_req(req, up_to=n)
        self.cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
        self.cache.unpin(req)
        self.cache.on_release(req, inserted=insert)
        self.rows.free_rows([req.kv.req_pool_idx])

    def kv(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[slots].clone(), v[slots].clone()) for k, v in zip(self.pool.k_buffer, self.pool.v_buffer,
                                                                      strict=True)]

    def assert_row_is_truth(self, row: torch.Tensor, physical) -> None:
        """The row holds the KV of `physical` tokens at positions 0..n-1 (K within fp32 of float64, V exact)."""
        for layer in range(LAYERS):
            k = self.pool.k_buffer[layer][row].double()
            torch.testing.assert_close(k, true_k(physical, range(len(physical)), layer), rtol=0, atol=2e-6)
            v = self.pool.v_buffer[layer][row]
            assert torch.equal(v, RAW_V[torch.tensor(list(physical))][:, layer].float())

    def free_slots(self) -> int:
        return self.alloc.available_size()


def fields(messages, cache=None, via="custom_params"):
    body = request_fields(messages, cache, via=via)
    custom = body.get("sampling_params", {}).get("custom_params")
    return body["input_ids"], custom, body.get("extra_key")


A, B, C, D, E, TRIG = [1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [20, 21]


# --------------------------------------------------------------------------------------------------- no ops
@pytest.mark.parametrize("carrier", ["plain", "custom_params"])
def test_without_ops_the_tree_matches_exactly_like_radixcache(carrier):
    g = torch.Generator().manual_seed(1)
    base, ours = Server(RadixCache), Server(OpRadixCache)
    stems = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]
    for step in range(24):
        stem = stems[step % 3]
        ids = stem[: 1 + int(torch.randint(0, len(stem), (1,), generator=g))] + \
            torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        custom = {"kvsteward": {"messages": [ids]}} if carrier == "custom_params" else None
        r0, r1 = base.run(Req(ids)), ours.run(Req(ids, custom))
        assert r0.prefix_len == r1.prefix_len and torch.equal(r0.row, r1.row), step
        assert base.cache.evictable_size() == ours.cache.evictable_size()
        assert base.cache.total_size() == ours.cache.total_size()
    for n in (7, 20, 1000):
        assert base.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == \
            ours.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        assert base.free_slots() == ours.free_slots()
    assert ours.free_slots() == SLOTS


# ----------------------------------------------------------------------------------------- op histories
def test_histories_share_up_to_the_first_differing_op_and_never_change_each_other():
    s = Server()
    ids, custom, _ = fields([A, B, C])
    first = s.run(Req(ids, custom))
    assert first.prefix_len == 0
    snapshot = s.kv(first.row)  # the cached pre-op state every request below reads

    hist_b = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})  # drop B
    hist_c = fields([A, B, C, D], {"drop": {"2": [2]}, "reposition": [2]})  # drop C
    plain = fields([A, B, C, E])  # no op: the original positions
    rb, rc, rp = s.run(Req(*hist_b[:2])), s.run(Req(*hist_c[:2])), s.run(Req(*plain[:2]))

    # each reused the cached A B C (through its own op node) and computed only its own new tokens
    assert rb.prefix_len == len(A) + len(C) and rc.prefix_len == len(A) + len(B)
    assert rp.prefix_len == len(A + B + C) and torch.equal(rp.row[:9], first.row)
    assert isinstance(rb.node.parent, OpNode) and isinstance(rc.node.parent, OpNode)
    assert rb.node.parent is not rc.node.parent  # different ops: different branches
    # the drop+reposition of one request changed nothing another reads
    for (k0, v0), (k1, v1) in zip(snapshot, s.kv(first.row), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # every row is exactly the physical tokens at 0..n-1 (reposition re-rotated into new slots)
    s.assert_row_is_truth(rb.row, hist_b[0])
    s.assert_row_is_truth(rc.row, hist_c[0])
    s.assert_row_is_truth(rp.row, plain[0])
    assert not set(rb.row.tolist()) & set(first.row.tolist())  # a position version: new slots
    # parse identity: different op histories are different states
    keys = {parse_request(c, None).history_key for c in (hist_b[1], hist_c[1], plain[1])}
    assert len(keys) == 3

    # the same history again reuses the op node and everything after it: no new slots for the reposition
    free = s.free_slots()
    again = s.run(Req(*hist_b[:2]))
    assert again.prefix_len == len(hist_b[0]) - 1 and torch.equal(again.row[:-1], rb.row[:-1])
    assert s.free_slots() == free and s.cache.stats["op_nodes"] == 4  # 2 drops + 2 repositions
    # a request with another op path under the same tokens does not see B's branch
    other = s.run(Req(*fields([A, B, C, D], {"drop": {"2": [0]}, "reposition": [2]})[:2]))
    assert other.prefix_len == len(B) + len(C)


def test_extra_key_carrier_is_the_same_state_as_custom_params():
    s = Server()
    s.run(Req(*fields([A, B, C])[:2]))
    via_custom = s.run(Req(*fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})[:2]))
    ids, _, extra = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]}, via="extra_key")
    via_extra = s.run(Req(ids, None, extra))
    assert via_extra.prefix_len == len(ids) - 1 and torch.equal(via_extra.row[:-1], via_custom.row[:-1])


def test_reposition_rerotates_k_exactly_and_keeps_v_and_originals():
    s = Server()
    first = s.run(Req(*fields([A, B, C, D])[:2]))
    before = s.kv(first.row)
    # drop B and D after message 3, reposition: survivors A C move from positions 0-2, 7-8 to 0..4
    ids, custom, _ = fields([A, B, C, D, E], {"drop": {"3": [1, 3]}, "reposition": [3]})
    r = s.run(Req(ids, custom))
    survivors = torch.tensor([0, 1, 2, 7, 8])
    for layer, (k0, v0) in enumerate(before):
        k_new = s.pool.k_buffer[layer][r.row[:5]].double()
        torch.testing.assert_close(k_new, true_k(A + C, range(5), layer), rtol=0, atol=2e-6)
        assert torch.equal(s.pool.v_buffer[layer][r.row[:5]], v0[survivors])  # V copied bit for bit
        assert torch.equal(s.pool.k_buffer[layer][first.row], k0)  # originals untouched
        assert torch.equal(s.pool.v_buffer[layer][first.row], v0)
    s.assert_row_is_truth(r.row, A + C + E)


def test_chained_repositions_rotate_from_the_model_written_keys_in_bf16():
    """Each request drops one more message and repositions again (a chain of position versions). In a bf16 pool every
    version's K is ONE rotation of the key the model wrote (the origin slot), bit for bit — not a rotation of the
    previous version — so rounding does not compound along the chain; V is the origin's V."""
    from kvsteward.kernels.rope import rerotate
    from kvsteward.serve.sglang.tree import OpNode

    s = Server(dtype=torch.bfloat16)
    msgs = [A, B, C, D, E, TRIG, [30, 31, 32], [33, 34], [35, 36, 37]]
    s.run(Req(*fields(msgs[:4])[:2]))
    for k in range(3, len(msgs) - 1):  # request k: messages[:k+2], drops {3: [1], 4: [2], ...}, repositions 3..k
        cache = {"drop": {str(j): [j - 2] for j in range(3, k + 1)}, "reposition": list(range(3, k + 1))}
        r = s.run(Req(*fields(msgs[: k + 2], cache)[:2]))
    node = r.node
    while not (isinstance(node, OpNode) and node.op[0] == "reposition"):
        node = node.parent
    assert node.origin.numel() == node.kv_row.numel() and not torch.equal(node.origin, node.kv_row)
    delta = node.positions - node.origin_pos
    assert bool((delta != 0).any())
    for layer in range(LAYERS):
        k_orig = s.pool.k_buffer[layer][node.origin].transpose(0, 1).float()
        want = rerotate(k_orig, delta, SPEC, torch.bfloat16).transpose(0, 1)
        assert torch.equal(s.pool.k_buffer[layer][node.kv_row], want)
        assert torch.equal(s.pool.v_buffer[layer][node.kv_row], s.pool.v_buffer[layer][node.origin])


def test_private_row_drop_and_in_place_reposition():
    s = Server()
    ids = A + B + C
    slots = s.alloc.alloc(len(ids))
    s.prefill(slots, ids, range(len(ids)))
    s.rows.req_to_token[1, : len(ids)] = slots.to(torch.int32)
    n, removed = drop_from_row(s.rows.req_to_token, 1, len(ids), torch.arange(3, 7))  # drop B
    assert n == 5 and torch.equal(removed.long(), slots[3:7])
    old_positions = torch.tensor([0, 1, 2, 7, 8])
    reposition_row(s.pool, s.rows.req_to_token, 1, n, old_positions, SPEC)
    s.assert_row_is_truth(s.rows.req_to_token[1, :n].long(), A + C)


# ---------------------------------------------------------------------------------------------- eviction
def test_eviction_frees_only_unlocked_leaves():
    s = Server()
    s.run(Req(*fields([A, B, C])[:2]))
    ops = {"drop": {"2": [1]}, "reposition": [2]}
    held = Req(*fields([A, B, C, D], ops)[:2])
    r = s.run(held, finish=False)  # in flight: holds the path root -> A B C -> drop -> reposition
    s.run(Req(*fields([A, B, C, E])[:2]))  # a finished sibling branch, unlocked
    s.cache.evict(EvictParams(num_tokens=10_000))
    # the in-flight request's prefix is intact: its reposition node now owns what its row and origins need (the
    # survivors' version and the model-written originals A C); the dropped B went back to the allocator
    repos = r.node
    assert isinstance(repos, OpNode) and repos.op == ("reposition",) and repos.parent is s.cache.root_node
    assert s.cache.protected_size() == 2 * len(A + C) and s.cache.stats["freed"] == len(B)
    assert s.cache.evictable_size() == 0
    s.assert_row_is_truth(r.row[: len(A + C)], A + C)
    # after it finishes, everything can go, and every slot returns to the allocator exactly once
    s.finish(held)
    s.cache.evict(EvictParams(num_tokens=10_000))
    assert s.free_slots() == SLOTS and s.cache.total_size() == 0 and s.cache.stats["op_nodes"] == 0
    assert len(set(s.alloc.free_pages.tolist())) == SLOTS


def test_chunked_request_caches_its_part_under_the_op_path_without_leaks():
    s = Server()
    s.run(Req(*fields([A, B, C])[:2]))
    ids, custom, _ = fields([A, B, C, D, E], {"drop": {"2": [1]}, "reposition": [2]})
    req = Req(ids, custom)
    r = s.run(req, finish=False)
    s.cache.cache_unfinished_req(req)  # a chunk boundary: what was computed so far enters the tree
    assert torch.equal(req.prefix_indices, r.row) and req.kv.cache_protected_len == len(ids)
    assert s.run(Req(ids, custom)).prefix_len == len(ids) - 1  # a twin already reuses the chunk
    s.finish(req)
    s.cache.evict(EvictParams(num_tokens=10_000))
    assert s.free_slots() == SLOTS and len(set(s.alloc.free_pages.tolist())) == SLOTS


def test_reposition_evicts_for_room_but_never_its_own_parent():
    s = Server(size=20)
    s.run(Req(*fields([A, B, C])[:2]))  # 9 slots
    s.run(Req(*fields([[30, 31, 32, 33, 34, 35, 36, 37]])[:2]))  # 8 unrelated slots: 3 left
    r = s.run(Req(*fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})[:2]))
    assert r.prefix_len == len(A + C)  # the 5 new slots came from evicting the unrelated leaf
    s.assert_row_is_truth(r.row, A + C + D)


def test_uncached_pre_op_state_is_served_as_plain_tokens():
    s, base = Server(), Server(RadixCache)
    ids, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})  # A B C never cached
    r, r0 = s.run(Req(ids, custom)), base.run(Req(ids))
    assert s.cache.stats["reprefill"] == 1 and s.cache.stats["op_nodes"] == 0
    assert r.prefix_len == r0.prefix_len == 0
    # cached as plain tokens: a plain request for the same ids shares it, an op request does not see it
    assert s.run(Req(ids)).prefix_len == len(ids) - 1


# ------------------------------------------------------------------------------------------------ parsing
def test_op_grammar_refusals_and_physical_ids():
    ids, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    assert ids == A + C + D
    hist = parse_request(custom, None)
    assert hist.elements == (("tokens", array("q", A + B + C)), ("drop", (3, 4, 5, 6)), ("reposition",),
                             ("tokens", array("q", D)))
    # a plain drop (no reposition): survivors keep positions 0-2, 7-8; D goes to 9..11 at row indices 5..7
    ids, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}})
    plain = parse_request(custom, None)
    assert ids == A + C + D and plain.positions == (0, 1, 2, 7, 8, 9, 10, 11) and plain.position_offset == 4
    assert hist.position_offset == 0 and hist.positions == tuple(range(len(A + C + D)))
    with pytest.raises(OpsError, match="end with appended tokens"):
        fields([A, B], {"reposition": [1]})
    with pytest.raises(OpsError, match="not yet appended"):
        fields([A, B, C], {"drop": {"0": [1]}, "reposition": [0]})
    assert parse_request({"other": 1}, "tenant-1") is None


def test_malformed_history_or_wrong_input_ids_fall_back_to_plain_tokens():
    s = Server()
    r = s.run(Req(A + B, {"kvsteward": {"messages": [A, B], "cache": {"drop": {"9": [0]}}}}))
    _, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    r2 = s.run(Req(A + B + C + D, custom))  # input_ids are the logical, not the physical, tokens
    assert s.cache.stats["refused"] == 2 and r.prefix_len == 0 and r2.prefix_len == len(A + B)
    assert s.cache.stats["op_nodes"] == 0


# ----------------------------------------------------------------------------------------------- aux fork
def test_aux_fork_reads_the_main_state_and_its_decision_is_the_next_drop():
    s = Server()
    main_msgs = [A, B, C]  # B: a tool response, cursor 1
    main = s.run(Req(*fields(main_msgs)[:2]))
    body = aux.fork_request(main_msgs, None, TRIG)
    fork = s.run(Req(body["input_ids"], body["sampling_params"]["custom_params"]))
    assert fork.prefix_len == len(A + B + C) and torch.equal(fork.row[:9], main.row)  # prefix fork, no copy
    reply = '{"del_cursors": [1, 7]}'  # 7 is not an open cursor: ignored
    assert aux.parse_del_cursors(reply, [1]) == [1]
    nxt = aux.next_main_request(main_msgs, None, reply, [1], [D])
    assert json.loads(nxt["sampling_params"]["custom_params"]["kvsteward"])["cache"] == \
        {"drop": {"2": [1]}, "reposition": [2]}
    r = s.run(Req(nxt["input_ids"], nxt["sampling_params"]["custom_params"]))
    assert r.prefix_len == len(A + C)  # the main state (not the fork's trigger) with B dropped
    s.assert_row_is_truth(r.row, A + C + D)
    assert not set(r.row.tolist()) & set(fork.row[9:].tolist())  # aux tokens never enter the main context


def test_aux_fork_close_bias_is_sglang_logit_bias_on_the_closing_tokens():
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvsteward.models import load_tokenizer
    from kvsteward.serve.manager.decode import closing_tokens

    tok = load_tokenizer("smollm2")
    closing = closing_tokens(tok)
    texts = {tok.decode([t]) for t in closing}
    assert {" []", "]}"} <= texts and all("]" in t for t in texts)  # the two ways the trained targets close
    body = aux.fork_request([A, B, C], None, TRIG, close_bias=2.5, closing_tokens=closing)
    params = body["sampling_params"]
    assert params["logit_bias"] == {str(t): 2.5 for t in closing}
    sp = SamplingParams(**{k: v for k, v in params.items() if k != "custom_params"})
    sp.verify(len(tok))  # SGLang's own check accepts it
    with pytest.raises(ValueError, match="logit_bias"):
        sp.verify(min(closing))  # and it is the check that would refuse a bad id
    assert "logit_bias" not in aux.fork_request([A, B, C], None, TRIG)["sampling_params"]
    with pytest.raises(ValueError, match="closing token ids"):
        aux.fork_request([A, B, C], None, TRIG, close_bias=1.0)


# ------------------------------------------------------------------------------------------- plugin wiring
def test_plugin_registers_the_backend_and_its_factory_builds_the_tree():
    from importlib.metadata import entry_points

    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from kvsteward.serve.sglang.plugin import register

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvsteward"]
    assert ep.load() is register
    register()
    register()  # idempotent: SGLang loads plugins in several processes and may call it again
    factory = get_radix_cache_factory("kvsteward")
    assert factory is create_tree_cache
    s = Server(RadixCache)
    ctx = SimpleNamespace(params=CacheInitParams(
        disable=False, req_to_token_pool=s.rows, token_to_kv_pool_allocator=s.alloc, page_size=1),
        enable_hierarchical_cache=False, is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False,
        model_config=SimpleNamespace(hf_config=CONFIG))
    tree = factory(ctx)
    assert isinstance(tree, OpRadixCache) and torch.equal(tree.rope.inv_freq, SPEC.inv_freq)
    with pytest.raises(ValueError, match="hierarchical"):
        factory(SimpleNamespace(**{**vars(ctx), "enable_hierarchical_cache": True}))


# ------------------------------------------------------------------------------------ the compact op channel
def test_the_op_channel_is_a_json_string_that_survives_msgpack():
    """sglang declares custom_params values as scalars / lists of scalars / dicts of scalars ("must survive msgpack
    IPC"): the kvsteward field is one JSON string, which msgspec accepts as that type; the nested form is refused."""
    import msgspec
    from sglang.srt.sampling.sampling_params import CustomParamValue

    _, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})
    assert isinstance(custom["kvsteward"], str)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(custom), type=dict[str, CustomParamValue])
    assert parse_request(wire, None).elements == parse_request(custom, None).elements
    nested = {"kvsteward": {"messages": [A, B], "cache": {}}}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(nested), type=dict[str, CustomParamValue])


def test_compact_requests_continue_the_remembered_history():
    """A client's compact requests (base key + new messages + new ops) parse on the server to the same elements,
    physical ids, positions and key as the full form; the tree serves them the same rows; an unknown base is
    refused (served as plain tokens), never guessed."""
    from kvsteward.serve.sglang.ops import SglangHistory

    s, client = Server(size=1024), SglangHistory()
    r1, r2, r3 = TRIG + [30], TRIG + [31], TRIG + [32]  # each prompt and its reply
    d1, d2 = {"drop": {"2": [1]}}, {"drop": {"2": [1]}, "reposition": [4]}
    turns = [([A, B, TRIG], None), ([A, B, r1], None),  # a turn, then its reply sealed (cached whole) before a drop
             ([A, B, r1, C, TRIG], d1), ([A, B, r1, C, r2], d1), ([A, B, r1, C, r2, D, TRIG], d2),
             ([A, B, r1, C, r2, D, r3], d2), ([A, B, r1, C, r2, D, r3, E, TRIG], {**d2, "drop": {"2": [1], "6": [3]}})]
    for t, (messages, cache) in enumerate(turns):
        body = client.fields(messages, cache)
        custom = body["sampling_params"]["custom_params"]
        assert ('"base"' in custom["kvsteward"]) == (t > 0)
        full_ids, full_custom, _ = fields(messages, cache)
        assert body["input_ids"] == full_ids
        mine = parse_request(custom, None, s.cache.histories)
        ref = parse_request(full_custom, None)
        assert (mine.elements, mine.physical_ids, mine.positions, mine.key) == \
            (ref.elements, ref.physical_ids, ref.positions, ref.key), t
        r = s.run(Req(body["input_ids"], custom))
        positions = torch.tensor(ref.positions)
        for layer in range(LAYERS):  # the row holds K at the history's positions (the engine's), V exact
            torch.testing.assert_close(s.pool.k_buffer[layer][r.row].double(),
                                       true_k(full_ids, positions, layer), rtol=0, atol=2e-6)
    assert s.cache.stats["refused"] == s.cache.stats["reprefill"] == 0 and s.cache.histories.stats["hits"] >= 6
    stale = SglangHistory()
    stale._known = client._known
    other = Server()  # a restarted server: nothing remembered
    body = stale.fields(turns[-1][0] + [[40, 41]], turns[-1][1])
    other.run(Req(body["input_ids"], body["sampling_params"]["custom_params"]))
    assert other.cache.stats["refused"] == other.cache.stats["unknown_base"] == 1


def test_a_walk_starts_at_the_deepest_op_node_the_tree_holds():
    """The tree remembers each op node by the chained key of the elements up to it: a later request's walk starts
    there (the same row as a walk from the root), and an evicted op node is forgotten, not reused."""
    s = Server(size=1024)
    s.run(Req(*fields([A, B, C])[:2]))
    ops = {"drop": {"2": [1]}, "reposition": [2]}
    first = s.run(Req(*fields([A, B, C, D], ops)[:2]))
    assert len(s.cache._anchors) == 2  # the drop and the reposition
    hist = parse_request(fields([A, B, C, D, E], ops)[1], None)
    walk = s.cache.walk(hist, RadixKey(array("q", hist.physical_ids), None), limit=len(hist.physical_ids))
    assert walk.anchor is first.node and first.node.op == ("reposition",)  # D was not cached yet: its node
    assert torch.equal(torch.cat(walk.row)[: len(A + C + D) - 1], first.row[:-1])
    s.cache.evict(EvictParams(num_tokens=10_000))
    assert not s.cache._anchors and s.cache.stats["op_nodes"] == 0
    again = s.run(Req(*fields([A, B, C, D], ops)[:2]))  # pre-op state gone: plain tokens, nothing stale used
    assert again.prefix_len == 0 and s.cache.stats["reprefill"] == 1


def test_match_prefix_cost_does_not_grow_with_earlier_messages():
    """`serve.bench.sglang.match_prefix_scaling`: per-request match time on sglang's own tree, for conversations of
    8 and 128 messages (rolling drops: ~90 ops in the longer one). The compact form stays flat; the full form (every
    message re-sent and re-parsed) grows with the conversation."""
    from kvsteward.serve.bench.sglang import match_prefix_scaling

    rows = match_prefix_scaling((8, 128), message_len=16, repeats=15)["rows"]
    short, long = rows
    assert long["payload_bytes_compact"] < 2 * short["payload_bytes_compact"]
    assert long["match_ms_compact"] < 3 * short["match_ms_compact"] + 0.3
    assert long["match_ms_full"] > 3 * long["match_ms_compact"]


# ----------------------------------------------------------------------------------------- the aux fork (LoRA)
def test_a_lora_fork_reads_the_base_state_and_caches_nothing():
    """sglang appends a LoRA request's adapter id to its extra_key; a fork carrying the main's history still matches
    the main's (base model) state, its trigger is never matched against the tree, and nothing it computed is
    inserted: its slots go back to the allocator when it ends."""
    s = Server()
    main = s.run(Req(*fields([A, B, C + TRIG[:1]])[:2]))  # the main's reply prompt starts like the trigger
    body = aux.fork_request([A, B, C], None, TRIG)
    free = s.free_slots()
    fork = Req(body["input_ids"], body["sampling_params"]["custom_params"], lora_id="adapter-1")
    r = s.run(fork)
    assert r.prefix_len == len(A + B + C) and torch.equal(r.row[: len(A + B + C)], main.row[: len(A + B + C)])
    assert s.free_slots() == free and s.cache.stats["forks"] == 1
    plain = s.run(Req(body["input_ids"]))  # the fork's tokens as a plain request: only the main's part is cached
    assert plain.prefix_len == len(A + B + C) + 1
    # without the history, a LoRA request is sglang's: its own namespace
    assert s.run(Req(body["input_ids"], None, lora_id="adapter-1")).prefix_len == 0


# ----------------------------------------------------------------------------------------------- versions
def test_the_plugin_refuses_an_unsupported_sglang_version(monkeypatch):
    from sglang.srt.mem_cache import registry

    from kvsteward.serve.sglang import plugin

    plugin.check_version("0.5.21")
    for bad in ("0.5.19", "0.5.23", None):
        with pytest.raises(plugin.UnsupportedSglang, match="supports sglang 0.5.21"):
            plugin.check_version(bad or "")
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    with pytest.raises(plugin.UnsupportedSglang):
        plugin.register()
    with pytest.raises(plugin.UnsupportedSglang, match="0.5.23"):  # the server stops at start, with the reason
        registry.get_radix_cache_factory("kvsteward")(SimpleNamespace())
    monkeypatch.setenv("KVSTEWARD_SGLANG_ANY_VERSION", "1")
    plugin.check_version("0.5.23")


# ------------------------------------------------------------------------- plain drop: the position offset
def replay_session(session, messages, cache):
    """The kvsteward engine's own bookkeeping for the same history: append each message, then its boundary ops
    (drop, then reposition), with drops given as logical token indices."""
    starts = [sum(len(m) for m in messages[:i]) for i in range(len(messages))]
    for i, m in enumerate(messages):
        session.append(list(m), logits=None)
        if str(i) in cache.get("drop", {}):
            session.drop([t for j in cache["drop"][str(i)] for t in range(starts[j], starts[j] + len(messages[j]))])
        if i in cache.get("reposition", []):
            session.reposition()


def random_history(g: torch.Generator):
    """Messages of 1-4 tokens and random drops (of resident messages, keeping one) and repositions at boundaries."""
    n = int(torch.randint(3, 8, (1,), generator=g))
    messages = [torch.randint(0, VOCAB, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]
    cache, resident = {"drop": {}, "reposition": []}, []
    for i in range(n - 1):
        resident.append(i)
        if len(resident) > 1 and torch.rand(1, generator=g) < 0.5:
            k = int(torch.randint(1, len(resident), (1,), generator=g))
            gone = sorted(resident[j] for j in torch.randperm(len(resident), generator=g)[:k].tolist())
            cache["drop"][str(i)] = gone
            resident = [j for j in resident if j not in gone]
        if torch.rand(1, generator=g) < 0.3:
            cache["reposition"].append(i)
    return messages, cache


def ops_before(cache, t):
    """The cache ops of a request holding messages 0..t: those at boundaries before message t."""
    return {"drop": {k: v for k, v in cache["drop"].items() if int(k) < t},
            "reposition": [i for i in cache["reposition"] if i < t]}


@pytest.fixture(scope="module")
def engine():
    from kvsteward.models import tiny_model
    from kvsteward.serve.engine import Engine

    torch.set_num_threads(1)
    return Engine(tiny_model("llama", seed=3))


def op_anchor(node):
    while node is not None and not isinstance(node, OpNode):
        node = node.parent
    return node


@pytest.mark.parametrize("seed", range(12))
def test_position_offset_of_op_paths_equals_the_engine_bookkeeping(engine, seed):
    """Turn by turn (each turn's pre-op state cached by the turn before, as an agent loop sends it): the offset the
    tree sets on the request = the engine session's next position - resident count, and the positions of the tree
    state (its op node's positions, then next_position onwards) = the session's resident positions."""
    g = torch.Generator().manual_seed(100 + seed)
    messages, cache = random_history(g)
    s = Server(size=1024)
    offsets = []
    for t in range(len(messages)):
        ops = ops_before(cache, t)
        ids, custom, _ = fields(messages[: t + 1], ops)
        req = Req(ids, custom)
        r = s.run(req)
        assert r.prefix_len >= len(ids) - len(messages[t]) - 1 and s.cache.stats["reprefill"] == 0, t
        ref = engine.session("full")
        replay_session(ref, messages[: t + 1], ops)
        want = ref.next_pos - ref.resident
        assert req.kvsteward_position_offset == want == parse_request(custom, None).position_offset, t
        anchor = op_anchor(r.node)
        row_positions = (anchor.positions.tolist() if anchor is not None else []) + \
            list(range(anchor.next_position if anchor is not None else 0,
                       (anchor.next_position if anchor is not None else 0) + len(ids) - len(anchor.kv_row if anchor
                                                                                           is not None else [])))
        assert row_positions == ref.resident_positions().tolist(), t
        # the served row holds K = RoPE(raw, the engine's position) for every resident token, V bit for bit
        physical = ids
        for layer in range(LAYERS):
            torch.testing.assert_close(s.pool.k_buffer[layer][r.row].double(),
                                       true_k(physical, ref.resident_positions(), layer), rtol=0, atol=2e-6)
            assert torch.equal(s.pool.v_buffer[layer][r.row], RAW_V[torch.tensor(physical)][:, layer].float())
        offsets.append(want)
        if cache["reposition"] and max(cache["reposition"]) < t:  # a reposition after the last drop resets it
            last_rep = max(cache["reposition"])
            if all(int(k) <= last_rep for k in ops["drop"]):
                assert want == 0
    # every seed's history ends with a tail after its ops; the offsets seen are those of the engine (checked above)
    assert len(offsets) == len(messages)


def test_offset_resets_after_reposition_and_mixed_paths_are_unchanged():
    s = Server()
    s.run(Req(*fields([A, B, C])[:2]))
    plain = Req(*fields([A, B, C, D], {"drop": {"2": [1]}})[:2])
    s.run(plain)
    assert plain.kvsteward_position_offset == len(B)
    both = Req(*fields([A, B, C, D], {"drop": {"2": [1]}, "reposition": [2]})[:2])
    r = s.run(both)
    assert both.kvsteward_position_offset == 0
    s.assert_row_is_truth(r.row, A + C + D)  # drop+reposition: exactly as before
    # plain drop, append, then reposition: the appended tokens (computed at 9..11) are re-rotated from there
    r = s.run(Req(*fields([A, B, C, D, E], {"drop": {"2": [1]}, "reposition": [3]})[:2]))
    s.assert_row_is_truth(r.row, A + C + D + E)
    # a drop, an append, a second drop and no reposition: offsets add up
    s.run(Req(*fields([A, B, C, D, E], {"drop": {"2": [1]}})[:2]))
    two = Req(*fields([A, B, C, D, E, TRIG], {"drop": {"2": [1], "4": [0]}})[:2])
    s.run(two)
    assert two.kvsteward_position_offset == len(B) + len(A)
    row = s.run(Req(*fields([A, B, C, D, E, TRIG], {"drop": {"2": [1], "4": [0]}})[:2])).row
    for layer in range(LAYERS):  # C D E TRIG at their logical positions 7.. (A, B dropped)
        torch.testing.assert_close(s.pool.k_buffer[layer][row].double(), true_k(C + D + E + TRIG, range(7, 16), layer),
                                   rtol=0, atol=2e-6)
    # a tree built for a server that cannot apply offsets serves plain drops as plain tokens
    s2 = Server()
    s2.cache.plain_drop = False
    s2.run(Req(*fields([A, B, C])[:2]))
    refused = Req(*fields([A, B, C, D], {"drop": {"2": [1]}})[:2])
    assert s2.run(refused).prefix_len == len(A) and s2.cache.stats["refused"] == 1  # plain tokens A C D: A shared
    assert refused.kvsteward_position_offset == 0


# ------------------------------------------------------------------ the hook on SGLang's own ForwardBatch
@pytest.fixture(scope="module")
def sglang_runtime(tmp_path_factory):
    """What SGLang's scheduler process has before it builds batches: published server args (torch_native attention,
    CPU) and the plugin loaded (register + HookRegistry.apply_hooks, as load_plugins does)."""
    from kvsteward.serve.sglang.compat import _lenient_auto_config, _torchvision_for_import

    with _torchvision_for_import(), _lenient_auto_config():
        from sglang.srt import runtime_context as rc
        from sglang.srt.managers.schedule_batch import Req as SglReq
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from kvsteward.serve.sglang.plugin import register
    from kvsteward.serve.sglang.positions import hook_applied

    model_dir = tmp_path_factory.mktemp("model")
    config = LlamaConfig(**CONFIG.to_dict())
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(model_dir)
    snapshot = rc.snapshot_context()
    rc.publish(ServerArgs(model_path=str(model_dir), device="cpu", skip_tokenizer_init=True,
                          attention_backend="torch_native"), role="scheduler")
    register()
    HookRegistry.apply_hooks()
    assert hook_applied()
    # the ModelRunner attributes ForwardBatch.init_new reads (a CPU runner with torch_native attention)
    runner = SimpleNamespace(device="cpu", is_draft_worker=False, prefill_attention_backend_str="torch_native",
                             kv_index_translator=SimpleNamespace(rebind_write_loc=lambda fb: None),
                             ngram_embedding_manager=SimpleNamespace(enabled=False), lora_manager=None,
                             model_config=SimpleNamespace(model_is_mrope=False, requires_mm_token_modalities=False),
                             attn_dcp_size=1)
    ns = SimpleNamespace(Req=SglReq, ScheduleBatch=ScheduleBatch, ForwardBatch=ForwardBatch, runner=runner,
                         SamplingParams=SamplingParams, NONE=SpeculativeAlgorithm.NONE)
    with rc.get_parallel().override(moe_ep_size=1):
        yield ns
    rc.restore_context(snapshot)


def sgl_req(rt, rid, messages, cache=None):
    ids, custom, _ = fields(messages, cache)
    return rt.Req(rid, "", array("q", ids), rt.SamplingParams(max_new_tokens=4, custom_params=custom),
                  vocab_size=VOCAB)


def forward(rt, s: Server, batch, session_positions=None):
    """The stand-in model on a real ForwardBatch: K = RoPE(raw_k[token], forward_batch.positions), V = raw_v[token],
    written to the batch's out_cache_loc. Returns the ForwardBatch."""
    fb = rt.ForwardBatch.init_new(batch, rt.runner, return_hidden_states_before_norm=False)
    ids = fb.input_ids.tolist() if fb.input_ids is not None else batch.prefill_input_ids_cpu.tolist()
    s.prefill(fb.out_cache_loc.long(), ids, fb.positions)
    return fb


def test_hook_offsets_extend_and_decode_positions_per_request(sglang_runtime, engine):
    """Real Req / ScheduleBatch (prepare_for_extend, prepare_for_decode) and the hooked ForwardBatch.init_new on a
    mixed batch: a plain-drop request (offset 4) next to a plain request (offset 0). Positions = row index + offset;
    the K written for every token of the plain-drop request's row = RoPE(raw, the engine session's position), V
    bit-identical — what the kvsteward engine stores for the same history."""
    rt = sglang_runtime
    s = Server()
    s.run(Req(*fields([A, B, C])[:2]))  # turn 1: A B C cached (no ops: row positions are exact)
    dropped = sgl_req(rt, "drop", [A, B, C, D], {"drop": {"2": [1]}})
    plain = sgl_req(rt, "plain", [A, B, C, E])
    for r in (dropped, plain):
        r.init_next_round_input(s.cache)
        r.set_extend_range(len(r.prefix_indices), len(r.origin_input_ids))
    assert dropped.kvsteward_position_offset == len(B) and plain.kvsteward_position_offset == 0
    batch = rt.ScheduleBatch.init_new([dropped, plain], s.rows, s.alloc, s.cache,
                                      SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False), False, rt.NONE)
    batch.prepare_for_extend()
    assert batch.prefix_lens == [len(A + C), len(A + B + C)] and batch.extend_lens == [len(D), len(E)]
    fb = forward(rt, s, batch)
    # extend: dropped rows 5..7 at positions 9..11; plain rows 9..10 at 9..10 (row index: untouched)
    assert fb.positions.tolist() == [9, 10, 11, 9, 10]
    # decode: one more token each; dropped row 8 -> position 12, plain row 11 -> 11
    for r in (dropped, plain):
        r.output_ids.append(TRIG[0])
    batch.input_ids = torch.tensor([TRIG[0], TRIG[0]])
    batch.prepare_for_decode()
    fb = forward(rt, s, batch)
    assert fb.positions.tolist() == [12, 11]
    # the rows against the engine's bookkeeping for the same histories (AKV plain drop: positions are kept)
    ref_drop, ref_plain = engine.session("full"), engine.session("full")
    replay_session(ref_drop, [A, B, C, D + TRIG[:1]], {"drop": {"2": [1]}})
    replay_session(ref_plain, [A, B, C, E + TRIG[:1]], {})
    for r, ref, physical in ((dropped, ref_drop, A + C + D + TRIG[:1]), (plain, ref_plain, A + B + C + E + TRIG[:1])):
        row = s.rows.req_to_token[r.kv.req_pool_idx, : len(physical)].long()
        positions = ref.resident_positions()
        for layer in range(LAYERS):
            torch.testing.assert_close(s.pool.k_buffer[layer][row].double(), true_k(physical, positions, layer),
                                       rtol=0, atol=2e-6)
            assert torch.equal(s.pool.v_buffer[layer][row], RAW_V[torch.tensor(physical)][:, layer].float())
    assert positions.tolist() == list(range(len(physical)))  # the plain request's reference: row positions
    assert ref_drop.resident_positions().tolist() == [0, 1, 2, 7, 8, 9, 10, 11, 12]


def test_hook_is_inert_without_offsets_and_refuses_unsupported_batches(sglang_runtime):
    from kvsteward.serve.sglang.positions import offset_positions

    rt = sglang_runtime
    s = Server()
    req = sgl_req(rt, "p", [A, B])
    req.init_next_round_input(s.cache)
    req.set_extend_range(0, len(A + B))
    batch = rt.ScheduleBatch.init_new([req], s.rows, s.alloc, s.cache,
                                      SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False), False, rt.NONE)
    batch.prepare_for_extend()
    fb = rt.ForwardBatch.init_new(batch, rt.runner, return_hidden_states_before_norm=False)
    assert fb.positions.tolist() == list(range(len(A + B)))
    req.kvsteward_position_offset = 3
    original = rt.ForwardBatch.init_new.__func__.__wrapped__
    fb = offset_positions(original, rt.ForwardBatch, batch, rt.runner, return_hidden_states_before_norm=False)
    assert fb.positions.tolist() == [3 + i for i in range(len(A + B))]
    mrope = SimpleNamespace(**{**vars(rt.runner), "model_config": SimpleNamespace(
        model_is_mrope=True, requires_mm_token_modalities=False)})
    with pytest.raises(RuntimeError, match="M-RoPE"):
        offset_positions(original, rt.ForwardBatch, batch, mrope, return_hidden_states_before_norm=False)


# ------------------------------------------------------------------ a lost pre-op state: refused, then rebuilt
def test_a_miss_is_refused_before_any_work_when_the_request_asks():
    """`miss: "refuse"`: an op after a state the tree holds only in part marks the request with the pre-op state's
    logical length (what the client re-sends) and matches nothing; nothing is re-prefilled or cached. Without the
    field, or for a retracted request (it has output), the old path serves it as plain tokens (counted)."""
    from kvsteward.serve.sglang.refusal import REFUSAL_ATTR

    s = Server()
    s.run(Req(*fields([A, B])[:2]))  # A and part of B cached: B's tail is never computed (the last token)
    ids, custom, _ = fields([A, B, C, D], {"drop": {"2": [1]}})
    custom = {"kvsteward": json.dumps({**json.loads(custom["kvsteward"]), "miss": "refuse"})}
    req = Req(ids, custom)
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), None, limit=len(ids) - 1), req=req))
    tokens, why = getattr(req, REFUSAL_ATTR)
    assert tokens == len(A + B + C) and "tokens cached before an op" in why
    assert len(m.device_indices) == 0 and m.last_device_node is s.cache.root_node
    assert s.cache.stats["refused_miss"] == 1 and s.cache.stats["reprefill"] == 0
    # a re-match clears the mark (the state may be cached by then)
    s.run(Req(*fields([A, B, C])[:2]))
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), None, limit=len(ids) - 1), req=req))
    assert getattr(req, REFUSAL_ATTR) is None and len(m.device_indices) == len(A + C)
    # a retracted request (it has output) is not refused
    s2 = Server()
    retracted = Req(ids, custom)
    retracted.output_ids = array("q", [5])
    s2.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), None, limit=len(ids) - 1), req=retracted))
    assert getattr(retracted, REFUSAL_ATTR) is None and s2.cache.stats["reprefill"] == 1
    with pytest.raises(OpsError, match="miss"):
        parse_request({"kvsteward": json.dumps({**json.loads(custom["kvsteward"]), "miss": "maybe"})}, None)


def test_refused_requests_are_skipped_and_aborted_from_the_waiting_queue():
    """The two scheduler hooks: a marked request reserves nothing (`CONTINUE` without the adder seeing it) and is
    aborted through sglang's `abort_request` after the batch is built, with a 409 `kvsteward_miss` finish reason
    naming the pre-op state; unmarked requests pass through untouched. When nothing runs and nothing was admitted
    while requests wait, held seals are released."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from kvsteward.serve.sglang.ops import MISS_ERR_TYPE, MISS_TOKENS
    from kvsteward.serve.sglang.refusal import REFUSAL_ATTR, abort_refused, skip_refused

    seen = []
    marked, plain = Req([1, 2], rid="m"), Req([3, 4], rid="p")
    setattr(marked, REFUSAL_ATTR, (42, "message segment 2: 3 of 9 tokens cached before an op"))
    assert skip_refused(lambda adder, req, *a, **k: seen.append(req) or AddReqResult.NO_TOKEN, None, marked,
                        False, None) is AddReqResult.CONTINUE
    assert skip_refused(lambda adder, req, *a, **k: seen.append(req) or AddReqResult.NO_TOKEN, None, plain,
                        False, None) is AddReqResult.NO_TOKEN
    assert seen == [plain]
    from kvsteward.serve.sglang.refusal import DEFER_ATTR

    deferred = Req([5, 6], rid="d")
    setattr(deferred, DEFER_ATTR, "op reposition at element 4 could not be materialized")
    assert skip_refused(lambda adder, req, *a, **k: seen.append(req), None, deferred, False, None) \
        is AddReqResult.NO_TOKEN and seen == [plain]  # waits in its place for room, like a request that does not fit
    aborted, released = [], []
    idle = SimpleNamespace(batch_to_run=None, running_batch=SimpleNamespace(is_empty=lambda: True,
                                                                           batch_is_full=True))
    tree = SimpleNamespace(release_holds=lambda taken: released.append(taken) or 1)
    scheduler = SimpleNamespace(waiting_queue=[plain, marked], abort_request=aborted.append, tree_cache=tree)
    assert abort_refused(lambda sch, running: idle, scheduler, None) is idle
    # nothing ran or was admitted while requests wait: holds released (taken ones too), sglang's full mark cleared
    assert released == [True] and idle.running_batch.batch_is_full is False
    (abort,) = aborted
    assert abort.rid == "m" and abort.finished_reason["status_code"] == 409
    assert abort.finished_reason["err_type"] == MISS_ERR_TYPE and abort.finished_reason[MISS_TOKENS] == 42
    assert "first 42 tokens" in abort.finished_reason["message"]
    assert getattr(marked, REFUSAL_ATTR) is None  # aborted once
    busy = SimpleNamespace(batch_to_run="batch", running_batch=SimpleNamespace(is_empty=lambda: True))
    abort_refused(lambda sch, running: busy, scheduler, None)
    assert released == [True] and len(aborted) == 1  # a batch was admitted: holds stay; nothing more to abort
    # idle with nothing to release: a deferred request would wait forever, so it is not deferred again
    from kvsteward.serve.sglang.refusal import NO_DEFER_ATTR

    stalled = SimpleNamespace(batch_to_run=None, running_batch=SimpleNamespace(is_empty=lambda: True,
                                                                              batch_is_full=True))
    scheduler = SimpleNamespace(waiting_queue=[deferred], abort_request=aborted.append,
                                tree_cache=SimpleNamespace(release_holds=lambda taken: 0))
    abort_refused(lambda sch, running: stalled, scheduler, None)
    assert getattr(deferred, NO_DEFER_ATTR) is True and stalled.running_batch.batch_is_full is False


def test_the_client_rebuilds_each_lost_state_then_resends():
    """`generate_exact` against a server that holds a set of sealed states: each refusal names the missing pre-op
    state, whose request (the messages through it, the ops before it, full form) goes first; the original goes last.
    Two lost states: two refusals, resolved innermost first. A state named off a message boundary is an error; past
    `max_refusals` the request goes with `miss: "reprefill"`."""
    from kvsteward.serve.sglang.ops import MISS_ERR_TYPE, MISS_TOKENS, SglangHistory, generate_exact, parse_spec

    messages = [A, B, C, D, E, A]
    cache = {"drop": {"2": [1], "4": [3]}}
    held: set[int] = set()  # logical lengths of the pre-op states the fake server holds
    sent = []

    def send(body, n):
        spec = json.loads(body["sampling_params"]["custom_params"]["kvsteward"])
        hist = parse_spec(spec, None)
        sent.append((sum(len(m) for m in spec["messages"]), n))
        for need in (len(A + B + C), len(A + B + C + D + E)):  # pre-op states of the ops at 2 and 4
            if need < sum(len(m) for m in spec["messages"]) and need not in held:
                if spec.get("miss") == "refuse":
                    return {"output_ids": [], "meta_info": {"finish_reason": {
                        "type": "abort", "err_type": MISS_ERR_TYPE, MISS_TOKENS: need}}}
                return {"output_ids": [9], "meta_info": {"finish_reason": {"type": "length"}}}
        held.add(sum(len(m) for m in spec["messages"]))
        return {"output_ids": list(hist.physical_ids[:n]), "meta_info": {"finish_reason": {"type": "length"}}}

    history = SglangHistory(miss="refuse")
    body = history.fields(messages, cache)
    out, refusals = generate_exact(send, history, body, messages, cache, 4)
    total = sum(len(m) for m in messages)
    assert refusals == 2 and out["output_ids"] == list(parse_spec(json.loads(
        body["sampling_params"]["custom_params"]["kvsteward"]), None).physical_ids[:4])
    assert sent == [(total, 4), (len(A + B + C), 1), (total, 4), (len(A + B + C + D + E), 1), (total, 4)]
    seal = history.pre_op_fields(messages, cache, len(A + B + C + D + E))
    spec = json.loads(seal["sampling_params"]["custom_params"]["kvsteward"])
    assert len(spec["messages"]) == 5 and spec["cache"] == {"drop": {"2": [1]}, "reposition": []}
    assert spec["miss"] == "refuse" and spec["hold"] == "always"  # a rebuild is held past the hold budget
    with pytest.raises(OpsError, match="no message boundary"):
        history.pre_op_fields(messages, cache, len(A) + 1)
    held.clear()
    sent.clear()
    out, refusals = generate_exact(send, history, body, messages, cache, 4, max_refusals=0)
    assert refusals == 1 and out["output_ids"] == [9] and len(sent) == 2


def test_the_manager_s_fork_rebuilds_a_lost_state_before_it_decides(monkeypatch):
    """`SglangManager.decide` with a history that refuses a lost pre-op state: the refusal is not read as a decision
    (it has no output); the main's state is rebuilt (the base model's request: no adapter, held, 1 token), the fork
    is sent again unchanged, and its list is the decision. Past `max_refusals` the fork keeps its adapter, logit
    processor and sampling fields (only its history goes in the full form with `miss: "reprefill"`)."""
    import requests
    from transformers import AutoTokenizer

    from kvsteward.models import resolve
    from kvsteward.serve.manager.decode import _candidates
    from kvsteward.serve.sglang.manager import AUX_FIELD, SglangManager
    from kvsteward.serve.sglang.ops import MISS_ERR_TYPE, MISS_TOKENS, SglangHistory, generate_exact
    from kvsteward.synth.chat import message_token_ids

    loads, dumps = json.loads, json.dumps

    tok = AutoTokenizer.from_pretrained(resolve("smollm2"))
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find ticket 7."},
            {"role": "assistant", "content": "Searching."}, {"role": "tool", "content": "[cursor 3] ticket 7: x"},
            {"role": "assistant", "content": "Next."}, {"role": "tool", "content": "[cursor 5] roster: Ann"},
            {"role": "assistant", "content": "Done."}, {"role": "tool", "content": "[cursor 7] log: ok"}]
    ids = message_token_ids(tok, msgs)
    cache = {"drop": {"5": [3]}}  # the main dropped cursor 3's response after message 5
    pre_op = sum(len(m) for m in ids[:6])
    cand, texts = _candidates(tok)
    reply = [cand[texts.index(x)] for x in ("5", "]", "}")] + [tok.eos_token_id]  # {"del_cursors": [5]}
    sent, lost = [], [True]

    def post(url, json, timeout):  # noqa: A002 - requests' own keyword
        body, spec = json, loads(json["sampling_params"]["custom_params"]["kvsteward"])
        sent.append(body)
        out = {"output_ids": reply, "meta_info": {"finish_reason": {"type": "stop"}}}
        if lost[0] and spec.get("miss") == "refuse" and "lora_path" in body:
            out = {"output_ids": [], "meta_info": {"finish_reason": {
                "type": "abort", "err_type": MISS_ERR_TYPE, MISS_TOKENS: pre_op}}}
        elif "lora_path" not in body:  # the rebuild
            lost[0] = False
        resp = requests.models.Response()
        resp.status_code, resp._content = 200, dumps(out).encode()
        return resp

    monkeypatch.setattr(requests, "post", post)
    mgr = SglangManager(tok, lora="mgr")
    history = SglangHistory(miss="refuse")
    history.fields(ids, cache)  # the main's request: the fork continues its base
    decision = mgr.decide("http://fake", history, msgs, ids, cache, [3, 5, 7])
    assert decision.del_cursors == [5] and mgr.refusals == 1 and len(sent) == 3
    assert sent[0] == sent[2] and sent[0]["lora_path"] == "mgr" and "custom_logit_processor" in sent[0]
    rebuild = json.loads(sent[1]["sampling_params"]["custom_params"]["kvsteward"])
    assert "lora_path" not in sent[1] and sent[1]["sampling_params"]["max_new_tokens"] == 1
    assert rebuild["hold"] == "always" and len(rebuild["messages"]) == 6 and rebuild["cache"]["drop"] == {}

    # the fallback keeps every field but the history's
    fork = mgr.fork_body(history, msgs, ids, cache, [3, 5, 7])
    fork_msgs = [*ids, mgr.trigger_ids(msgs, [3, 5, 7])]
    lost[0], sent[:] = True, []

    def send(body, n):
        return post("http://fake", body, 1).json()

    out, refusals = generate_exact(send, history, fork, fork_msgs, cache, mgr.max_tokens + 1, max_refusals=0)
    last = sent[-1]
    spec = json.loads(last["sampling_params"]["custom_params"]["kvsteward"])
    assert refusals == 1 and spec["miss"] == "reprefill" and "base" not in spec
    assert last["lora_path"] == "mgr" and last["custom_logit_processor"] == fork["custom_logit_processor"]
    assert last["sampling_params"]["custom_params"][AUX_FIELD] == fork["sampling_params"]["custom_params"][AUX_FIELD]
    assert last["input_ids"] == fork["input_ids"]
