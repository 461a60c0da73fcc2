"""Models whose layers rotate differently (issue 44.1): SmolLM3 skips RoPE in its `no_rope_layers`, Gemma3's local
(sliding) layers use other frequencies than its global ones.

The engine probes every layer (`detect_model_rope`); here the truth is transformers' own `DynamicCache` driven by the
float64 reference (`ReferenceSession`), with each layer's rotation read independently of the probe: which layers
rotate from the config (`no_rope_layers`, `layer_types`), their frequencies from the model's own rotary buffers.
Before the per-layer spec, the engine re-rotated SmolLM3's no-RoPE keys too and refused Gemma3.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, SmolLM3Config, SmolLM3ForCausalLM

from kvsteward.kernels.rope import ModelRope, UnsupportedRope, config_model_rope, detect_model_rope, rope_spec
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.session import CacheOpError

torch.set_num_threads(1)
_IDS = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 48


def smollm3(seed: int = 0) -> SmolLM3ForCausalLM:
    torch.manual_seed(seed)
    config = SmolLM3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=2048, **_IDS)
    return SmolLM3ForCausalLM(config).eval()


def gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              max_position_embeddings=2048, **_IDS)
    return Gemma3ForCausalLM(config).eval()


def _rotary(model):
    return next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))


def independent_reference(model) -> ReferenceSession:
    """A reference whose per-layer rotation comes from the config and the model's own rotary buffers (not the
    engine's probe): no RoPE where `no_rope_layers` says 0, each Gemma3 layer its type's frequencies."""
    config, rotary = model.config, _rotary(model)
    freqs = []
    for i in range(config.num_hidden_layers):
        if getattr(config, "no_rope_layers", None) is not None and not config.no_rope_layers[i]:
            freqs.append(None)
        elif getattr(config, "layer_types", None) and hasattr(rotary, f"{config.layer_types[i]}_inv_freq"):
            freqs.append(getattr(rotary, f"{config.layer_types[i]}_inv_freq").double())
        else:
            freqs.append(rotary.inv_freq.double())
    return ReferenceSession(model, freqs)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _random_ops(engine: Engine, seed: int, max_tokens: int) -> float:
    """A random sequence of append / drop / reposition (and refresh) on the engine and on the reference; the largest
    logit difference over every append."""
    rng = random.Random(seed)
    s, ref = engine.session("full", chunk=7), independent_reference(engine.model)
    worst = 0.0
    x = _tokens(rng, rng.randint(6, 12))
    worst = max(worst, (s.append(x, logits="all") - ref.append(x)).abs().max().item())
    for _ in range(6):
        op = rng.choice(["append", "drop", "reposition", "refresh", "drop"])
        alive = [int(i) for i in s.resident_logical()]
        if op == "drop" and len(alive) > 2:
            gone = sorted(rng.sample(alive, rng.randint(1, len(alive) // 2)))
            s.drop(gone)
            ref.drop(gone)
        elif op == "reposition":
            s.reposition()
            ref.reposition()
        elif op == "refresh":
            s.refresh()
            ref.refresh()
        n = rng.randint(1, 6)
        if s.resident + n > max_tokens:
            break
        y = _tokens(rng, n)
        worst = max(worst, (s.append(y, logits="all") - ref.append(y)).abs().max().item())
    return worst


# ------------------------------------------------------------------------------------------------ the probe

def test_smollm3_probe_finds_no_rope_exactly_at_its_no_rope_layers():
    model = smollm3()
    rope = detect_model_rope(model)
    flags = model.config.no_rope_layers
    assert 0 in flags and 1 in flags  # the default interval: every 4th layer skips RoPE
    assert [s is None for s in rope.layers] == [not f for f in flags]
    (spec,) = rope.specs  # the RoPE layers share one spec object: cos/sin are evaluated once per move
    torch.testing.assert_close(spec.inv_freq.float(), _rotary(model).inv_freq, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rotate differently"):
        rope.single  # noqa: B018


def test_gemma3_probe_gives_local_and_global_layers_their_own_frequencies():
    model = gemma3()
    rope, rotary, types = detect_model_rope(model), _rotary(model), model.config.layer_types
    assert set(types) == {"sliding_attention", "full_attention"}
    assert len(rope.specs) == 2
    for layer, layer_type in enumerate(types):
        own = getattr(rotary, f"{layer_type}_inv_freq")
        torch.testing.assert_close(rope[layer].inv_freq.float(), own, rtol=1e-6, atol=0)
    assert not torch.allclose(rope.specs[0].inv_freq, rope.specs[1].inv_freq)
    # the config alone (what the SGLang backend reads) gives the same per-layer specs
    from_config = config_model_rope(model.config)
    for a, b in zip(from_config.layers, rope.layers, strict=True):
        assert torch.equal(a.inv_freq, b.inv_freq) and (a.layout, a.rotary_dim) == (b.layout, b.rotary_dim)


def test_a_layer_no_spec_reproduces_is_refused_naming_the_layer(monkeypatch):
    from transformers.models.smollm3 import modeling_smollm3

    own = modeling_smollm3.apply_rotary_pos_emb

    def doubled(q, k, cos, sin, *args, **kwargs):  # rotates by twice the angle: no static spec is this
        cos2, sin2 = cos * cos - sin * sin, 2 * sin * cos
        return own(q, k, cos2, sin2, *args, **kwargs)

    monkeypatch.setattr(modeling_smollm3, "apply_rotary_pos_emb", doubled)
    with pytest.raises(UnsupportedRope, match=r"smollm3 .*at layer 0 no exact re-rotation"):
        Engine(smollm3())


# ----------------------------------------------------------------------------------- end to end: the engine

@pytest.mark.parametrize("seed", range(12))
def test_smollm3_random_ops_equal_hfs_own_cache(seed):
    engine = Engine(smollm3(seed % 3))
    assert _random_ops(engine, seed, max_tokens=200) < 2e-5


def test_the_old_uniform_spec_moves_smollm3s_no_rope_keys_and_misses():
    """The engine's former single spec (layer 0's, applied to every layer) on the same check: far off."""
    engine = Engine(smollm3())
    engine.rope = ModelRope.uniform(rope_spec(engine.model.config), engine.n_layers)
    s, ref = engine.session("full"), independent_reference(engine.model)
    x = list(range(11, 40))
    s.append(x)
    ref.append(x)
    s.drop([1, 2, 5, 9])
    ref.drop([1, 2, 5, 9])
    s.reposition()
    ref.reposition()
    assert (s.append([99, 98], logits="all") - ref.append([99, 98])).abs().max().item() > 1e-3


@pytest.mark.parametrize("seed", range(8))
def test_gemma3_random_ops_equal_hfs_own_cache_within_the_window(seed):
    engine = Engine(gemma3(seed % 2))
    assert (engine.sliding_window, engine.sliding_window_layer) == (WINDOW, 0)
    assert _random_ops(engine, seed, max_tokens=WINDOW) < 2e-5


def test_gemma3_forwards_beyond_the_sliding_window_are_refused_before_any_work():
    engine = Engine(gemma3())
    s = engine.session("full")
    s.append(list(range(3, 43)))
    history, n = list(s.history), s.n_logical
    with pytest.raises(CacheOpError, match=rf"sliding window of {WINDOW} tokens of layer 0"):
        s.append(list(range(3, 13)))
    assert s.history == history and s.n_logical == n  # nothing applied
    with pytest.raises(CacheOpError, match="sliding window"):
        s.generate(WINDOW)
    with pytest.raises(CacheOpError, match=r"budget \+ chunk = 40 \+ 16"):
        engine.session("h2o", budget=40, chunk=16)
    bounded = engine.session("h2o", budget=32, chunk=16)  # resident stays within the window: runs past it
    bounded.append(list(range(3, 3 + 3 * WINDOW)))
    assert bounded.resident <= 32 and bounded.n_logical == 3 * WINDOW


# ------------------------------------------------------------------------------ the SGLang tree's position hook

def test_sglang_position_versions_keep_no_rope_keys_and_rotate_the_rest(monkeypatch):
    """The tree's factory reads per-layer specs from the served config; a reposition's position version (the tree's
    re-rotation into new slots) on SGLang's own KV pool equals the float64 truth layer by layer: SmolLM3's no-RoPE
    layers copy K, its RoPE layers rotate it."""
    from types import SimpleNamespace

    from kvsteward.serve.sglang.compat import prepare_sglang

    prepare_sglang()
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from kvsteward.kernels.rope import apply_rope
    from kvsteward.serve.sglang.pool import position_version
    from kvsteward.serve.sglang.tree import create_tree_cache

    config = smollm3().config
    layers, heads, head_dim, size = config.num_hidden_layers, 2, 16, 64
    pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=heads, head_dim=head_dim,
                            layer_num=layers, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)
    ctx = SimpleNamespace(params=CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 64, "cpu", False),
                                                 token_to_kv_pool_allocator=alloc, page_size=1),
                          enable_hierarchical_cache=False, is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False,
                          model_config=SimpleNamespace(hf_config=config))
    monkeypatch.delenv("KVSTEWARD_ROPE_LAYOUT", raising=False)
    assert create_tree_cache(ctx).rope is None  # sglang 0.5.21 has no SmolLM3: unverified, repositions re-prefill
    monkeypatch.setenv("KVSTEWARD_ROPE_LAYOUT", "split_half")
    tree = create_tree_cache(ctx)
    assert [s is None for s in tree.rope.layers] == [not f for f in config.no_rope_layers]

    spec = rope_spec(config)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(layers, 10, heads, head_dim, generator=gen, dtype=torch.float64)
    old = torch.tensor([0, 1, 4, 5, 6, 9, 13, 14, 20, 21])
    slots = alloc.alloc(10)

    def truth(layer: int, positions: torch.Tensor) -> torch.Tensor:
        if not config.no_rope_layers[layer]:
            return raw[layer]
        return apply_rope(raw[layer].transpose(0, 1), positions, spec).transpose(0, 1)

    for layer in range(layers):
        pool.k_buffer[layer][slots] = truth(layer, old).float()
    new = position_version(pool, alloc, slots, old, tree.rope)
    for layer in range(layers):
        got = pool.k_buffer[layer][new].double()
        torch.testing.assert_close(got, truth(layer, torch.arange(10)), rtol=0, atol=2e-6)
        if not config.no_rope_layers[layer]:
            assert torch.equal(pool.k_buffer[layer][new], pool.k_buffer[layer][slots])


def test_sglang_gemma3_config_gives_each_layer_type_its_spec_and_the_swa_hybrid_is_refused():
    from types import SimpleNamespace

    from kvsteward.serve.sglang.tree import create_tree_cache

    config = gemma3().config
    rope = config_model_rope(config)
    for layer, layer_type in enumerate(config.layer_types):
        assert torch.equal(rope[layer].inv_freq, rope_spec(config, layer_type=layer_type).inv_freq)
    with pytest.raises(ValueError, match="no SWA"):
        create_tree_cache(SimpleNamespace(enable_hierarchical_cache=False, is_hybrid_swa=True, is_hybrid_ssm=False,
                                          is_dsa=False))
