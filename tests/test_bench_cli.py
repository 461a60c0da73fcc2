"""Every `steward engine` / `steward bench` command runs end to end on a tiny model and prints one JSON object whose
numbers keep the invariants the benchmark is there to show (a command that no longer imports or runs fails here)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvsteward.pipelines.cli import app


def _json(tiny_folder, *args: str):
    res = CliRunner().invoke(app, [*args, "--model", str(tiny_folder), "--json"])
    assert res.exit_code == 0, (res.stderr[-2000:], res.exception)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_engine_check(tiny_folder):
    r = _json(tiny_folder, "engine", "check", "--budget", "128", "--chunk", "64", "--budget-tokens", "1024")
    assert r["generate_equivalence"] is True
    assert max(r["rerotation_max_abs_err"].values()) < 1e-4
    assert r["budget_peak_slots"] <= 128 + 64 and r["budget_tokens"] == 1024


def test_bench_rerotate_overhead_restore(tiny_folder):
    rows = _json(tiny_folder, "bench", "rerotate", "--sizes", "64,128")
    assert [row["r"] for row in rows] == [64, 128] and all(row["rerotate_s"] > 0 for row in rows)
    r = _json(tiny_folder, "bench", "overhead", "--tokens", "1024", "--budget", "128", "--chunk", "64",
              "--limit", "512")
    assert r["peak_resident"] <= 128 + 64 and r["pace_renumbers"] >= 1 and r["ratio_pace_over_h2o"] > 0
    r = _json(tiny_folder, "bench", "restore", "--messages", "3", "--tokens-per-message", "32")
    assert r["max_abs_logit_diff"] < 1e-4 and r["tokens"] == 96
    r = _json(tiny_folder, "bench", "throughput", "--tokens", "512", "--budget", "128", "--limit", "512", "--chunk",
              "64", "--repeats", "1")
    assert set(r["tok_s"]) == {"float32", "bfloat16"} and set(r["speedup_over_float32"]["bfloat16"]) == {
        "pace-refresh", "positions-only"}
    assert all(c["tok_s"] > 0 and c["minutes_per_1m_tokens"] > 0 for d in r["tok_s"].values() for c in d.values())


def test_bench_tiers_fork_rehydrate_aux(tiny_folder):
    r = _json(tiny_folder, "bench", "tiers", "--tokens", "256")
    assert r["resident"] == 256 and r["bytes"] > 0 and r["host_s"] > 0 and r["disk_s"] > 0
    r = _json(tiny_folder, "bench", "fork", "--resident", "256")
    assert r["full"]["resident"] == 256 and r["full"]["shared_fork_s"] > 0
    r = _json(tiny_folder, "bench", "rehydrate", "--span-tokens", "64", "--budget", "128", "--limit", "2048")
    assert r["spilled_bytes"] > 0 and r["rehydrated_tokens"] > 0
    r = _json(tiny_folder, "bench", "aux", "--turns", "3", "--every", "1", "--gap", "0")
    assert r["turns"] == 3 and r["main_latency_ratio_on_over_off"] > 0 and r["aux_min_confidence"] is None
    r = _json(tiny_folder, "bench", "aux", "--turns", "3", "--every", "1", "--gap", "0", "--aux-min-confidence", "0.9")
    assert r["turns"] == 3 and r["aux_min_confidence"] == 0.9
