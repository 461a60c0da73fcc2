"""Markdown tables of `python -m kvsteward.serve.bench.sglang --json` outputs: `python table.py synthetic.json ...`."""

import json
import sys

ROWS = [("output tokens/s", "output_tok_s", ".2f"), ("requests/s", "requests_per_s", ".3f"),
        ("latency p50 / p95 (s)", ("p50_s", "p95_s"), ".1f"), ("running requests peak / mean", ("running_peak",
        "running_mean"), ".1f"), ("waiting peak", "waiting_peak", ".1f"), ("queue time mean (s)",
        "queue_time_mean_s", ".2f"), ("retractions", "retractions", ".1f"),
        ("prompt tokens computed (seals, forks incl.)", "prompt_tokens_computed", ",.0f"),
        ("seal / fork requests", ("seal_requests", "fork_requests"), ".0f"),
        ("peak KV in use / mean", ("peak_kv_used", "mean_kv_used"), ",.0f"),
        ("peak KV allocated", "peak_kv_allocated", ",.0f"), ("tree: re-prefills", "reprefills", ".1f"),
        ("tree: compactions / slots freed", ("tree_compactions", "tree_freed"), ",.0f"),
        ("tree: compacted-state misses", "tree_compacted_miss", ".1f"),
        ("strict-check failures in the log", "strict_check_failures", ".0f")]


def cell(arm: dict, key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    vals = [arm.get(k) for k in keys]
    return " / ".join("–" if v is None else format(v, fmt) for v in vals)


for path in sys.argv[1:]:
    d = json.load(open(path))
    arms = [a for a in ("default", "kvsteward_nofree", "kvsteward", "kvsteward_aux") if a in d]
    print(f"\n{path}: {json.dumps(d['workload'])}\n")
    print("| | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for label, key, fmt in ROWS:
        print(f"| {label} | " + " | ".join(cell(d[a], key, fmt) for a in arms) + " |")
    print(f"\nno_op_overhead: {d.get('no_op_overhead')}")
    for a in arms:
        print(a, "per round output tok/s:", [round(r["output_tok_s"], 2) for r in d["repeats"][a]],
              "retractions:", [r["retractions"] for r in d["repeats"][a]])
