"""Exactness checks and speed benchmarks of the engine on a real model (behind `steward engine check` / `bench`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.reference import ReferenceSession

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
    """Max |Δlogit| of drop, drop+reposition and drop+refresh vs the reference replay on transformers' own cache."""
    x, y = _tokens(n, engine.vocab_size, seed), _tokens(16, engine.vocab_size, seed + 1)
    victims = list(range(3, n, 5))
    out = {}
    for name in ("drop", "reposition", "refresh"):
        s = engine.session("full", chunk=128)
        ref = ReferenceSession.with_rope(engine.model, engine.rope)
        for sess in (s, ref):
            sess.append(x)
            sess.drop(victims)
            if name != "drop":
                getattr(sess, name)()
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
    from kvsteward.serve.engine.restore import restore

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

    from kvsteward.serve.engine.tiers import DiskTier, HostTier, TieredStore, ValkeyTier, snapshot

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


def _median_time(fn: Callable, setup: Callable, repeats: int) -> float:
    """Median wall time of `fn(setup())` over `repeats` runs; the setup is not timed."""
    import statistics

    times = []
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter()
        fn(state)
        times.append(time.perf_counter() - t0)
        del state
    return statistics.median(times)


def bench_fork(engine: Engine, resident: int = 1536, chunk: int = 512, repeats: int = 5) -> dict:
    """What forking costs the parent (the aux thread's fork, inside a main turn), same run: a copy fork vs a shared
    fork (`fork(shared=True)`: no K/V copied), and the parent's next decode step with no fork vs with a live shared
    fork, for a `full` session (the server's default: nothing is compacted) and an `h2o` session at its budget (the
    step evicts one slot, so it compacts into fresh buffers: copy-on-write). Medians."""
    def timed(fn, setup=lambda: None) -> float:
        return _median_time(fn, setup, repeats)

    def costs(s) -> dict:
        def with_reader():
            parent = s.fork()
            return parent, parent.fork(shared=True)

        return {"resident": s.resident, "kv_bytes": s.table.kv_bytes(),
                "copy_fork_s": timed(lambda _: s.fork()), "shared_fork_s": timed(lambda _: s.fork(shared=True)),
                "decode_step_s": timed(lambda p: p[0].generate(1), lambda: (s.fork(),)),
                "decode_step_with_shared_fork_s": timed(lambda p: p[0].generate(1), with_reader)}

    full = engine.session("full", chunk=chunk)
    full.append(_tokens(resident, engine.vocab_size, 5))
    h2o = engine.session("h2o", budget=resident, chunk=chunk)
    h2o.append(_tokens(resident + 64, engine.vocab_size, 5))
    return {"full": costs(full), "h2o": costs(h2o)}


def bench_refresh(engine: Engine, sizes: tuple[int, ...] = (512, 1024, 2048), chunk: int = 512, repeats: int = 3,
                  progress: Progress | None = None) -> list[dict]:
    """What a refresh costs, same run, per resident size r: `Session.refresh()` on an h2o session at budget r that
    has evicted (2r tokens seen), the tail refresh of the same state (`refresh(tail=True)`: only rows past the fresh
    prefix; how many it re-encoded is in `tail_tokens`, set by where this session's first eviction fell), the
    engine's prefill of r tokens into a new session, and the model's own transformers forward over r tokens (no
    cache). Medians of `repeats`; each refresh runs on a fresh copy fork (the fork is not timed)."""
    def timed(fn, setup=lambda: None) -> float:
        return _median_time(fn, setup, repeats)

    rows = []
    for r in sizes:
        toks = _tokens(2 * r, engine.vocab_size, r)
        s = engine.session("h2o", budget=r, chunk=chunk)
        for start in range(0, 2 * r, chunk):
            s.append(toks[start:start + chunk], kind="tool" if start % (2 * chunk) else "user", logits=None)
        probe = s.fork()
        probe.refresh(tail=True)
        tail_tokens = probe.refresh_tokens
        x = torch.tensor([toks[:r]])

        def hf(_, x: torch.Tensor = x) -> None:
            with torch.inference_mode():
                engine.model(input_ids=x, use_cache=False, logits_to_keep=1)

        head = toks[:r]

        row = {"r": s.resident, "fresh_rows": s.fresh_rows, "tail_tokens": tail_tokens,
               "refresh_s": timed(lambda f: f.refresh(), s.fork),
               "refresh_tail_s": timed(lambda f: f.refresh(tail=True), s.fork),
               "engine_prefill_s": timed(lambda f, head=head: f.append(head, logits=None),
                                         lambda: engine.session("full", chunk=chunk)),
               "hf_forward_s": timed(hf)}
        row["refresh_tok_s"] = row["r"] / row["refresh_s"]
        row["hf_forward_tok_s"] = row["r"] / row["hf_forward_s"]
        row["refresh_over_hf"] = row["refresh_s"] / row["hf_forward_s"]
        row["tail_over_full"] = row["refresh_tail_s"] / row["refresh_s"]
        rows.append(row)
        if progress:
            progress(f"r={r}: refresh {row['refresh_s']:.3f} s ({row['refresh_tok_s']:.0f} tok/s), tail "
                     f"{row['refresh_tail_s']:.3f} s ({tail_tokens} tokens), HF forward {row['hf_forward_s']:.3f} s")
    return rows


def bench_rehydrate(engine: Engine, span_tokens: int = 440, filler_messages: int = 6, budget: int = 512,
                    chunk: int = 512, limit: int = 2048, disk_dir: str | None = None, valkey_url: str | None = None,
                    repeats: int = 3) -> dict:
    """Tiered rehydration cost per tier, same run: a pace-tiered session with two planned spans that do not fit B
    together (span A read at the last step, span B at a middle one), so A is spilled and comes back at its reader.
    Reports the rehydration time (fetch, eviction to make room, re-insert) per tier and the reader step's forward
    (with the renumber that follows) for scale; the sessions in every tier must end in the same state (equal
    history keys)."""
    import tempfile

    from kvsteward.serve.engine.spill import SpillStore
    from kvsteward.serve.engine.tiers import DiskTier, HostTier, ValkeyTier

    msgs = [_tokens(span_tokens, engine.vocab_size, 11), _tokens(span_tokens, engine.vocab_size, 12)]
    msgs += [_tokens(chunk, engine.vocab_size, 20 + i) for i in range(filler_messages)] + [[7, 8, 9]]
    last = len(msgs) - 1
    blueprint = [{"span": [0, span_tokens], "readers": [last]},
                 {"span": [span_tokens, 2 * span_tokens], "readers": [2 + filler_messages // 2]}]
    tiers = [HostTier(), DiskTier(disk_dir or tempfile.mkdtemp(prefix="kvsteward-spill-"))]
    if valkey_url:
        tiers.append(ValkeyTier(valkey_url, prefix="kvsteward:spill:"))
    out: dict = {"span_tokens": span_tokens, "budget": budget, "limit": limit}
    keys = set()
    default = engine.spill
    for tier in tiers:
        best, forward = float("inf"), float("inf")
        for _ in range(repeats):
            seen: list[tuple[float, int]] = []
            store = SpillStore(tier, on_fetch=lambda name, sec, n, seen=seen: seen.append((sec, n)))
            engine.spill = store
            s = engine.session("pace-tiered", budget=budget, chunk=chunk, limit=limit, blueprint=blueprint)
            for m in msgs[:-1]:
                s.append(m, logits=None)
            out["spilled_bytes"] = store.stats.bytes_held
            t0 = time.perf_counter()
            s.append(msgs[-1], logits="last")
            step = time.perf_counter() - t0
            if not seen:
                raise RuntimeError("span A was never rehydrated: raise span_tokens or lower the budget")
            best = min(best, seen[0][0])
            forward = min(forward, step - seen[0][0])
            out["rehydrated_tokens"] = seen[0][1]
            keys.add(s.history_key())
        out[f"{tier.name}_s"] = best
        out[f"{tier.name}_step_forward_s"] = forward
    engine.spill = default  # the engine's own store again: the bench's stores were for its sessions only
    if len(keys) != 1:
        raise RuntimeError("the tiers ended in different states")
    return out


def bench_aux(engine: Engine, turns: int = 12, every: int = 2, gap: float = 0.5, max_tokens: int = 16,
              aux_max_tokens: int = 24, use_adapter: bool | None = None, seed: int = 0, data_dir: str | None = None,
              progress: Progress | None = None, min_confidence: float | None = None) -> dict:
    """Main-turn latency with the aux thread on vs off, side by side in one run (target ratio <= 1.05).

    Two persistent-session stores share the engine and its scheduler: ON runs the aux thread after every `every`-th
    tool response (forked inside the turn, before the reply: that fork is the aux's only cost to a main turn,
    reported as `aux_fork_*`), OFF has none. Both play the same synthesized agent trace (turn 0: system + question;
    turn k: the k-th tool response; every turn generates a `max_tokens` reply). ON turns run exactly as in
    the server: the aux decodes during the agent's tool time (`gap` seconds after every round) and is preempted if a
    turn arrives mid-decode. OFF turns start only after the aux worker has stopped at a step boundary (not timed),
    so they see no aux work at all, and they get the aux drops of the ON session as client cache ops at the same
    boundary, so both sessions hold the same state turn after turn (checked: equal history keys)."""
    import statistics
    import tempfile
    from pathlib import Path

    from kvsteward.serve.engine.ops import SessionSpec
    from kvsteward.serve.manager.worker import AuxConfig, Scheduler
    from kvsteward.serve.server.completions import ServeLimits
    from kvsteward.serve.server.metrics import Metrics
    from kvsteward.serve.server.store import SessionStore
    from kvsteward.synth.traces.generate import generate_traces

    use_adapter = engine.is_peft if use_adapter is None else use_adapter
    root = Path(data_dir or tempfile.mkdtemp(prefix="kvsteward-bench-aux-"))
    sched = Scheduler()
    stores = {}
    for name in ("on", "off"):
        aux = AuxConfig(every=every, max_tokens=aux_max_tokens, use_adapter=use_adapter,
                        min_confidence=min_confidence) if name == "on" else None
        stores[name] = SessionStore(root / name, engine, SessionSpec(), sched, Metrics(), 1 << 40,
                                    ServeLimits(max_tokens, max_tokens), aux=aux)
    on, off = stores["on"], stores["off"]
    msgs: list[dict] = []
    for t in generate_traces(8, seed):
        msgs = t.messages
        if sum(m["role"] == "tool" for m in msgs) + 1 >= turns:
            break
    tools = [m for m in msgs if m["role"] == "tool"]
    bodies = [[m for m in msgs[:2]]] + [[m] for m in tools][: turns - 1]
    sids = {name: s.create({}).id for name, s in stores.items()}
    lat: dict[str, list[float]] = {"on": [], "off": []}
    identical, n_off = True, 0
    try:
        for k, new in enumerate(bodies):
            t0 = time.perf_counter()
            r_on = on.run_turn(sids["on"], {"messages": new, "max_tokens": max_tokens})
            lat["on"].append(time.perf_counter() - t0)
            time.sleep(gap / 2)  # half of the agent's tool time: the aux thread runs here
            body = {"messages": new, "max_tokens": max_tokens}
            dropped = (r_on.get("aux") or {}).get("dropped") or []
            if dropped:  # the same drop, as a client cache op at the same boundary: the same engine op
                body["cache"] = {"drop": {str(n_off - 1): dropped}}
            with sched.main():  # the aux stops at its next step boundary; not timed
                sched.quiesce()
                t0 = time.perf_counter()
                r_off = off.run_turn(sids["off"], body)
                lat["off"].append(time.perf_counter() - t0)
            n_off = r_off["n_messages"]
            identical = identical and r_on["history_key"] == r_off["history_key"]
            if progress:
                progress(f"turn {k + 1}/{len(bodies)}: on {lat['on'][-1]:.2f}s, off {lat['off'][-1]:.2f}s, "
                         f"aux decisions {on.metrics.aux_decisions._value.get():.0f}, dropped {dropped}")
            time.sleep(gap / 2)
        on.worker.wait_idle(timeout=120)
    finally:
        on.close()
    m = on.metrics
    mean_on, mean_off = statistics.fmean(lat["on"]), statistics.fmean(lat["off"])
    return {"main_latency_ratio_on_over_off": mean_on / mean_off,
            "median_turn_ratio_on_over_off": statistics.median(a / b for a, b in zip(lat["on"], lat["off"],
                                                                                       strict=True)),
            "mean_main_turn_s_on": mean_on, "mean_main_turn_s_off": mean_off,
            "max_main_turn_delay_s": max(a - b for a, b in zip(lat["on"], lat["off"], strict=True)),
            "turns": len(bodies), "every": every, "gap_s": gap, "max_tokens": max_tokens,
            "aux_max_tokens": aux_max_tokens, "aux_use_adapter": use_adapter, "aux_min_confidence": min_confidence,
            "aux_decisions": int(m.aux_decisions._value.get()), "aux_deleted_cursors": int(m.aux_deleted._value.get()),
            "aux_preemptions": int(m.aux_preemptions._value.get()),
            "aux_mean_s": m.aux_seconds._sum.get() / max(1.0, m.aux_decisions._value.get()),
            "aux_errors": int(m.aux_errors._value.get()), "identical_sessions": identical,
            "aux_forks": on.aux_forks, "aux_fork_mean_s": on.aux_fork_seconds / max(1, on.aux_forks),
            "aux_fork_max_s": on.aux_fork_seconds_max,
            "final_tokens": on._records[sids["on"]].session.n_logical,
            "final_resident_on": on._records[sids["on"]].session.resident}


def bench_throughput(engines: dict[str, Engine], arms: tuple[str, ...] = ("pace-refresh", "positions-only"),
                     tokens: int = 8192, budget: int = 1024, limit: int = 2048, chunk: int = 512, repeats: int = 2,
                     progress: Progress | None = None) -> dict:
    """Prefill tokens/s of a bounded session per arm and weight dtype, same run: `engines` maps a dtype name to the
    engine loaded in it; each repeat plays every (dtype, arm) once, in an order that alternates between repeats
    (machines are noisy). One chunk is appended untimed first (warm-up), then `tokens` more are timed. No plan: a
    foresight arm keeps its recent window, so this is the cost of the forward, the scoring and the bounded positions
    (renumbers), not of refreshes. Returns per (dtype, arm) the median tokens/s and the minutes 1M tokens would take
    at that rate, and per arm each dtype's speed-up over the first."""
    cells = [(d, a) for d in engines for a in arms]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    vocab = min(e.vocab_size for e in engines.values())
    toks = _tokens(chunk + tokens, vocab, 11)
    for rep in range(repeats):
        for dtype, arm in (cells if rep % 2 == 0 else cells[::-1]):
            s = engines[dtype].session(arm, budget=budget, limit=limit, chunk=chunk)
            s.append(toks[:chunk], logits=None)
            t0 = time.perf_counter()
            s.append(toks[chunk:], logits=None)
            times[(dtype, arm)].append(time.perf_counter() - t0)
            if progress:
                progress(f"repeat {rep + 1}: {dtype} {arm}: {tokens / times[(dtype, arm)][-1]:.0f} tok/s")
    rows = {}
    for dtype, arm in cells:
        tok_s = tokens / sorted(times[(dtype, arm)])[len(times[(dtype, arm)]) // 2]
        rows.setdefault(dtype, {})[arm] = {"tok_s": tok_s, "minutes_per_1m_tokens": 1e6 / tok_s / 60}
    first = next(iter(engines))
    speedup = {d: {a: rows[d][a]["tok_s"] / rows[first][a]["tok_s"] for a in arms} for d in engines if d != first}
    return {"tokens": tokens, "budget": budget, "limit": limit, "chunk": chunk, "repeats": repeats,
            "threads": torch.get_num_threads(), "tok_s": rows, f"speedup_over_{first}": speedup}
