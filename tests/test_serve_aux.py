"""The aux memory-manager thread inside the server (SideQuest): it forks at the training boundary (right after the K-th
tool response, before the reply: `synth.traces.hindsight.boundaries`); its drop is the engine-level `run_aux` decision
on
that state applied as a drop before the next turn; it runs only in idle time and yields to main requests; a restart
replays it exactly; main turns never see half of one. Also the `bench aux` plumbing."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.manager.decode import _candidates
from kvsteward.serve.manager.thread import fork_point, open_cursors, run_aux
from kvsteward.serve.manager.worker import AuxConfig
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.testing import live, tiny_chat_engine, turn

torch.set_num_threads(1)

T0 = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find X."}],
      "max_tokens": 3}


def tool_turn(i: int, text: str = "result text " * 6, max_tokens: int = 3) -> dict:
    return {"messages": [{"role": "tool", "content": f"[cursor {i}] {text}"}], "max_tokens": max_tokens}


# messages: 0 system, 1 user, 2 reply, 3 tool, 4 reply, 5 tool, 6 reply, 7 tool, 8 reply, ...
TURNS = [T0, tool_turn(3), tool_turn(5), tool_turn(7), tool_turn(9), {"messages": [
    {"role": "user", "content": "Answer now."}], "max_tokens": 4}]
# The plumbing tests below want a decision that lists every open cursor; keep_unread (on by default) is tested on its
# own (`test_the_worker_keeps_the_unread_response_by_default`).
AUX = AuxConfig(every=2, max_tokens=16, use_adapter=False, keep_unread=False)


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
            body["cache"] = {**body.get("cache", {}), "drop": {**body.get("cache", {}).get("drop", {}),
                                                              str(n - 1): ack["aux"]["dropped"]}}
        out.append(turn(c, sid, body))
        n = out[-1]["n_messages"]
    return app, sid, out


def no_reply(body: dict, keep: int | None = None) -> dict:
    """The turn's messages (the first `keep` of them) appended with no reply: the state at a training boundary."""
    return {k: v for k, v in body.items() if k not in ("max_tokens", "generate")} | {
        "messages": body["messages"][:keep], "generate": False}


def by_hand(engine, path, acks: list[dict], turns: list[dict], use_adapter: bool = False):
    """The hindsight boundary by hand: an aux-less server replays `turns` (the last one ending with the boundary's
    tool message, no reply), then `run_aux` on that state with the trigger. (session, messages, open, decision)"""
    app, sid, _ = twin_turns(engine, path, acks, turns)
    rec = live(app, sid)
    assert rec.messages[-1]["role"] == "tool" and rec.session.history[-1]["kind"] == "tool"
    opened = open_cursors(rec.messages, rec.dropped)
    decision = run_aux(rec.session, engine.tokenizer, rec.messages, opened, max_tokens=16, use_adapter=use_adapter,
                       keep_unread=False)
    return rec.session, rec.messages, opened, decision


def test_fork_point_is_hindsight_boundary():
    """An agent loop (one tool response per turn, each followed by a generated reply): the server's fork points are
    exactly `boundaries(trace, K)` - 1, for every K."""
    from kvsteward.synth.traces.hindsight import boundaries
    from kvsteward.synth.traces.trace import Trace

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    while len(msgs) < 24:
        msgs += [{"role": "tool", "content": f"[cursor {len(msgs)}] r"}, {"role": "assistant", "content": "a"}]
    trace = Trace("t", "train", msgs, {})
    for every in (1, 2, 3, 5):
        got = []
        for n_old in range(3, len(msgs), 2):  # turn: [tool] appended to msgs[:n_old], then the reply
            t = fork_point(msgs[: n_old + 1], n_old, every)
            if t is not None:
                got.append(t + 1)
        assert got == boundaries(trace, every), every
    # a turn crossing two multiples forks once, at the later one; a turn with no tool message never forks
    two = msgs[:3] + [msgs[3], {"role": "tool", "content": "r"}, {"role": "user", "content": "u"}]
    assert fork_point(two, 3, 1) == 4 and fork_point(two, 3, 2) == 4 and fork_point(two, 3, 3) is None
    assert fork_point(msgs[:3] + [{"role": "user", "content": "u"}], 3, 1) is None


def test_aux_drop_is_run_aux_applied_as_a_drop_and_restart_replays_it(engine, tmp_path):
    """The fork is the state right after the K-th tool response, before the reply: the server's decision is `run_aux`
    on a session that replayed exactly the messages up to that tool response (plus the trigger), not the reply."""
    app = make_app(engine, tmp_path / "a")
    c = TestClient(app)
    store = app.state.store
    sid = c.post("/v1/sessions", json={}).json()["id"]
    acks = [turn(c, sid, body) for body in TURNS[:3]]  # tool responses 3, 5: the 2nd is a boundary (every=2)
    assert all(a["aux"] is None for a in acks) and store.worker.wait_idle(60)
    rec = live(app, sid)
    pending = dict(rec.aux_pending)
    assert (pending["fork_turn"], pending["boundary"], pending["open_cursors"]) == (2, 6, [3, 5])
    # by hand: T0, tool 3 (+ its reply), tool 5 with no reply, then the trigger
    hand, hand_msgs, opened, want = by_hand(engine, tmp_path / "h1", acks, TURNS[:2] + [no_reply(TURNS[2])])
    assert hand_msgs == rec.messages[:6] and opened == [3, 5]
    assert pending["fork_key"] == hand.history_key() != acks[2]["history_key"]  # the reply is not in the fork
    assert rec.session.history[: len(hand.history)] == hand.history  # the main state is that state + the reply
    assert pending["text"] == want.text and pending["del_cursors"] == want.del_cursors == [3, 5]
    assert 0 <= pending["fork_s"] < 1
    assert c.get(f"/v1/sessions/{sid}").json()["aux_pending"] is True
    assert acks[2]["history_key"] == rec.session.history_key()  # deciding never touched the main session

    for body in TURNS[3:]:
        acks.append(turn(c, sid, body))
        store.worker.wait_idle(60)
    assert [a["aux"] is not None for a in acks] == [False, False, False, True, False, True]
    assert acks[3]["aux"]["dropped"] == [3, 5] and acks[5]["aux"]["dropped"] == [7, 9]
    second = acks[5]["aux"]  # forked in turn 4 right after tool 9, with 3 and 5 already dropped
    assert (second["fork_turn"], second["boundary"], second["open_cursors"]) == (4, 10, [7, 9])
    hand, _, _, want = by_hand(engine, tmp_path / "h2", acks[:5], TURNS[:4] + [no_reply(TURNS[4])])
    assert second["fork_key"] == hand.history_key() and second["text"] == want.text
    state = c.get(f"/v1/sessions/{sid}").json()
    assert state["dropped_messages"] == state["aux_dropped_messages"] == [3, 5, 7, 9]
    assert app.state.metrics.aux_deleted._value.get() == 4 and app.state.metrics.aux_decisions._value.get() == 2
    # the log: the aux drop is the first op of the turn that applied it, and covers exactly the whole messages
    lines = (tmp_path / "a" / "sessions" / f"{sid}.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["type"] != "aux"]
    assert sum(json.loads(x)["type"] == "aux" for x in lines) == 2  # each decision was persisted when made
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


def _first_decision(engine, path, aux: AuxConfig) -> dict:
    """The worker's pending decision after the first boundary of TURNS (tool responses 3 and 5, every = 2)."""
    app = make_app(engine, path, aux=aux)
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    for body in TURNS[:3]:
        turn(c, sid, body)
    assert app.state.store.worker.wait_idle(60)
    return dict(live(app, sid).aux_pending)


def test_the_worker_decodes_with_the_configured_close_bias(engine, tmp_path):
    """This module's model never favours `]` (it would list every open cursor); a close bias larger than that
    handicap, set in the server's AuxConfig, must reach the worker's decode: the decision becomes "delete nothing"."""
    pending = _first_decision(engine, tmp_path / "a", AuxConfig(every=2, max_tokens=16, use_adapter=False,
                                                                 close_bias=2e4))
    assert pending["open_cursors"] == [3, 5] and pending["del_cursors"] == [] and pending["text"].endswith(" []}")


def test_the_worker_decodes_with_the_configured_confidence_rule(engine, tmp_path, monkeypatch):
    """`AuxConfig.min_confidence` reaches the worker's decode: the branch decode runs with that threshold (a spy
    around the real one), and its decision is what the session gets (this module's model lists every read cursor
    with certainty, so the confident list is the greedy one)."""
    from kvsteward.serve.manager import thread as aux_mod

    seen = []
    real = aux_mod._confident_steps

    def spy(session, tokenizer, open_ids, min_confidence, *args):
        seen.append((list(open_ids), min_confidence))
        return (yield from real(session, tokenizer, open_ids, min_confidence, *args))

    monkeypatch.setattr(aux_mod, "_confident_steps", spy)
    pending = _first_decision(engine, tmp_path / "a", AuxConfig(every=2, max_tokens=16, use_adapter=False,
                                                                 min_confidence=0.9))
    assert seen == [([3], 0.9)]
    assert pending["open_cursors"] == [3, 5] and pending["del_cursors"] == [3]
    assert pending["confidence"]["3"] >= 0.9 and list(pending["confidence"]) == ["3"]  # persisted with the decision


def test_the_worker_keeps_the_unread_response_by_default(engine, tmp_path):
    """Default AuxConfig: the decoder (which here would list everything) may not list the boundary's own tool
    response, which the agent has not read yet; the older one goes."""
    pending = _first_decision(engine, tmp_path / "a", AuxConfig(every=2, max_tokens=16, use_adapter=False))
    assert pending["open_cursors"] == [3, 5] and pending["del_cursors"] == [3]


def test_a_pending_decision_survives_a_kill(engine, tmp_path):
    """A decision made after turn 2 and not yet applied is in the log (fsynced): a server started on the same data
    (the first one killed: nothing closed) applies it at the next turn exactly as an uninterrupted server does."""
    ref = make_app(engine, tmp_path / "ref")
    c = TestClient(ref)
    rsid = c.post("/v1/sessions", json={}).json()["id"]
    for body in TURNS[:3]:
        turn(c, rsid, body)
    assert ref.state.store.worker.wait_idle(60)
    want = turn(c, rsid, TURNS[3])

    app = make_app(engine, tmp_path / "a")
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    for body in TURNS[:3]:
        turn(c, sid, body)
    assert app.state.store.worker.wait_idle(60) and live(app, sid).aux_pending is not None
    last = json.loads((tmp_path / "a" / "sessions" / f"{sid}.jsonl").read_text().splitlines()[-1])
    assert last["type"] == "aux" and last["turn"] == 3 and last["pending"]["del_cursors"] == [3, 5]
    again = TestClient(make_app(engine, tmp_path / "a", tiers=False))  # no close: as after kill -9
    assert again.get(f"/v1/sessions/{sid}").json()["aux_pending"] is True
    got = turn(again, sid, TURNS[3])
    assert got["aux"]["dropped"] == want["aux"]["dropped"] == [3, 5]
    assert got["history_key"] == want["history_key"] and got["reply"] == want["reply"]
    assert TestClient(make_app(engine, tmp_path / "a", tiers=False)).get(f"/v1/sessions/{sid}").json()[
        "aux_pending"] is False  # applied and persisted with turn 3: never applied twice


def test_the_worker_serves_the_engine_s_aux_context(engine, tmp_path, monkeypatch):
    """An engine whose adapter was trained with `--aux-context first`: the worker's decode follows a session holding
    the conversation's first message (once per decision, given the messages up to the boundary), not the fork."""
    from kvsteward.serve.manager import thread as aux_mod

    seen: list[list[dict]] = []
    real = aux_mod.first_message_session
    monkeypatch.setattr(aux_mod, "first_message_session", lambda f, t, m: seen.append(m) or real(f, t, m))
    monkeypatch.setattr(engine, "aux_context", "first")
    pending = _first_decision(engine, tmp_path / "a", AuxConfig(every=2, max_tokens=16, use_adapter=False))
    assert len(seen) == 1 and len(seen[0]) == pending["boundary"] == 6 and seen[0][0]["role"] == "system"
    assert pending["open_cursors"] == [3, 5] and pending["del_cursors"] == [3]


def test_fork_mid_turn_right_after_the_tool_message(engine, tmp_path):
    """Turns whose new messages do not end with the boundary's tool response: the fork is taken right after it
    (and after the cache ops that belong right after it), before the following messages and the reply."""
    app = make_app(engine, tmp_path / "a", aux=AuxConfig(every=1, max_tokens=16, use_adapter=False,
                                                                 keep_unread=False))
    c = TestClient(app)
    store = app.state.store
    sid = c.post("/v1/sessions", json={}).json()["id"]
    tool_then_user = {"messages": [{"role": "tool", "content": "[cursor 3] " + "r " * 8},
                                   {"role": "user", "content": "Think first."}], "max_tokens": 3}
    # messages 0 system, 1 user, 2 reply, 3 tool, 4 user, 5 reply, then 6 tool, 7 tool (+ client drop of 6), 8 reply
    two_tools = {"messages": [{"role": "tool", "content": "[cursor 6] " + "s " * 8},
                              {"role": "tool", "content": "[cursor 7] " + "t " * 8}],
                 "cache": {"drop": {"6": [6]}}, "max_tokens": 3}
    acks = [turn(c, sid, T0), turn(c, sid, tool_then_user)]
    assert store.worker.wait_idle(60)
    first = dict(live(app, sid).aux_pending)
    assert (first["fork_turn"], first["boundary"], first["open_cursors"]) == (1, 4, [3])
    hand, _, _, want = by_hand(engine, tmp_path / "h1", acks, [T0, no_reply(tool_then_user, keep=1)])
    assert first["fork_key"] == hand.history_key() and first["text"] == want.text
    acks.append(turn(c, sid, two_tools))
    assert acks[2]["aux"]["dropped"] == [3] and store.worker.wait_idle(60)
    second = live(app, sid).aux_pending  # one fork, after the later tool; the client's drop of 6 came before it
    assert (second["fork_turn"], second["boundary"], second["open_cursors"]) == (2, 8, [7])
    hand, _, _, want = by_hand(engine, tmp_path / "h2", acks, [T0, tool_then_user, no_reply(two_tools)])
    assert second["fork_key"] == hand.history_key() and second["text"] == want.text and want.del_cursors == [7]


def _message_ranges(records: list[dict]) -> list[tuple[int, int]]:
    from kvsteward.serve.server.store import message_ranges_of

    return message_ranges_of([op for r in records[1:] for op in r["ops"]])


def test_aux_runs_in_idle_time_and_yields_to_a_main_request(engine, tmp_path):
    app = make_app(engine, tmp_path / "a")
    sched = app.state.scheduler
    c = TestClient(app)
    store = app.state.store
    sid_a, sid_b = (c.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
    turn(c, sid_b, TURNS[0])
    acks = [turn(c, sid_a, body) for body in TURNS[:2]]
    store.worker.wait_idle(60)
    sched.events = []
    window: dict[str, float] = {}
    main_reply: dict = {}

    def main_request():
        window["start"] = time.perf_counter()
        main_reply.update(store.run_turn(sid_b, tool_turn(3, max_tokens=8)))

    def hook(sid, step):
        if step == 1 and "start" not in window:  # the aux has prefilled the trigger on its fork: it is mid-run
            threading.Thread(target=main_request).start()
            while sched.main_active == 0:
                time.sleep(0.001)

    store.worker.step_hook = hook
    acks.append(turn(c, sid_a, TURNS[2]))  # forked after tool 5; the aux is submitted when this answer is ready
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
    assert len(before) == 1  # the trigger prefill ran before the main request arrived (the fork, in the turn)
    assert after and len(before) + len(after) == len(aux_ev)  # nothing in between: it yielded, then resumed
    assert app.state.metrics.aux_preemptions._value.get() >= 1
    # the interrupted decision is the undisturbed one, and the main request's answer is that of an aux-less server
    rec = live(app, sid_a)
    _, _, _, want = by_hand(engine, tmp_path / "h", acks, TURNS[:2] + [no_reply(TURNS[2])])
    assert rec.aux_pending["text"] == want.text and rec.aux_pending["del_cursors"] == want.del_cursors == [3, 5]
    plain = TestClient(make_app(engine, tmp_path / "b", aux=None))
    sid = plain.post("/v1/sessions", json={}).json()["id"]
    turn(plain, sid, TURNS[0])
    assert turn(plain, sid, tool_turn(3, max_tokens=8))["history_key"] == main_reply["history_key"]


def test_racing_turns_never_see_half_an_aux_drop(engine, tmp_path):
    """Every turn fired without any tool time: aux decisions land at arbitrary moments. Whatever the timing, each
    applied decision is one drop of whole messages before the turn's own ops, and the states equal the same turns
    with those drops made by hand."""
    app = make_app(engine, tmp_path / "a", aux=AuxConfig(every=1, max_tokens=16, use_adapter=False,
                                                                 keep_unread=False))
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
    for a in acks:  # every fork was taken right after a tool response, before that turn's reply
        if a["aux"]:
            turn_ack = acks[a["aux"]["fork_turn"]]
            assert a["aux"]["boundary"] == turn_ack["n_messages"] - 1
            assert a["aux"]["fork_key"] != turn_ack["history_key"]
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
    for option in ["--adapter", "--aux-every", "--aux-base", "--valkey-url", "--host-tier-bytes", "--aux-max-wait",
                   "--spill-tier", "--aux-close-bias", "--aux-delete-unread", "--aux-context"]:
        assert option in out.output
    for flags in (["--aux-every", "2"], ["--aux-max-wait", "1"], ["--aux-close-bias", "2"],
                  ["--aux-delete-unread"], ["--aux-context", "first"]):
        bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), *flags])
        assert bad.exit_code != 0 and "needs a manager" in bad.output
    bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), "--spill-tier", "valkey"])
    assert bad.exit_code != 0 and "--spill-tier must be" in bad.output
    bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), "--aux-base", "--aux-context", "task"])
    assert bad.exit_code != 0 and "--aux-context must be one of full, first" in bad.output
    bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), "--aux-base", "--aux-head-tokens", "-1"])
    assert bad.exit_code != 0 and "--aux-head-tokens must be >= 0" in bad.output


def test_serve_cli_sets_the_aux_head_cache(tiny_folder, tmp_path, monkeypatch):
    """`--aux-head-tokens` is the engine's cap on kept first-message prefills (0: none kept)."""
    import uvicorn
    from typer.testing import CliRunner

    import kvsteward.serve.server.api as api
    from kvsteward.pipelines.cli import app

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # the app is not served: only its setup is read
    monkeypatch.setattr(api, "create_app", lambda engine, config: seen.update(engine=engine))
    args = ["serve", "--model", str(tiny_folder), "--aux-base", "--data-dir", str(tmp_path)]
    assert CliRunner().invoke(app, args).exit_code == 0 and seen.pop("engine").aux_head_tokens == 8192
    assert CliRunner().invoke(app, [*args, "--aux-head-tokens", "0"]).exit_code == 0
    assert seen.pop("engine").aux_head_tokens == 0


def test_bench_aux_plumbing(engine):
    from kvsteward.serve.bench.checks import bench_aux

    # gap: the agent's tool time, in which the aux decodes; long enough that a loaded CPU still finishes calls
    out = bench_aux(engine, turns=4, every=1, gap=0.2, max_tokens=2, aux_max_tokens=8)
    for key in ["main_latency_ratio_on_over_off", "mean_main_turn_s_on", "mean_main_turn_s_off", "aux_decisions",
                "aux_preemptions", "aux_deleted_cursors", "turns", "identical_sessions"]:
        assert key in out
    assert out["turns"] == 4 and out["identical_sessions"] is True and out["aux_errors"] == 0
    assert out["aux_decisions"] >= 2 and out["aux_deleted_cursors"] >= 1  # this model deletes every open cursor
    assert out["main_latency_ratio_on_over_off"] > 0
    assert out["aux_forks"] >= out["aux_decisions"] and 0 < out["aux_fork_max_s"] < 1  # forks: in main turns
    # the confidence rule in the same bench: this model lists every read cursor with certainty, so the same drops
    conf = bench_aux(engine, turns=4, every=1, gap=0.2, max_tokens=2, aux_max_tokens=8, min_confidence=0.9)
    assert conf["aux_min_confidence"] == 0.9 and conf["identical_sessions"] is True and conf["aux_errors"] == 0
    assert conf["aux_deleted_cursors"] == out["aux_deleted_cursors"]


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
    app = make_app(peft, tmp_path / "peft", aux=AuxConfig(every=2, max_tokens=16, use_adapter=True,
                                                                    keep_unread=False))
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    got = [turn(c, sid, body) for body in TURNS[:3]]
    assert app.state.store.worker.wait_idle(60)
    rec = live(app, sid)
    hand_turns = TURNS[:2] + [no_reply(TURNS[2])]
    hand, msgs, opened, with_adapter = by_hand(peft, tmp_path / "h", got, hand_turns, use_adapter=True)
    without = run_aux(hand, tok, msgs, opened, max_tokens=16, use_adapter=False)
    assert opened == [3, 5] and rec.aux_pending["fork_key"] == hand.history_key()
    assert rec.aux_pending["text"] == with_adapter.text != without.text
    for a, b in zip(got, want, strict=True):  # the main thread never ran the adapter
        assert a["reply"] == b["reply"] and a["history_key"] == b["history_key"]


def _traffic(sched, seconds: float, forward_s: float = 0.01) -> tuple[int, list[float]]:
    """Constant main traffic for `seconds`: one registered request doing back-to-back forwards, while an aux thread
    asks for steps of the same length. Returns (aux steps run, main forward start gaps)."""
    import threading
    import time

    stop = threading.Event()
    aux_steps = []

    def aux():
        while not stop.is_set():
            with sched.aux_step():
                if stop.is_set():
                    break
                time.sleep(forward_s)
                aux_steps.append(time.monotonic())

    t = threading.Thread(target=aux, daemon=True)
    starts = []
    with sched.main():
        t.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with sched:
                starts.append(time.monotonic())
                time.sleep(forward_s)
        stop.set()
    t.join(timeout=5)
    return len(aux_steps), [b - a for a, b in zip(starts, starts[1:], strict=False)]


def test_aux_starvation_bound_under_constant_traffic():
    from kvsteward.serve.manager.worker import Scheduler

    starved, _ = _traffic(Scheduler(), 0.6)
    assert starved == 0  # default: the aux runs only in idle time, so constant traffic starves it
    sched = Scheduler(max_aux_wait=0.1)
    n, gaps = _traffic(sched, 1.0)
    assert 4 <= n <= 11 and sched.starved_steps == n  # about one aux forward per 0.1 s, each between main forwards
    assert sorted(gaps)[len(gaps) // 2] < 0.05  # a typical main forward waited for nothing (at most one aux step)
    with pytest.raises(ValueError, match="max_aux_wait"):
        Scheduler(max_aux_wait=-1)
