"""The aux memory-manager thread inside the server (SideQuest): its drop is the engine-level `run_aux` decision applied
as a drop before the next turn; it runs only in idle time and yields to main requests; a restart replays it exactly;
main turns never see half of one. Also the `bench aux` plumbing."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.api import ServerConfig, create_app
from kvsteward.serve.aux import AuxConfig, _candidates, open_cursors, run_aux
from kvsteward.serve.testing import tiny_chat_engine

torch.set_num_threads(1)

T0 = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find X."}],
      "max_tokens": 3}


def tool_turn(i: int, text: str = "result text " * 6, max_tokens: int = 3) -> dict:
    return {"messages": [{"role": "tool", "content": f"[cursor {i}] {text}"}], "max_tokens": max_tokens}


# messages: 0 system, 1 user, 2 reply, 3 tool, 4 reply, 5 tool, 6 reply, 7 tool, 8 reply, ...
TURNS = [T0, tool_turn(3), tool_turn(5), tool_turn(7), tool_turn(9), {"messages": [
    {"role": "user", "content": "Answer now."}], "max_tokens": 4}]
AUX = AuxConfig(every=2, max_tokens=16, use_adapter=False)


@pytest.fixture(scope="module")
def engine():
    """A tiny random model whose logits never favour a `]` token: the constrained aux decode then lists every open
    cursor before it may close (a non-empty, predictable decision; it is still the real decoder deciding)."""
    e = tiny_chat_engine(seed=3)
    ids, texts = _candidates(e.tokenizer)
    bias = torch.zeros(e.vocab_size)
    bias[[i for i, t in zip(ids, texts, strict=True) if "]" in t]] = -1e4
    e.model.lm_head.register_forward_hook(lambda m, inp, out: out + bias)
    return e


def make_app(engine, path, aux=AUX, **kw):
    return create_app(engine, ServerConfig(data_dir=path, aux=aux, **kw))


def turn(client, sid, body) -> dict:
    r = client.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def live(app, sid):
    store = app.state.store
    rec = store.acquire(sid)
    store.release(rec)
    return rec


def twin_turns(engine, path, acks: list[dict], turns: list[dict]) -> tuple[object, str, list[dict]]:
    """The same turns on an aux-less server, each aux drop sent by the client as a cache op at the same boundary
    (n_old - 1, before the new messages): the drop by hand."""
    app = make_app(engine, path, aux=None)
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    out, n = [], 0
    for ack, body in zip(acks, turns, strict=True):
        body = dict(body)
        if ack["aux"] and ack["aux"]["dropped"]:
            body["cache"] = {"drop": {str(n - 1): ack["aux"]["dropped"]}}
        out.append(turn(c, sid, body))
        n = out[-1]["n_messages"]
    return app, sid, out


def test_aux_drop_is_run_aux_applied_as_a_drop_and_restart_replays_it(engine, tmp_path):
    app = make_app(engine, tmp_path / "a")
    c = TestClient(app)
    store = app.state.store
    sid = c.post("/v1/sessions", json={}).json()["id"]
    acks = [turn(c, sid, TURNS[0]), turn(c, sid, TURNS[1])]
    assert acks[1]["aux"] is None and store.worker.wait_idle(60)
    rec = live(app, sid)
    # the engine-level decision on the same state, by hand: what the server decided
    assert open_cursors(rec.messages, rec.dropped) == [3]
    by_hand = run_aux(rec.session, engine.tokenizer, rec.messages, [3], max_tokens=16, use_adapter=False)
    assert by_hand.del_cursors == [3] and rec.aux_pending["del_cursors"] == by_hand.del_cursors
    assert rec.aux_pending["text"] == by_hand.text and rec.aux_pending["fork_turn"] == 2
    assert c.get(f"/v1/sessions/{sid}").json()["aux_pending"] is True
    key_before = rec.session.history_key()
    assert acks[1]["history_key"] == key_before  # deciding never touched the main session

    for body in TURNS[2:]:
        acks.append(turn(c, sid, body))
        store.worker.wait_idle(60)
    assert acks[2]["aux"]["dropped"] == [3] and acks[4]["aux"]["dropped"] == [5, 7]
    assert [a["aux"] is not None for a in acks] == [False, False, True, False, True, False]
    state = c.get(f"/v1/sessions/{sid}").json()
    assert state["dropped_messages"] == state["aux_dropped_messages"] == [3, 5, 7]
    assert app.state.metrics.aux_deleted._value.get() == 3 and app.state.metrics.aux_decisions._value.get() >= 2
    # the log: the aux drop is the first op of the turn that applied it, and covers exactly the whole messages
    records = [json.loads(line) for line in (tmp_path / "a" / "sessions" / f"{sid}.jsonl").read_text().splitlines()]
    ranges = _message_ranges(records)
    for r in records[1:]:
        if r.get("aux", {}).get("dropped"):
            assert r["ops"][0] == {"op": "drop", "indices": [t for j in r["aux"]["dropped"] for t in range(*ranges[j])]}

    # by hand: the same turns with the same drops as client cache ops → the same states and replies, bit for bit
    twin, tsid, tacks = twin_turns(engine, tmp_path / "b", acks, TURNS)
    assert [a["history_key"] for a in acks] == [a["history_key"] for a in tacks]
    assert [a["reply"] for a in acks] == [a["reply"] for a in tacks]
    main, hand = live(app, sid).session, live(twin, tsid).session
    assert main.history == hand.history and torch.equal(main.last_logits, hand.last_logits)

    # a restart replays the aux drops exactly (no tiers: a pure replay of the log)
    again = make_app(engine, tmp_path / "a", tiers=False)
    c2 = TestClient(again)
    assert c2.get(f"/v1/sessions/{sid}").json() == {**state, "aux_pending": False}
    rebuilt = live(again, sid).session
    assert rebuilt.history == main.history and torch.equal(rebuilt.last_logits, main.last_logits)
    # a client that drops a message the aux already dropped is not refused (a no-op), a real double drop is
    assert turn(c2, sid, {"cache": {"drop": {str(state["n_messages"] - 1): [3]}}})["history_key"] == main.history_key()
    r = c2.post(f"/v1/sessions/{sid}/messages", json={"cache": {"drop": {str(state["n_messages"] - 1): [0, 0]}}})
    assert r.status_code == 400


def _message_ranges(records: list[dict]) -> list[tuple[int, int]]:
    from kvsteward.serve.store import message_ranges_of

    return message_ranges_of([op for r in records[1:] for op in r["ops"]])


def test_aux_runs_in_idle_time_and_yields_to_a_main_request(engine, tmp_path):
    app = make_app(engine, tmp_path / "a")
    sched = app.state.scheduler
    c = TestClient(app)
    store = app.state.store
    sid_a, sid_b = (c.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
    turn(c, sid_b, TURNS[0])
    turn(c, sid_a, TURNS[0])
    store.worker.wait_idle(60)
    sched.events = []
    window: dict[str, float] = {}
    main_reply: dict = {}

    def main_request():
        window["start"] = time.perf_counter()
        main_reply.update(store.run_turn(sid_b, tool_turn(3, max_tokens=8)))

    def hook(sid, step):
        if step == 1 and "start" not in window:  # the aux has forked and prefilled the trigger: it is mid-run
            threading.Thread(target=main_request).start()
            while sched.main_active == 0:
                time.sleep(0.001)

    store.worker.step_hook = hook
    turn(c, sid_a, TURNS[1])  # the aux is submitted when this answer is ready
    assert store.worker.wait_idle(60)
    while not main_reply:
        time.sleep(0.01)
    events = sched.events
    start = window["start"]
    main_ev = [(a, b) for who, a, b in events if who == "main" and a >= start]
    aux_ev = [(a, b) for who, a, b in events if who == "aux"]
    main_end = max(b for _, b in main_ev)
    assert len(main_ev) >= 9  # the tool append, the generation prompt and 8 decode steps...
    before = [a for a, _ in aux_ev if a < start]
    after = [a for a, _ in aux_ev if a >= main_end]
    assert len(before) == 2  # fork + trigger prefill ran before the main request arrived
    assert after and len(before) + len(after) == len(aux_ev)  # nothing in between: it yielded, then resumed
    assert app.state.metrics.aux_preemptions._value.get() >= 1
    # the interrupted decision is the undisturbed one, and the main request's answer is that of an aux-less server
    rec = live(app, sid_a)
    want = run_aux(rec.session, engine.tokenizer, rec.messages, [3], max_tokens=16, use_adapter=False)
    assert rec.aux_pending["del_cursors"] == want.del_cursors == [3]
    plain = TestClient(make_app(engine, tmp_path / "b", aux=None))
    sid = plain.post("/v1/sessions", json={}).json()["id"]
    turn(plain, sid, TURNS[0])
    assert turn(plain, sid, tool_turn(3, max_tokens=8))["history_key"] == main_reply["history_key"]


def test_racing_turns_never_see_half_an_aux_drop(engine, tmp_path):
    """Every turn fired without any tool time: aux decisions land at arbitrary moments. Whatever the timing, each
    applied decision is one drop of whole messages before the turn's own ops, and the states equal the same turns
    with those drops made by hand."""
    app = make_app(engine, tmp_path / "a", aux=AuxConfig(every=1, max_tokens=16, use_adapter=False))
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    rng = random.Random(0)
    turns = [T0] + [tool_turn(2 * k + 1, text="x " * rng.randint(3, 30), max_tokens=rng.randint(1, 4))
                    for k in range(1, 9)]
    acks = []
    for body in turns:
        acks.append(turn(c, sid, body))
        time.sleep(rng.choice([0, 0, 0.001, 0.01, 0.03]))
    app.state.store.worker.wait_idle(60)
    applied = [a["aux"]["dropped"] for a in acks if a["aux"]]
    assert any(applied), "no aux decision was applied: the race tested nothing"
    twin, tsid, tacks = twin_turns(engine, tmp_path / "b", acks, turns)
    assert [a["history_key"] for a in acks] == [a["history_key"] for a in tacks]
    assert torch.equal(live(app, sid).session.last_logits, live(twin, tsid).session.last_logits)


def test_serve_cli_aux_flags(tmp_path):
    import typer
    from typer.testing import CliRunner

    from kvsteward.pipelines import cli_serve

    root = typer.Typer()
    root.add_typer(cli_serve.app, name="serve")
    root.command()(lambda: None)
    out = CliRunner().invoke(root, ["serve", "--help"])
    for option in ["--adapter", "--aux-every", "--aux-base", "--valkey-url", "--host-tier-bytes"]:
        assert option in out.output
    bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), "--aux-every", "2"])
    assert bad.exit_code != 0 and "needs a manager" in bad.output


def test_bench_aux_plumbing(engine):
    from kvsteward.serve.checks import bench_aux

    out = bench_aux(engine, turns=4, every=1, gap=0.02, max_tokens=2, aux_max_tokens=8)
    for key in ["main_latency_ratio_on_over_off", "mean_main_turn_s_on", "mean_main_turn_s_off", "aux_decisions",
                "aux_preemptions", "aux_deleted_cursors", "turns", "identical_sessions"]:
        assert key in out
    assert out["turns"] == 4 and out["identical_sessions"] is True and out["aux_errors"] == 0
    assert out["aux_decisions"] >= 2 and out["aux_deleted_cursors"] >= 1  # this model deletes every open cursor
    assert out["main_latency_ratio_on_over_off"] > 0


def test_adapter_is_on_only_in_aux_forwards(tmp_path):
    """A PEFT engine: main turns answer exactly as the base model does; the aux decision is the adapter's."""
    from peft import LoraConfig, get_peft_model

    from kvsteward.serve.engine import Engine

    base = tiny_chat_engine(seed=7)
    with pytest.raises(ValueError, match="has none"):
        make_app(base, tmp_path / "x", aux=AuxConfig(every=1))
    plain = TestClient(make_app(base, tmp_path / "base", aux=None))
    sid = plain.post("/v1/sessions", json={}).json()["id"]
    want = [turn(plain, sid, body) for body in TURNS[:3]]
    tok = base.tokenizer
    model = get_peft_model(tiny_chat_engine(seed=7).model, LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False))
    with torch.no_grad():  # a strong adapter: its decisions differ from the base model's
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(30)
    peft = Engine(model, tok)
    app = make_app(peft, tmp_path / "peft", aux=AuxConfig(every=3, max_tokens=16, use_adapter=True))
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    got = [turn(c, sid, body) for body in TURNS[:3]]
    assert app.state.store.worker.wait_idle(60)
    rec = live(app, sid)
    with_adapter = run_aux(rec.session, tok, rec.messages, [3, 5], max_tokens=16, use_adapter=True)
    without = run_aux(rec.session, tok, rec.messages, [3, 5], max_tokens=16, use_adapter=False)
    assert rec.aux_pending["text"] == with_adapter.text != without.text
    for a, b in zip(got, want, strict=True):  # the main thread never ran the adapter
        assert a["reply"] == b["reply"] and a["history_key"] == b["history_key"]
