"""Candidate fixes for pace-refresh's fee-rate misses: interventions on the refreshed state at each fact probe.

The tool of 2026-12-05-pace-refresh-misses (imported from that folder: the same play, variants and rows), with one
more variant, `whole_messages`: the resident tokens of unplanned messages that are only partly resident dropped (the
plan, the system message and whole messages stay). `no_filler_after` there is the plan-only refresh (nothing
unplanned is resident before the definitions once the arm keeps the plan plus a recent window).

    python diagnose.py --seed 6143 --sessions 10 --distances 1024 --shard 0/2 \
        --probes fact:fee_rate,fact:error_code,fact:quantum \
        --interventions as_played,whole_messages,no_filler_after,defs_before_probe,contiguous,full_context \
        --out rows-0.json
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "diag", str(Path(__file__).resolve().parent.parent / "2026-12-05-pace-refresh-misses" / "diagnose.py"))
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)
_base = diag._variant_tokens
_CTX: dict = {}


def _variant_tokens(s, name, defs, needed_defs, probe_start, system):
    if name != "whole_messages":
        return _base(s, name, defs, needed_defs, probe_start, system)
    logical = s.resident_logical().tolist()
    res = set(logical)
    at = _CTX["at"]
    keep = set()
    for a, b in zip(at[:-1], at[1:], strict=True):
        if all(i in res for i in range(a, b)) or (a, b) in defs or (a, b) == system:
            keep.update(i for i in range(a, b) if i in res)
    return [i for i in logical if i in keep or i >= probe_start]


diag._variant_tokens = _variant_tokens
diag.INTERVENTIONS = diag.INTERVENTIONS + ("whole_messages",)
_orig = diag.diagnose


def diagnose(engine, hf, sess, cfg, interventions, probe_ids):
    _CTX["at"] = sess.layout.message_offsets
    return _orig(engine, hf, sess, cfg, interventions, probe_ids)


diag.diagnose = diagnose
_play = diag.play


def play(engine, sess, arm, cfg, **kw):
    # the state diagnosed: the refresh over the plan plus a recent window (`pace-refresh` when this ran, now
    # `pace-refresh-window`); the imported tool names the arm `pace-refresh`
    return _play(engine, sess, "pace-refresh-window", cfg, **kw)


diag.play = play
if __name__ == "__main__":
    sys.argv[0] = "diagnose.py"
    diag.main()
