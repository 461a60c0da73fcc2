"""`steward bench peers`: kvpress's presses and the engine's policies side by side, at the same kept tokens, on the
same RULER prompts (the same token ids), in one run.

Protocol (kvpress's pipeline, both sides): the context is prefilled and compressed once to `int(n * (1 - ratio))`
tokens, then the question (with RULER's answer prefix) is appended and the answer decoded greedily with nothing more
evicted. kvpress runs in its own virtualenv (`eval/peers/kvpress_side.py`, transformers < 5.3); it also writes the
exact ids its pipeline built, and the engine replays those. Selection: kvpress's scorer presses select per layer and
KV head (each head keeps its own tokens), TOVA per layer (its scores averaged over the layer's heads); the engine
selects one set of tokens for all layers and heads (`snapkv`, ...), per layer and KV head (`snapkv-heads`, ...:
`SessionConfig.per_head`, masked per head) or per layer (`tova-layers`, ...: `SessionConfig.per_layer`).
Differences that stay: kvpress's SnapKV uses a 64-token window and average pooling, the engine's a 32-token window
and max pooling; the engine protects 4 sinks and the 64 most recent tokens in every policy but streaming's (sinks +
recent window only), kvpress only SnapKV's window and StreamingLLM's sinks. Pairs: snapkv ↔ SnapKVPress, tova ↔
TOVAPress, streaming ↔ StreamingLLMPress, h2o ↔ ObservedAttentionPress (attention received, summed vs averaged over
queries); KnormPress has no engine counterpart. KVzap is not run: its scorer is a surrogate trained per model
(kvpress's `kvzap/train.py` on a dataset from the Hub), and none exists for SmolLM2."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvsteward.eval.peers import ruler
from kvsteward.paths import side_python

PRESSES = ("snapkv", "tova", "streaming", "observed", "knorm")
# `-heads`: the engine's per-head selection (`SessionConfig.per_head`: each layer and KV head keeps its own top-B,
# as kvpress's scorer presses do); `-layers`: per layer on the heads' averaged scores (`SessionConfig.per_layer`, as
# kvpress's TOVA does); the plain names select one set of tokens for all layers and heads
POLICIES = ("snapkv", "tova", "streaming", "h2o", "snapkv-heads", "tova-heads", "h2o-heads", "snapkv-layers",
            "tova-layers", "h2o-layers")
PAIRS = {"snapkv": "snapkv", "tova": "tova", "streaming": "streaming", "h2o": "observed",
         "snapkv-heads": "snapkv", "tova-heads": "tova", "h2o-heads": "observed",
         "snapkv-layers": "snapkv", "tova-layers": "tova", "h2o-layers": "observed"}
HEADS, LAYERS = "-heads", "-layers"
Progress = Callable[[str], None]


def kvpress_python() -> str:
    """kvpress's interpreter: `KVSTEWARD_KVPRESS_PYTHON`, else the repository's `.venv-kvpress`."""
    return side_python("KVSTEWARD_KVPRESS_PYTHON", ".venv-kvpress", "kvpress-venv", "kvpress 0.5.5")


def kept_tokens(n: int, ratio: float) -> int:
    """kvpress's kept count per head for a compression ratio (`ScorerPress`: int(n * (1 - ratio)))."""
    return int(n * (1 - ratio))


def run_engine(engine, ids: dict[str, dict], policies: tuple[str, ...], ratios: tuple[float, ...],
               max_new_tokens: int, progress: Progress | None = None) -> list[dict]:
    """The engine's policies on the prompts kvpress built: [{"task", "policy", "ratio", "answer", "kept",
    "resident", "wall_s"}]; `full` is the uncompressed cache. `kept` is per head (what every head keeps: with
    per-head or per-layer selection, `-heads` / `-layers`, the slots resident are their union, `resident`)."""
    tok = engine.tokenizer
    stop = tuple(i for i in [tok.eos_token_id] if i is not None)
    rows = []
    for task, p in ids.items():
        ctx, q = p["context_ids"], p["question_ids"]
        for name in ("full", *policies):
            for ratio in (ratios if name != "full" else (0.0,)):
                t0 = time.perf_counter()
                per_head, per_layer = name.endswith(HEADS), name.endswith(LAYERS)
                if name == "full":
                    s = engine.session("full", chunk=len(ctx))
                else:
                    s = engine.session(name.removesuffix(HEADS).removesuffix(LAYERS),
                                       budget=kept_tokens(len(ctx), ratio), chunk=len(ctx), per_head=per_head,
                                       per_layer=per_layer)
                s.append(ctx, kind="user")
                resident = s.table.n
                kept = int(s.table.field("head_alive").sum(dim=0).max()) if per_head or per_layer else resident
                s.set_budget(None)  # compress once, as kvpress does: nothing is evicted after the context
                s.append(q, kind="user", continue_message=True)
                out = s.generate(max_new_tokens, stop_ids=stop)
                wall = time.perf_counter() - t0
                answer = tok.decode(out, skip_special_tokens=True)
                rows.append({"task": task, "policy": name, "ratio": ratio, "answer": answer, "kept": kept,
                             "resident": resident, "wall_s": wall})
                if progress:
                    progress(f"engine {task} {name} {ratio}: {wall:.1f} s, kept {kept}: {answer!r}")
    return rows


def summarize(rows: list[dict], method_key: str, outputs: dict[str, list[str]]) -> dict:
    """{method: {ratio: {"accuracy", "wall_s", "kept", "n"}}}: RULER's string_match_all, mean over prompts."""
    table: dict = {}
    for r in rows:
        cell = table.setdefault(r[method_key], {}).setdefault(f"{r['ratio']:g}", {"scores": [], "wall": [],
                                                                                  "kept": []})
        cell["scores"].append(ruler.string_match_all(r["answer"], outputs[r["task"]]))
        cell["wall"].append(r["wall_s"])
        cell["kept"].append(r["kept"])
    return {m: {ratio: {"accuracy": statistics.fmean(c["scores"]), "wall_s": statistics.fmean(c["wall"]),
                        "kept": statistics.fmean(c["kept"]), "n": len(c["scores"])} for ratio, c in cells.items()}
            for m, cells in table.items()}


def bench_peers(model: str = "smollm2", tasks: tuple[str, ...] = tuple(ruler.TASKS), samples: int = 4,
                length: int = 2048, ratios: tuple[float, ...] = (0.5, 0.75), presses: tuple[str, ...] = PRESSES,
                policies: tuple[str, ...] = POLICIES, max_new_tokens: int = 24, seed: int = 42,
                workdir: str | None = None, progress: Progress | None = None) -> dict:
    """The benchmark's JSON: {"kvpress": {press: {ratio: {...}}}, "engine": {policy: {ratio: {...}}},
    "pairs": [...], "full_agreement": float, "rows": {...}, "workload": {...}}."""
    from kvsteward import models
    from kvsteward.serve.engine import Engine

    for p in policies:
        if p not in PAIRS:
            raise ValueError(f"unknown engine policy {p!r} for the side by side ({', '.join(PAIRS)})")
    for r in ratios:
        if not 0 < r < 1:
            raise ValueError(f"compression ratio must be in (0, 1), got {r}")
    py = kvpress_python()
    folder = models.resolve(model)
    work = Path(workdir or tempfile.mkdtemp(prefix="kvsteward-peers-")).resolve()  # the generator runs in it
    work.mkdir(parents=True, exist_ok=True)
    prompts = [t for task in tasks for t in ruler.generate(py, folder, task, samples, length, work, seed=seed)]
    outputs = {t["id"]: t["outputs"] for t in prompts}
    if progress:
        progress(f"{len(prompts)} RULER prompts of ≤ {length} tokens ({', '.join(tasks)})")
    spec = {"model": folder, "tasks": prompts, "presses": ["none", *presses], "ratios": list(ratios),
            "max_new_tokens": max_new_tokens, "threads": int(os.environ.get("OMP_NUM_THREADS", "1"))}
    (work / "kvpress-in.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run([py, str(Path(__file__).with_name("kvpress_side.py")), str(work / "kvpress-in.json"),
                           str(work / "kvpress-out.json")], stderr=None if progress else subprocess.PIPE,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if proc.returncode:
        raise RuntimeError(f"kvpress side failed: {(proc.stderr or '')[-800:]}")
    kvpress_wall = time.perf_counter() - t0
    side = json.loads((work / "kvpress-out.json").read_text())
    engine = Engine.load(model)
    t0 = time.perf_counter()
    erows = run_engine(engine, side["ids"], policies, ratios, max_new_tokens, progress=progress)
    engine_wall = time.perf_counter() - t0
    kv, en = summarize(side["rows"], "press", outputs), summarize(erows, "policy", outputs)
    full = {r["task"]: r["answer"] for r in erows if r["policy"] == "full"}
    none = {r["task"]: r["answer"] for r in side["rows"] if r["press"] == "none"}
    return {
        "kvpress": kv, "engine": en,
        "pairs": [{"engine": e, "kvpress": k} for e, k in PAIRS.items() if e in policies and k in presses],
        # the same ids and weights uncompressed: the two stacks' greedy answers should agree
        "full_agreement": statistics.fmean(full[t] == none[t] for t in full),
        "rows": {"kvpress": side["rows"], "engine": erows},
        "workload": {"model": model, "tasks": list(tasks), "samples_per_task": samples, "max_length": length,
                     "context_tokens_mean": statistics.fmean(len(p["context_ids"]) for p in side["ids"].values()),
                     "ratios": list(ratios), "max_new_tokens": max_new_tokens, "seed": seed,
                     "versions": side["versions"], "kvpress_wall_s": kvpress_wall, "engine_wall_s": engine_wall,
                     "threads": spec["threads"]},
    }


def table_rows(result: dict) -> list[tuple[str, str, str, str]]:
    """(method, ratio, accuracy, s/prompt) rows for the CLI's table: each pair's kvpress press beside its engine
    policy, then kvpress's unpaired presses, then the uncompressed caches."""
    rows, shown = [], set()
    for pair in result["pairs"]:
        for side, name in (("kvpress", pair["kvpress"]), ("engine", pair["engine"])):
            if (side, name) in shown:  # a press paired with both engine selections is shown once
                continue
            shown.add((side, name))
            for ratio, c in result[side].get(name, {}).items():
                rows.append((f"{side}: {name}", ratio, f"{c['accuracy']:.2f}", f"{c['wall_s']:.2f}"))
    paired = {p["kvpress"] for p in result["pairs"]}
    for name, cells in result["kvpress"].items():
        if name not in paired and name != "none":
            rows += [(f"kvpress: {name}", r, f"{c['accuracy']:.2f}", f"{c['wall_s']:.2f}") for r, c in cells.items()]
    for side, name in (("kvpress", "none"), ("engine", "full")):
        for c in result[side].get(name, {}).values():
            rows.append((f"{side}: {name} (uncompressed)", "0", f"{c['accuracy']:.2f}", f"{c['wall_s']:.2f}"))
    return rows
