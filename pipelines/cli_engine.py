"""`steward engine ...` and `steward bench ...`: exactness checks, the engine demo, speed benchmarks.

JSON results go alone to stdout; progress and tables go to stderr.
"""

from __future__ import annotations

import json
import time

import torch
import typer
from rich.console import Console

engine_app = typer.Typer(no_args_is_help=True)
bench_app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True)

MODEL_HELP = "`smollm2` (embedded), a local HF folder, or a hub id"


def _engine(model: str, dtype: str = "float32"):
    from kvsteward.serve.engine import Engine

    with console.status(f"loading {model} ..."):
        return Engine.load(model, dtype=getattr(torch, dtype))


def _emit(result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        console.print_json(json.dumps(result))


def _progress(msg: str) -> None:
    console.log(msg)


@engine_app.command()
def check(model: str = typer.Option("smollm2", help=MODEL_HELP),
          budget: int = typer.Option(512, help="B for the budget run"),
          chunk: int = typer.Option(256, help="H for the budget run"),
          budget_tokens: int = typer.Option(8192, help="length of the budget run"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Exactness report: generate() equivalence, re-rotation errors per RoPE type/layout, 500-renumber drift,
    drop / reposition vs the reference replay, and the resident-slot bound of a budgeted session."""
    from kvsteward.kernels.check import bf16_rerotation_error, renumber_drift, rerotation_errors
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    t0 = time.perf_counter()
    prompt = checks._tokens(48, eng.vocab_size, 0)
    if eng.tokenizer is not None:
        prompt = eng.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    result = {"model": model, "generate_equivalence": checks.generate_equivalence(eng, prompt)}
    _progress(f"generate equivalence: {result['generate_equivalence']}")
    result["rerotation_max_abs_err"] = rerotation_errors(eng.model.config)
    result["rerotation_bf16_max_ulp"] = bf16_rerotation_error(eng.model.config)
    drift = renumber_drift(eng.model.config, steps=500)
    result["renumber_500_max_abs_err"] = drift["reference_max_abs_err"]
    result["renumber_500_chained_max_abs_err"] = drift["chained_max_abs_err"]
    result["renumber_single_max_abs_err"] = drift["single_renumber_max_abs_err"]
    _progress("re-rotation errors done")
    result["op_max_abs_logit_err"] = checks.op_logit_errors(eng)
    _progress(f"drop / reposition vs reference: {result['op_max_abs_logit_err']}")
    result.update(checks.budget_run(eng, budget_tokens, budget, chunk, progress=_progress))
    result["wall_s"] = time.perf_counter() - t0
    _emit(result, as_json)


@bench_app.command()
def rerotate(model: str = typer.Option("smollm2", help=MODEL_HELP),
             sizes: str = typer.Option("512,2048,8192", help="comma-separated r values"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Reposition r resident tokens vs re-prefill the same r tokens (same run); prints one row per r."""
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    rows = checks.bench_rerotate(eng, tuple(int(x) for x in sizes.split(",")), progress=_progress)
    _emit(rows, as_json)


@bench_app.command()
def overhead(model: str = typer.Option("smollm2", help=MODEL_HELP),
             tokens: int = typer.Option(32768, help="session length"),
             budget: int = typer.Option(512), chunk: int = typer.Option(512), limit: int = typer.Option(2048),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Wall time of `pace` over `h2o` on the same session (target ratio ≤ 1.05)."""
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    _emit(checks.bench_overhead(eng, tokens, budget, chunk, limit, progress=_progress), as_json)


FORESIGHT_ARMS = ("pace", "pace-tiered", "pace-refresh", "pace-refresh-tail", "pace-refresh-window",
                  "pace-refresh-h2o", "retention-only", "foresight", "foresight-recent")


@engine_app.command()
def demo(model: str = typer.Option("smollm2", help=MODEL_HELP),
         length: int = typer.Option(16384, help="session length in tokens"),
         distance: int = typer.Option(15000, help="tokens between the definitions and the probes"),
         budget: int = typer.Option(512), chunk: int = typer.Option(512), limit: int = typer.Option(2048),
         arms: str = typer.Option("h2o,pace"), seed: int = typer.Option(7)) -> None:
    """A long session with early definitions and late probes, played under each arm: resident slots, positions,
    and whether the early definition is still recalled."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kvsteward.eval.longsession.runner import RunConfig, play
    from kvsteward.eval.scoring import mean
    from kvsteward.synth.longsession.generate import generate_session

    eng = _engine(model)
    sess = generate_session(eng.tokenizer, seed, length, distance)
    n_tokens = sess.layout.n_tokens
    console.print(f"session: {n_tokens} tokens, {len(sess.messages)} messages; definitions at tokens "
                  f"{sess.layout.definition_spans}; probes {distance} tokens later; B={budget} H={chunk} L={limit}")
    if any(a in FORESIGHT_ARMS for a in arms.split(",")):
        console.print("foresight arms (pace, pace-refresh, retention-only, foresight) follow the session's "
                      "[bold]oracle plan[/]: the generator's own record of which tokens each probe reads, not a "
                      "planner's guess")
    cfg = RunConfig(arms=tuple(arms.split(",")), budget=budget, chunk=chunk, limit=limit, code=False)
    table = Table(title="kvsteward engine demo")
    for col in ("arm", "tokens seen", "resident slots (peak)", "max position", "residency of needed defs",
                "rotary gap", "forced-prefix answers"):
        table.add_column(col)
    for arm in cfg.arms:
        with Progress(TextColumn(f"[bold]{arm:>14}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task(arm, total=n_tokens, info="")

            def tick(s, task=task, bar=bar):
                pos = s.resident_positions()
                bar.update(task, completed=s.n_logical,
                           info=f"resident {s.resident}, max pos {int(pos.max()) if pos.numel() else 0}")

            t0 = time.perf_counter()
            rows, peak = play(eng, sess, arm, cfg, on_message=tick)
            wall = time.perf_counter() - t0
        facts = [r for r in rows if r.kind == "fact"]
        answers = "\n".join(f"{r.probe.split(':')[-1]} {'✓' if r.score else '✗'} {r.extra['generated'].strip()[:16]!r}"
                             for r in facts)
        table.add_row(arm, str(n_tokens), str(peak), str(max(r.max_position for r in rows)),
                      f"{mean([r.residency for r in facts]):.2f}",
                      f"{mean([r.rotary_gap for r in facts]):.0f}", answers)  # gap: resident needed tokens only
        console.log(f"{arm}: {wall:.0f}s")
    # A pipe gets rich's 80 columns by default: too narrow for the table.
    (console if console.is_terminal else Console(stderr=True, width=150)).print(table)


@bench_app.command()
def restore(model: str = typer.Option("smollm2", help=MODEL_HELP),
            messages: int = typer.Option(12), tokens_per_message: int = typer.Option(256),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Restore an op history with one segment-batch forward vs the sequential replay of its ops (same run)."""
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    _emit(checks.bench_restore(eng, messages, tokens_per_message, progress=_progress), as_json)


@bench_app.command()
def tiers(model: str = typer.Option("smollm2", help=MODEL_HELP), tokens: int = typer.Option(4096),
          valkey_url: str = typer.Option("", help="valkey://host:port/db of a running server (omit: host + disk)"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """Restore time of a session state from host memory, local disk and Valkey (same run)."""
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    _emit(checks.bench_tiers(eng, tokens, valkey_url=valkey_url or None), as_json)


@bench_app.command()
def fork(model: str = typer.Option("smollm2", help=MODEL_HELP),
         resident: int = typer.Option(1536, help="resident tokens of the session that is forked"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """What the aux thread's fork costs the main session: copy fork vs shared fork (no K/V copied), and the parent's
    next decode step with no fork vs with a live shared fork (copy-on-write), same run."""
    from kvsteward.serve.bench import checks

    _emit(checks.bench_fork(_engine(model), resident), as_json)


@bench_app.command()
def refresh(model: str = typer.Option("smollm2", help=MODEL_HELP),
            sizes: str = typer.Option("512,1024,2048", help="comma-separated resident sizes r"),
            chunk: int = typer.Option(512, help="H: the refresh's prefill chunk"),
            repeats: int = typer.Option(3),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """What a refresh costs at r resident tokens, same run: the full refresh, the tail refresh (only rows past the
    fresh prefix), the engine's prefill of r tokens and the model's own transformers forward over r tokens."""
    from kvsteward.serve.bench import checks

    rs = tuple(int(x) for x in sizes.split(",") if x.strip())
    _emit(checks.bench_refresh(_engine(model), rs, chunk, repeats, progress=_progress), as_json)


@bench_app.command()
def throughput(model: str = typer.Option("smollm2", help=MODEL_HELP),
               dtypes: str = typer.Option("float32,bfloat16", help="weight dtypes, the first is the baseline"),
               arms: str = typer.Option("pace-refresh,positions-only", help="bounded arms (`eval longsession`'s)"),
               tokens: int = typer.Option(8192, help="tokens timed after one warm-up chunk"),
               budget: int = typer.Option(1024), limit: int = typer.Option(2048), chunk: int = typer.Option(512),
               repeats: int = typer.Option(2, help="each (dtype, arm) this often, order alternating"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Prefill tokens/s of a bounded long session per arm and weight dtype, same run, and the minutes 1M tokens take
    at that rate (threads: OMP_NUM_THREADS)."""
    from kvsteward.serve.bench import checks

    names = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    for d in names:
        if d not in ("float32", "bfloat16", "float16"):
            raise typer.BadParameter(f"unknown dtype {d!r}: float32, bfloat16 or float16")
    engines = {d: _engine(model, d) for d in names}
    _emit(checks.bench_throughput(engines, tuple(a.strip() for a in arms.split(",") if a.strip()), tokens, budget,
                                  limit, chunk, repeats, progress=_progress), as_json)


@bench_app.command()
def rehydrate(model: str = typer.Option("smollm2", help=MODEL_HELP),
              span_tokens: int = typer.Option(440, help="tokens of the planned span that is spilled and rehydrated"),
              budget: int = typer.Option(512), limit: int = typer.Option(2048),
              valkey_url: str = typer.Option("", help="valkey://host:port/db of a running server (omit: host + disk)"),
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Tiered rehydration (pace-tiered): time to bring an evicted planned span back from host memory, local disk and
    Valkey at its reader step, next to that step's forward (same run)."""
    from kvsteward.serve.bench import checks

    eng = _engine(model)
    _emit(checks.bench_rehydrate(eng, span_tokens, budget=budget, limit=limit, valkey_url=valkey_url or None),
          as_json)


@bench_app.command()
def aux(model: str = typer.Option("smollm2", help=MODEL_HELP),
        adapter: str = typer.Option("", help="PEFT LoRA folder of the memory manager (omit: the base model)"),
        turns: int = typer.Option(12, help="turns of the agent session (turn 0 + one per tool response)"),
        every: int = typer.Option(2, help="aux thread at every K-th tool response"),
        gap: float = typer.Option(0.5, help="the agent's tool time between turns, seconds (the aux runs here)"),
        max_tokens: int = typer.Option(16, help="reply tokens per main turn"),
        aux_max_tokens: int = typer.Option(24, help="decode budget of one aux decision"),
        aux_min_confidence: float = typer.Option(None, help="the aux confidence rule's threshold (0: the greedy "
                                                            "list); default: the adapter's calibrated rule"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Main-turn latency with the aux memory-manager thread on vs off, interleaved in one run (target ratio ≤ 1.05)."""
    from kvsteward.serve.bench import checks
    from kvsteward.serve.engine import Engine
    from kvsteward.serve.manager.decode import check_min_confidence

    try:
        conf = check_min_confidence(aux_min_confidence or None)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    with console.status(f"loading {model} ..."):
        eng = Engine.load(model, adapter=adapter or None)
    if aux_min_confidence is None:
        conf = eng.min_confidence
    _emit(checks.bench_aux(eng, turns, every, gap, max_tokens, aux_max_tokens, progress=_progress,
                           min_confidence=conf), as_json)


@bench_app.command()
def peers(model: str = typer.Option("smollm2", help="`smollm2` or a local HF folder (both stacks load it)"),
          tasks: str = typer.Option("niah_single_1,niah_multikey_2", help="RULER tasks (haystacks need no download)"),
          samples: int = typer.Option(4, help="prompts per task"),
          length: int = typer.Option(2048, help="RULER max_seq_length: prompt + answer tokens"),
          ratios: str = typer.Option("0.5,0.75", help="compression ratios (kept = int(n * (1 - ratio)))"),
          presses: str = typer.Option("snapkv,tova,streaming,observed,knorm", help="kvpress presses"),
          policies: str = typer.Option("snapkv,tova,streaming,h2o,snapkv-heads,tova-heads,h2o-heads,snapkv-layers,"
                                       "tova-layers",
                                       help="engine policies; -heads: each layer and KV head keeps its own tokens; "
                                            "-layers: each layer keeps its own (its heads' scores averaged)"),
          max_new_tokens: int = typer.Option(24), seed: int = typer.Option(42),
          workdir: str = typer.Option("", help="keep the prompts and kvpress's raw output here"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """kvpress's presses (in `.venv-kvpress`, `make kvpress-venv`) and the engine's policies side by side on RULER
    needle prompts: the same token ids, the same kept tokens, one run; accuracy (RULER's string_match_all) and wall per
    prompt."""
    from rich.table import Table

    from kvsteward.eval.peers.bench import bench_peers, table_rows

    def csv(x: str) -> tuple[str, ...]:
        return tuple(v.strip() for v in x.split(",") if v.strip())

    try:
        result = bench_peers(model, csv(tasks), samples, length, tuple(float(r) for r in csv(ratios)), csv(presses),
                             csv(policies), max_new_tokens, seed, workdir or None, progress=_progress)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e
    table = Table("method", "ratio", "accuracy", "s / prompt", title=f"RULER ≤ {length} tokens, {model}")
    for row in table_rows(result):
        table.add_row(*row)
    console.print(table)
    console.print(f"uncompressed answers equal across the two stacks: {result['full_agreement']:.2f}")
    _emit(result, as_json)


SGLANG_ARMS = "default,kvsteward_nofree,kvsteward,kvsteward_aux"  # serve.bench.sglang.ARMS (imported lazily)


@bench_app.command("sglang")
def sglang_bench(model: str = typer.Option("smollm2", help=MODEL_HELP + " (a local folder for SGLang)"),
                 concurrency: int = typer.Option(4, help="agent sessions in flight at once"),
                 turns: int = typer.Option(8, help="turns per session (one tool response + one reply each)"),
                 max_new_tokens: int = typer.Option(16, help="reply tokens per turn (ignore_eos)"),
                 keep: int = typer.Option(2, help="AKV rolling rule: tool responses kept; older ones are dropped"),
                 reposition_every: int = typer.Option(2, help="every N-th drop also repositions (0: never)"),
                 tool_words: int = typer.Option(60, help="words of synthetic output per tool response"),
                 max_total_tokens: int = typer.Option(16384, help="SGLang's KV pool (--max-total-tokens)"),
                 dtype: str = typer.Option("float32", help="the servers' --dtype"),
                 threads: int = typer.Option(2, help="OMP threads of each server"),
                 match_scaling: bool = typer.Option(True, help="also time match_prefix vs conversation length"),
                 log_dir: str = typer.Option("", help="keep the servers' logs here"),
                 workload: str = typer.Option("synthetic", help="synthetic (generated tool responses), bfcl (BFCL v4 "
                                              "multi-turn long_context: executed tool responses, some of 650-1,300 "
                                              "tokens) or bfcl-base (the same conversations, short responses)"),
                 repeats: int = typer.Option(3, help="rounds, the arm order reversed every other round"),
                 arms: str = typer.Option(SGLANG_ARMS, help="comma-separated arms to run (of these)"),
                 sessions: int = typer.Option(0, help="sessions in all (0: --concurrency)"),
                 aux_tokens: int = typer.Option(8, help="tokens the kvsteward_aux arm's fork decodes before a drop"),
                 no_op: bool = typer.Option(True, "--no-op/--no-no-op", help="also time op-free sessions on both "
                                            "servers (no_op_overhead)"),
                 miss: str = typer.Option("refuse", help="a kvsteward request whose pre-op state was evicted: refuse "
                                          "(the client rebuilds it exactly) or reprefill (plain tokens, counted)"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """SGLang + kvsteward vs SGLang's default radix cache on the same agent conversations, same run (one server at a
    time, started from .venv-sglang; every arm replays the same teacher-forced text): requests/s, output tokens/s,
    p50/p95 latency, retractions, queue time, peak KV used / allocated, the tree's stats (re-prefills, compactions),
    and the plugin's overhead on requests without ops (`no_op_overhead`, target <= 1.05). Arms: default,
    kvsteward_nofree (the tree before freeing), kvsteward, kvsteward_aux (an aux fork before each drop)."""
    from kvsteward import models
    from kvsteward.serve.bench import sglang as bench

    chosen = tuple(a.strip() for a in arms.split(",") if a.strip())
    if not chosen or set(chosen) - set(bench.ARMS):
        raise typer.BadParameter(f"--arms {arms!r}: choose among {', '.join(bench.ARMS)}")
    from kvsteward.serve.sglang.ops import MISS_MODES

    if miss not in MISS_MODES:
        raise typer.BadParameter(f"--miss {miss!r}: one of {', '.join(MISS_MODES)}")
    if workload not in bench.WORKLOADS:
        raise typer.BadParameter(f"--workload {workload!r}: one of {', '.join(bench.WORKLOADS)}")
    folder = models.resolve(model)
    tok = models.load_tokenizer(model)
    result = bench.bench_sglang(folder, tok, concurrency=concurrency, turns=turns, max_new_tokens=max_new_tokens,
                                keep=keep, reposition_every=reposition_every, tool_words=tool_words,
                                max_total_tokens=max_total_tokens, dtype=dtype, threads=threads,
                                progress=_progress, log_dir=log_dir or None, workload=workload, repeats=repeats,
                                arms=chosen, sessions=sessions or None, aux_tokens=aux_tokens, no_op=no_op,
                                miss=miss)
    if match_scaling:
        result["match_prefix"] = bench.match_prefix_scaling(progress=_progress)
    result["workload"]["model"] = model
    _emit(result, as_json)
