"""Exactness checks and speed benchmarks of the engine on a real model (behind `steward engine check` / `bench`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvsteward.serve.engine import Engine
from kvsteward.serve.reference import ReferenceSession

Progress = Callable[[str], None]


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    # Skip the first 100 ids (special/control tokens in most vocabularies) so random text stays ordinary text.
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate_equivalence(engine: Engine, prompt: list[int], new_tokens: int = 32) -> bool:
    """`full` engine greedy == transformers generate() greedy, token for token (both stop at the model's EOS)."""
    s = engine.session("full", chunk=64)
    s.append(prompt)
    got = s.generate(new_tokens, stop_ids=engine.eos_ids)
    with torch.no_grad():
        want = engine.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                     do_sample=False)[0, len(prompt):].tolist()
    return got == want


def op_logit_errors(engine: Engine, n: int = 256, seed: int = 0) -> dict[str, float]:
    """Max |Δlogit| of drop and drop+reposition vs the reference replay on transformers' own cache."""
    x, y = _tokens(n, engine.vocab_size, seed), _tokens(16, engine.vocab_size, seed + 1)
    victims = list(range(3, n, 5))
    out = {}
    for name, repos in (("drop", False), ("reposition", True)):
        s = engine.session("full", chunk=128)
        ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
        for sess in (s, ref):
            sess.append(x)
            sess.drop(victims)
            if repos:
                sess.reposition()
        out[name] = float((s.append(y, logits="all") - ref.append(y)).abs().max())
    return out


def budget_run(engine: Engine, tokens: int, budget: int, chunk: int, policy: str = "h2o",
               progress: Progress | None = None) -> dict:
    """Play `tokens` random tokens through a budgeted session; report the peak resident slots and KV bytes."""
    s = engine.session(policy, budget=budget, chunk=chunk)
    step = 1024
    for start in range(0, tokens, step):
        s.append(_tokens(min(step, tokens - start), engine.vocab_size, start))
        if progress:
            progress(f"budget run {s.n_logical}/{tokens} tokens, resident {s.resident}")
    return {"budget_peak_slots": s.peak_resident, "budget": budget, "chunk": chunk, "budget_tokens": tokens,
            "resident_kv_bytes": s.table.kv_bytes()}


def bench_rerotate(engine: Engine, sizes: tuple[int, ...] = (512, 2048, 8192), repeats: int = 3,
                   progress: Progress | None = None) -> list[dict]:
    """Time to reposition r resident tokens vs time to re-prefill the same r tokens, measured in the same run."""
    rows = []
    for r in sizes:
        toks = _tokens(r + 1, engine.vocab_size, r)
        s = engine.session("full", chunk=512)
        t0 = time.perf_counter()
        s.append(toks)
        prefill_s = time.perf_counter() - t0
        s.drop([r // 2])  # a gap, so every later slot really moves
        times = []
        for _ in range(repeats):
            fork = s.fork()
            t0 = time.perf_counter()
            fork.reposition()
            times.append(time.perf_counter() - t0)
        rerotate_s = min(times)
        rows.append({"r": r, "prefill_s": prefill_s, "rerotate_s": rerotate_s,
                     "ratio_prefill_over_rerotate": prefill_s / rerotate_s})
        if progress:
            progress(f"r={r}: prefill {prefill_s:.2f}s, reposition {rerotate_s * 1e3:.1f}ms")
    return rows


def bench_overhead(engine: Engine, tokens: int = 32768, budget: int = 512, chunk: int = 512, limit: int = 2048,
                   progress: Progress | None = None) -> dict:
    """Wall time of `pace` over `h2o` on the same session, in one run (arms interleaved chunk by chunk so machine
    noise hits both alike)."""
    toks = _tokens(tokens, engine.vocab_size, 7)
    third = tokens // 3
    blueprint = [{"span": [0, 256], "readers": [2]}, {"span": [third, third + 256], "readers": [2]}]
    arms = {"h2o": engine.session("h2o", budget=budget, chunk=chunk),
            "pace": engine.session("pace", budget=budget, chunk=chunk, limit=limit, blueprint=blueprint)}
    wall = dict.fromkeys(arms, 0.0)
    first = True
    for start in range(0, tokens, chunk):
        piece = toks[start : start + chunk]
        for name, s in arms.items():
            t0 = time.perf_counter()
            s.append(piece, continue_message=not first, logits="last")
            wall[name] += time.perf_counter() - t0
        first = False
        if progress:
            progress(f"overhead {start + len(piece)}/{tokens} tokens")
    return {"tokens": tokens, "budget": budget, "chunk": chunk, "limit": limit,
            "h2o_s": wall["h2o"], "pace_s": wall["pace"], "ratio_pace_over_h2o": wall["pace"] / wall["h2o"],
            "pace_renumbers": arms["pace"].renumbers, "peak_resident": max(s.peak_resident for s in arms.values())}


def replay_sequential(engine: Engine, history: list[dict]) -> torch.Tensor:
    """Re-run a `full`-policy op history op by op on a fresh engine session; returns the final logits."""
    s = engine.session("full", chunk=1 << 30)
    for op in history:
        if op["op"] == "append":
            s.append(op["tokens"], kind=op["kind"], continue_message=bool(s.history) and op["step"] == s.current_step)
        elif op["op"] == "drop":
            s.drop(op["indices"])
        elif op["op"] == "reposition":
            s.reposition()
        else:
            raise ValueError(f"op {op['op']!r} is not replayable without its policy")
    return s.last_logits


def bench_restore(engine: Engine, messages: int = 12, tokens_per_message: int = 256, seed: int = 0,
                  repeats: int = 2, progress: Progress | None = None) -> dict:
    """Restore an agent-style op history (appends, drops of old tool outputs, repositions) by one segment-batch
    forward vs the sequential replay of its ops, same run; both must give the same final logits."""
    from kvsteward.serve.restore import restore

    gen = torch.Generator().manual_seed(seed)
    s = engine.session("full", chunk=1 << 30)
    for m in range(messages):
        s.append(_tokens(tokens_per_message, engine.vocab_size, seed + m), kind="tool" if m % 2 else "user")
        if m % 3 == 2:  # drop half of an older message, then close the gaps
            old = s.resident_logical()
            victims = old[torch.randperm(old.numel(), generator=gen)[: old.numel() // 6]]
            s.drop(sorted(victims.tolist()))
            s.reposition()
    history = s.history
    seq_times, seg_times = [], []
    for _ in range(repeats):  # alternate the two paths so machine noise hits both alike; keep the best of each
        t0 = time.perf_counter()
        seq_logits = replay_sequential(engine, history)
        seq_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restored = restore(engine, s.config, history)
        seg_times.append(time.perf_counter() - t0)
    sequential_s, segment_s = min(seq_times), min(seg_times)
    if progress:
        progress(f"sequential {sequential_s:.2f}s, segment-batch {segment_s:.2f}s")
    return {"ops": len(history), "tokens": s.n_logical, "resident": s.resident, "segment_batch_s": segment_s,
            "sequential_s": sequential_s, "ratio_sequential_over_segment": sequential_s / segment_s,
            "max_abs_logit_diff": float((restored.last_logits - seq_logits).abs().max())}


def bench_tiers(engine: Engine, tokens: int = 4096, budget: int = 512, chunk: int = 512, limit: int = 2048,
                disk_dir: str | None = None, valkey_url: str | None = None, repeats: int = 3) -> dict:
    """Restore time of one bounded session state from each tier (host memory, local disk, Valkey), same run."""
    import tempfile

    from kvsteward.serve.tiers import DiskTier, HostTier, TieredStore, ValkeyTier, snapshot

    s = engine.session("pace", budget=budget, chunk=chunk, limit=limit)
    s.append(_tokens(tokens, engine.vocab_size, 3))
    tiers = [HostTier(), DiskTier(disk_dir or tempfile.mkdtemp(prefix="kvsteward-tier-"))]
    if valkey_url:
        tiers.append(ValkeyTier(valkey_url))
    out = {"tokens": tokens, "resident": s.resident, "bytes": len(snapshot(s))}
    for tier in tiers:
        store = TieredStore([tier])
        store.put("bench", s)
        times = [store.fetch("bench", engine, s.config, promote=False).seconds for _ in range(repeats)]
        out[f"{tier.name}_s"] = min(times)
        tier.delete("bench")
    return out
