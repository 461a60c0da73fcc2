"""Manager metrics on hand-checkable deciders (oracle, delete-everything, never) over generated traces."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from kvsteward.eval.manager.evaluate import Tally, answer_prefix, harm_kind, replay, summarize
from kvsteward.serve.manager.decode import AuxDecision
from kvsteward.synth.traces.hindsight import expired

torch.set_num_threads(1)


def _run(engine, traces, decide):
    t = Tally()
    for tr in traces:
        replay(engine, tr, 2, decide(tr), t)
    return t


def test_oracle_decider_scores_perfectly_and_reduces_memory(manager_setup):
    engine, traces = manager_setup
    ref = _run(engine, traces, lambda tr: None)

    def oracle(tr):
        def decide(s, msgs, open_c):
            i = len(msgs)
            return AuxDecision(sorted(set(expired(tr, i)) & set(open_c)), "", 0)
        return decide

    t = _run(engine, traces, oracle)
    out = summarize(t, ref)
    assert out["f1"] == 1.0 and out["harmful_rate"] == 0.0 and out["parse_fail_rate"] == 0.0
    lo, hi = out["harmful_rate_ci95"]  # no harm seen on a few deletions: not proof of none
    assert lo == 0.0 and 0.0 < hi < 1.0
    assert out["harmful_by_reader"] == {"next_step": 0, "final_answer": 0, "later_step": 0}
    assert out["peak_tokens_reduction"] > 0 and out["kv_reads_reduction"] > 0


def test_delete_everything_is_harmful_and_never_deleting_changes_nothing(manager_setup):
    engine, traces = manager_setup
    ref = _run(engine, traces, lambda tr: None)
    greedy = _run(engine, traces, lambda tr: lambda s, msgs, open_c: AuxDecision(list(open_c), "", 0))
    out = summarize(greedy, ref)
    assert out["recall"] == 1.0 and out["precision"] < 1.0 and out["harmful"] > 0
    # the newest cursor is read by the step right after the boundary: deleting everything hits it at every call
    by = out["harmful_by_reader"]
    assert sum(by.values()) == out["harmful"] and by["next_step"] >= greedy.calls  # (+ detours)
    never = summarize(_run(engine, traces, lambda tr: lambda s, m, o: AuxDecision([], "", 0)), ref)
    assert never["recall"] == 0.0 and never["peak_tokens_reduction"] == 0.0 and never["kv_reads_reduction"] == 0.0
    assert never["answer_acc_delta"] == 0.0 and never["answer_nll_delta"] == 0.0
    assert out["answer_nll"] == out["answer_nll"]  # a number, not NaN


def test_answer_prefix_stops_where_the_value_must_be_recalled(manager_setup):
    engine, traces = manager_setup
    tok = engine.tokenizer
    for tr in traces:
        final = tr.messages[-1]["content"]
        prefix, answer = answer_prefix(final, tr.answer)
        assert final.startswith(prefix + answer) and answer.strip() == tr.answer and answer.startswith(" ")
        assert tr.answer not in prefix and not prefix.endswith(" ")
        # the forced prefix ends on a token boundary of the message as the model reads it
        whole = tok.encode(prefix + answer, add_special_tokens=False)
        assert whole == tok.encode(prefix, add_special_tokens=False) + tok.encode(answer, add_special_tokens=False)
    assert answer_prefix("no value here", "X1") == ("Final answer:", " X1")


def test_close_bias_reaches_the_decoder_through_evaluate(manager_setup):
    """`evaluate(close_bias=...)` drives the real constrained decoder: a huge bias toward closing the list deletes
    nothing, a huge bias against it deletes every open cursor (recall 1)."""
    from kvsteward.eval.manager.evaluate import evaluate

    engine, traces = manager_setup
    keep = evaluate(engine, traces, every=2, arms=("base",), close_bias=1e4)
    assert keep["base"]["deleted"] == 0 and keep["close_bias"] == 1e4
    purge = evaluate(engine, traces, every=2, arms=("base",), close_bias=-1e4)
    assert purge["base"]["recall"] == 1.0 and purge["base"]["deleted"] > 0


def test_harm_kind_names_the_next_reader(manager_setup):
    """Hand-checked against the trace's provenance: the newest cursor at a boundary is read by the step right there,
    and a cursor read only by the final answer is a final-answer harm."""
    _, traces = manager_setup
    seen = set()
    for tr in traces:
        readers = tr.readers()
        for b in range(1, len(tr.messages)):
            for c, steps in readers.items():
                later = [x for x in steps if x >= b]
                if c >= b or not later:
                    continue
                kind = harm_kind(tr, c, b)
                seen.add(kind)
                if later[0] == b:
                    assert kind == "next_step"
                elif later[0] == len(tr.messages) - 1:
                    assert kind == "final_answer"
                else:
                    assert kind == "later_step"
    assert {"next_step", "final_answer"} <= seen


def test_cli_refuses_a_non_finite_close_bias_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    res = CliRunner().invoke(app, ["eval", "manager", "--data", str(tmp_path), "--close-bias", "nan", "--no-mlflow"])
    assert res.exit_code == 2 and "--close-bias must be a finite number" in res.output


def test_aux_context_reaches_the_decoder_through_evaluate(manager_setup, monkeypatch):
    """`Engine.aux_context` (an adapter's recorded context, or `--aux-context`) is what `evaluate` serves: with
    `first` every aux call that decodes runs on a first-message session, with `full` none does; the result says
    which."""
    from kvsteward.eval.manager.evaluate import evaluate
    from kvsteward.serve.manager import thread as aux_mod

    engine, traces = manager_setup
    calls: list[int] = []
    real = aux_mod.first_message_session
    monkeypatch.setattr(aux_mod, "first_message_session", lambda f, t, m: calls.append(len(m)) or real(f, t, m))
    full = evaluate(engine, traces[:1], every=2, arms=("base",), close_bias=-1e4)
    assert full["aux_context"] == "full" and not calls
    monkeypatch.setattr(engine, "aux_context", "first")
    first = evaluate(engine, traces[:1], every=2, arms=("base",), close_bias=-1e4)
    assert first["aux_context"] == "first" and len(calls) == first["base"]["aux_calls"] > 0
    # a huge bias against closing deletes every read cursor whatever the context: same deletions, same tallies
    assert first["base"]["deleted"] == full["base"]["deleted"] > 0


def test_cli_refuses_an_unknown_aux_context_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    res = CliRunner().invoke(app, ["eval", "manager", "--data", str(tmp_path), "--aux-context", "task", "--no-mlflow"])
    assert res.exit_code == 2 and "--aux-context must be one of full, first" in res.output


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN-aware: NaN == NaN as text


def test_workers_give_the_serial_result(manager_setup):
    """Traces played in 2 spawned processes (each building the same engine) merge into the serial result, number
    for number (traces are independent and greedy; merged in trace order)."""
    from functools import partial

    from kvsteward.eval.manager.evaluate import evaluate
    from kvsteward.serve.server.testing import tiny_chat_engine

    engine, traces = manager_setup
    serial = evaluate(engine, traces, every=2, arms=("base",))
    parallel = evaluate(engine, traces, every=2, arms=("base",), workers=2,
                        engine_factory=partial(tiny_chat_engine, 2))
    assert serial["base"]["aux_calls"] > 0 and _same(serial, parallel)


def test_a_journal_resumes_where_a_run_stopped(manager_setup, tmp_path, monkeypatch):
    """A journal keeps every finished trace: a rerun plays only the missing ones and gives the uninterrupted result;
    a line cut short by a crash is played again; other settings, or another trace under a journaled name, are
    refused; a sweep that adds an arm plays only that arm."""
    from kvsteward.eval.manager import evaluate as mgr

    engine, traces = manager_setup
    whole = mgr.evaluate(engine, traces, every=2, arms=("base",), close_bias=-1.0)
    journal = tmp_path / "j.jsonl"
    mgr.evaluate(engine, traces[:1], every=2, arms=("base",), close_bias=-1.0, journal=journal)  # "killed" here
    with journal.open("a") as f:
        f.write('{"trace": "cut sh')  # a crash mid-write
    played: list[str] = []
    real = mgr.play_trace
    monkeypatch.setattr(mgr, "play_trace", lambda e, t, *a: played.append(t.task_id) or real(e, t, *a))
    # (the first run journaled trace 0 whole: only trace 1 is played)
    resumed = mgr.evaluate(engine, traces, every=2, arms=("base",), close_bias=-1.0, journal=journal)
    assert played == [traces[1].task_id] and _same(resumed, whole)
    played.clear()
    again = mgr.evaluate(engine, traces, every=2, arms=("base",), close_bias=-1.0, journal=journal)
    assert played == [] and _same(again, whole)
    with pytest.raises(mgr.JournalError, match="other settings \\(every: \\[2\\] there, \\[3\\] now"):
        mgr.evaluate(engine, traces, every=3, arms=("base",), close_bias=-1.0, journal=journal)
    # another bias is another arm: only it is played (the reference and bias -1 are read back)
    calls: list[tuple] = []
    monkeypatch.setattr(mgr, "play_trace", lambda e, t, ev, arms, *a: calls.append((t.task_id, dict(arms), a[-1]))
                        or real(e, t, ev, arms, *a))
    sweep = mgr.play(engine, traces, 2, {"old": (False, -1.0, None), "new": (False, 1e4, None)}, journal=journal)
    assert calls == [(t.task_id, {"new": (False, 1e4, None)}, False) for t in traces]
    fresh = mgr.play(engine, traces, 2, {"old": (False, -1.0, None), "new": (False, 1e4, None)})
    assert all(json.dumps(asdict(sweep[k])) == json.dumps(asdict(fresh[k])) for k in ("uncompressed", "old", "new"))
    assert sweep["new"].deleted == 0 and sweep["old"].deleted > 0
    from dataclasses import replace

    impostor = replace(traces[0], messages=[*traces[0].messages[:-1], {"role": "assistant", "content": "other"}])
    with pytest.raises(mgr.JournalError, match=f"another trace named {traces[0].task_id}"):
        mgr.evaluate(engine, [impostor], every=2, arms=("base",), close_bias=-1.0, journal=journal)


def test_workers_exit_when_their_parent_is_killed():
    """A busy worker of `play(workers=N)` whose parent dies by SIGKILL exits too, instead of playing its trace to
    the end for nobody (an idle one would notice the closed queue by itself; a busy one reads none)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = ("import multiprocessing, os, sys, time\n"
            "from concurrent.futures import ProcessPoolExecutor\n"
            "from kvsteward.eval.manager.evaluate import _worker_init\n"
            "if __name__ == '__main__':\n"
            "    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'),\n"
            "                               initializer=_worker_init, initargs=(dict, 1))\n"
            "    print(pool.submit(os.getpid).result(), flush=True)\n"
            "    pool.submit(time.sleep, 90)\n"  # busy, as a worker playing a trace is: it reads no queue
            "    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    worker = int(parent.stdout.readline())

    def alive(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status")
        try:  # a dead worker nobody reaped (PID 1 of a container may not) is a zombie: gone for our purpose
            return "\tZ" not in next(ln for ln in status.read_text().splitlines() if ln.startswith("State:"))
        except (FileNotFoundError, ProcessLookupError):
            return False

    assert alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while alive(worker) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(worker)
