"""The learned planner inside the server (`--aux-plan`): at each aux fork the same thread runs `Planning mode` on the
boundary state and decodes `{"plan": [...]}` under a grammar (always well-formed; only a spent token budget leaves it
unfinished); a valid plan becomes the session's blueprint at the next turn (each planned cursor's whole message, its
reader steps), so a foresight arm keeps those spans; the blueprint is persisted and replayed exactly; an invalid plan
changes nothing and is counted."""

from __future__ import annotations

import json
import random

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.engine.blueprint import PlannedSpan
from kvsteward.serve.manager.decode import _candidates
from kvsteward.serve.manager.planner import PLAN_HORIZON, PLAN_PREFIX, PlanError, PlanGrammar, parse_plan, run_plan
from kvsteward.serve.manager.thread import open_cursors
from kvsteward.serve.manager.worker import AuxConfig
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.store import RebuildError
from kvsteward.serve.server.testing import live, tiny_chat_engine, turn
from kvsteward.synth.traces.hindsight import plan_target, target_text
from kvsteward.synth.traces.trace import Trace

torch.set_num_threads(1)

T0 = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find X."}],
      "max_tokens": 3}


def tool_turn(i: int, text: str = "result text " * 6, max_tokens: int = 3) -> dict:
    return {"messages": [{"role": "tool", "content": f"[cursor {i}] {text}"}], "max_tokens": max_tokens}


# messages: 0 system, 1 user, 2 reply, 3 tool, 4 reply, 5 tool (fork: every=2), 6 reply, 7 tool, 8 reply, ...
TURNS = [T0, tool_turn(3), tool_turn(5), tool_turn(7), tool_turn(9), tool_turn(11),
         {"messages": [{"role": "user", "content": "Answer now."}], "max_tokens": 4}]
PLAN = {"every": 2, "max_tokens": 16, "use_adapter": False, "plan": True}


def biased_engine(seed: int, sign: float | None):
    """A tiny random model; `sign` +1: tokens with `]` win (every deletion list closes at once: nothing is dropped),
    -1: they lose (no list can ever close: every plan decode runs out of budget), None: no bias."""
    e = tiny_chat_engine(seed=seed)
    if sign is not None:
        ids, texts = _candidates(e.tokenizer)
        bias = torch.zeros(e.vocab_size)
        bias[[i for i, t in zip(ids, texts, strict=True) if "]" in t]] = sign * 1e4
        e.model.lm_head.register_forward_hook(lambda m, inp, out: out + bias)
    return e


@pytest.fixture(scope="module")
def keeper():
    return biased_engine(3, +1.0)


def make_app(engine, path, aux: dict | None = PLAN, hook=None, **kw):
    app = create_app(engine, ServerConfig(data_dir=path, aux=None if aux is None else AuxConfig(**aux), **kw))
    if hook is not None:
        app.state.store.worker.plan_hook = hook
    return app


def play(app, spec: dict, turns: list[dict]) -> tuple[str, list[dict]]:
    """Create a session and run `turns`, letting the aux worker finish after each (a deterministic schedule)."""
    c = TestClient(app)
    sid = c.post("/v1/sessions", json=spec).json()["id"]
    acks = []
    for body in turns:
        acks.append(turn(c, sid, body))
        if app.state.store.worker is not None:
            assert app.state.store.worker.wait_idle(120)
    return sid, acks


def records(path, sid) -> list[dict]:
    """The create and turn records of a session log (aux decision records left out)."""
    lines = (path / "sessions" / f"{sid}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] != "aux"]


def counters(app) -> tuple[float, float, float]:
    m = app.state.metrics.aux_plan
    return m.decisions._value.get(), m.parse_failures._value.get(), m.spans._value.get()


def message_span(history: list[dict], j: int) -> tuple[int, int]:
    """Message j's logical token range, counted by hand from the append ops (step = message index)."""
    start = sum(len(op["tokens"]) for op in history if op["op"] == "append" and op["step"] < j)
    return start, start + sum(len(op["tokens"]) for op in history if op["op"] == "append" and op["step"] == j)


def resident_of(session, span: tuple[int, int]) -> int:
    res = set(session.resident_logical().tolist())
    return sum(i in res for i in range(*span))


# -- the grammar and the strict parser --------------------------------------------------------------------------------
def test_plan_grammar_is_the_training_target_language():
    g = PlanGrammar([3, 5, 9], boundary=12)
    done = PlanGrammar.done

    def tail(text: str) -> str:
        assert text.startswith(PLAN_PREFIX)
        return text[len(PLAN_PREFIX):]

    # the exact text `synth.traces.hindsight` trains on is in the language, every prefix of it is a live prefix
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for i in range(3, 16):
        msgs.append({"role": "tool", "content": f"[cursor {i}] r"} if i in (3, 5, 9) else
                    {"role": "assistant", "content": "a"})
    trace = Trace("t", "train", msgs, {13: [3, 9], 15: [9], 14: [3]})
    target = target_text(plan_target([3, 5, 9], trace, 12))
    assert target == '{"plan": [{"cursor": 3, "readers": [13, 14]}, {"cursor": 9, "readers": [13, 15]}]}'
    t = tail(target)
    assert all(g.feed(g.start(), t[:k]) is not None for k in range(len(t) + 1)) and done(g.feed(g.start(), t))
    assert parse_plan(target, [3, 5, 9], 12) == [{"cursor": 3, "readers": [13, 14]}, {"cursor": 9, "readers": [13, 15]}]
    assert done(g.feed(g.start(), " []}")) and parse_plan(PLAN_PREFIX + " []}", [3], 12) == []
    assert g.feed(g.start(), '{"cursor": 5') is None  # the list's bracket comes first
    assert g.feed(g.start(), ' [{"cursor": 5, "readers": [14, 13') is not None  # 13 may still become 130..139
    for bad in ['{"cursor": 4', '{"cursor": 5, "readers": []', '{"cursor": 5, "readers": [11]',  # 4 not open; empty
                '{"cursor": 5, "readers": [013', '{"cursor": 9, "readers": [13]}, {"cursor": 3',  # leading 0; order
                '{"cursor": 5, "readers": [14, 13]', '{"cursor": 5, "readers": [14, 14]',  # readers ascend
                '{"cursor": 9, "readers": [13]}, ', '{"cursor": 5, "readers": [13]}]} ',  # no cursor > 9; trailing
                '{"cursor":5', f'{{"cursor": 5, "readers": [{12 + PLAN_HORIZON}']:  # spacing; beyond the horizon
        assert g.feed(g.start(), " [" + bad) is None, bad
    assert PlanGrammar([], 12).feed(("start",), "{") is None  # nothing open: only the empty plan

    # no dead ends: random walks over the characters the grammar admits always close, and parse strictly
    rng = random.Random(0)
    alphabet = sorted(set("0123456789, ]}{[\":cursoread"))
    for _ in range(300):
        st, text = g.start(), ""
        while not done(st):
            options = [ch for ch in alphabet if g.feed(st, ch) is not None]
            assert options, text
            ch = "]" if "]" in options and rng.random() < 0.15 else rng.choice(options)
            st, text = g.feed(st, ch), text + ch
        plan = parse_plan(PLAN_PREFIX + text, [3, 5, 9], 12)
        assert json.dumps({"plan": plan}) == PLAN_PREFIX + text  # canonical: exactly what json.dumps writes

    for bad in ["", "{", '{"plan": 3}', '{"plan": [], "x": 1}', '{"plan": [{"cursor": 3}]}',
                '{"plan": [{"cursor": 4, "readers": [13]}]}', '{"plan": [{"cursor": 3, "readers": [11]}]}',
                '{"plan": [{"cursor": 3, "readers": []}]}', '{"plan": [{"cursor": 3, "readers": [13, 13]}]}',
                '{"plan": [{"cursor": true, "readers": [13]}]}', '{"plan": [{"cursor": 3, "readers": [13.0]}]}',
                '{"plan": [{"cursor": 3, "readers": [13]}, {"cursor": 3, "readers": [14]}]}']:
        with pytest.raises(PlanError):
            parse_plan(bad, [3, 5, 9], 12)


# -- the real decode in the server ------------------------------------------------------------------------------------
def test_server_plan_is_the_by_hand_decode_and_becomes_the_blueprint(tmp_path):
    """Seed 5 (no bias) happens to emit a valid, non-empty plan at the first boundary and to delete nothing there."""
    engine = biased_engine(5, None)
    spec = {"policy": "retention-only", "budget": 80}
    app = make_app(engine, tmp_path / "a")
    sid, acks = play(app, spec, TURNS[:3])
    pending = dict(live(app, sid).aux_pending)
    assert (pending["boundary"], pending["open_cursors"], pending["del_cursors"]) == (6, [3, 5], [])
    # by hand: an aux-less server plays the turns up to the boundary's tool message (no reply), then the planner
    hand_app = make_app(engine, tmp_path / "h", aux=None)
    hsid, _ = play(hand_app, spec, TURNS[:2] + [{"messages": TURNS[2]["messages"], "generate": False}])
    hand = live(hand_app, hsid)
    assert pending["fork_key"] == hand.session.history_key()
    want = run_plan(hand.session, engine.tokenizer, hand.messages, open_cursors(hand.messages, hand.dropped),
                    max_tokens=128, use_adapter=False)
    assert pending["plan"] == want.as_json()
    assert want.plan and not want.truncated, f"seed 5 no longer plans: {want}"  # the test needs a real plan
    assert counters(app) == (1, 0, 0)

    # the next turn installs it: one span per planned cursor, its whole message, its readers
    acks.append(turn(TestClient(app), sid, TURNS[3]))
    rec = live(app, sid)
    session = rec.session
    by_hand = tuple(PlannedSpan(*message_span(session.history, e["cursor"]), tuple(e["readers"])) for e in want.plan)
    assert tuple(session.config.blueprint) == rec.blueprint == by_hand
    log = records(tmp_path / "a", sid)
    assert log[4]["blueprint"] == [{"span": [s.start, s.end], "readers": list(s.readers)} for s in by_hand]
    assert all("blueprint" not in r for r in log[1:4]) and log[4]["aux"]["plan"] == want.as_json()
    assert counters(app) == (1, 0, len(want.plan))
    state = TestClient(app).get(f"/v1/sessions/{sid}").json()
    assert state["blueprint"] == log[4]["blueprint"]

    # a restart rebuilds the same state (history, logits, blueprint)
    again = make_app(engine, tmp_path / "a", tiers=False)
    assert TestClient(again).get(f"/v1/sessions/{sid}").json() == {**state, "aux_pending": False}
    rebuilt = live(again, sid).session
    assert rebuilt.history == session.history and torch.equal(rebuilt.last_logits, session.last_logits)
    assert rebuilt.config.blueprint == session.config.blueprint


def test_truncated_real_plan_is_a_counted_parse_failure_and_changes_nothing(tmp_path):
    """With `]` banned no plan can close: the real decode always spends its budget. Its text is still a live prefix of
    the grammar (well-formed so far), it equals the by-hand decode, it is counted, and nothing is installed."""
    engine = biased_engine(3, -1.0)
    spec = {"policy": "retention-only", "budget": 80}
    aux = {**PLAN, "plan_max_tokens": 12}
    app = make_app(engine, tmp_path / "a", aux=aux)
    sid, acks = play(app, spec, TURNS[:3])
    plan = live(app, sid).aux_pending["plan"]
    assert plan["plan"] is None and plan["truncated"] and plan["tokens"] == 12
    g = PlanGrammar([3, 5], 6)
    assert plan["text"].startswith(PLAN_PREFIX) and g.feed(g.start(), plan["text"][len(PLAN_PREFIX):]) is not None
    hand_app = make_app(engine, tmp_path / "h", aux=None)
    hsid, _ = play(hand_app, spec, TURNS[:2] + [{"messages": TURNS[2]["messages"], "generate": False}])
    hand = live(hand_app, hsid)
    assert run_plan(hand.session, engine.tokenizer, hand.messages, [3, 5], 12, use_adapter=False).as_json() == plan
    acks += [turn(TestClient(app), sid, body) for body in TURNS[3:5]]
    assert app.state.store.worker.wait_idle(120)
    assert counters(app) == (2, 2, 0)
    assert live(app, sid).session.config.blueprint == [] and live(app, sid).blueprint is None
    assert all("blueprint" not in r for r in records(tmp_path / "a", sid)[1:])


# -- the blueprint at work (a deterministic fake planner through the test hook) ---------------------------------------
FAKE = '{"plan": [{"cursor": 3, "readers": [40]}]}'


def test_planned_span_stays_resident_and_restart_replays_the_blueprint(keeper, tmp_path):
    """A `retention-only` session with B = 100 (sinks + 64 recent tokens protected): with the plan, tool message 3
    (readers [40]) stays whole; the same session without a plan (the same aux deletions: none) evicts part of it."""
    spec = {"policy": "retention-only", "budget": 100}
    app = make_app(keeper, tmp_path / "a", hook=lambda job: FAKE)
    sid, acks = play(app, spec, TURNS)
    off = make_app(keeper, tmp_path / "off", aux={**PLAN, "plan": False})
    osid, oacks = play(off, spec, TURNS)
    assert all(not (a["aux"] or {}).get("dropped") for a in acks + oacks)  # this engine's manager deletes nothing
    rec, plain = live(app, sid), live(off, osid)
    span = message_span(rec.session.history, 3)
    assert message_span(plain.session.history, 3) == span and span[1] - span[0] > 10
    assert tuple(rec.session.config.blueprint) == (PlannedSpan(*span, (40,)),)
    assert resident_of(rec.session, span) == span[1] - span[0]  # kept whole
    assert resident_of(plain.session, span) < span[1] - span[0]  # partly evicted without the plan
    # identical up to the turn that installs the plan (forked at turn 2, installed at turn 3), different after it
    keys, okeys = [a["history_key"] for a in acks], [a["history_key"] for a in oacks]
    assert keys[:3] == okeys[:3] and keys[3] != okeys[3]
    assert counters(app) == (2, 0, 2)  # forks at tools 5 and 9; both plans installed (turns 3 and 5)

    # a restart replays the blueprint exactly: same history and next-token logits as the uninterrupted server
    again = make_app(keeper, tmp_path / "a", tiers=False)
    rebuilt = live(again, sid).session
    assert rebuilt.history == rec.session.history and torch.equal(rebuilt.last_logits, rec.session.last_logits)
    assert rebuilt.config.blueprint == rec.session.config.blueprint
    # ... and it needs the persisted blueprint: without it the replay's evictions diverge and the rebuild refuses
    path = tmp_path / "a" / "sessions" / f"{sid}.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "blueprint"}) + "\n"
                            for r in records(tmp_path / "a", sid)))
    with pytest.raises(RebuildError, match="diverged"):
        live(make_app(keeper, tmp_path / "a", tiers=False), sid)

    # a session unloaded to the storage tiers after every request comes back with its blueprint
    tiered = make_app(keeper, tmp_path / "t", hook=lambda job: FAKE, session_bytes=1)
    tsid, tacks = play(tiered, spec, TURNS)
    restores = [s.value for m in tiered.state.metrics.tier_restores.collect() for s in m.samples
                if s.name.endswith("_total")]
    assert sum(restores) >= len(TURNS) - 1  # every turn after the first came back from a tier
    assert [a["history_key"] for a in tacks] == keys
    trec = tiered.state.store.acquire(tsid)  # (releasing it unloads it again)
    try:
        assert torch.equal(trec.session.last_logits, rec.session.last_logits)
        assert trec.session.config.blueprint == rec.session.config.blueprint
    finally:
        tiered.state.store.release(trec)


def test_invalid_plans_change_nothing_and_are_counted(keeper, tmp_path):
    """Invalid plans (not JSON, a cursor that is not open, a reader in the past, one good entry next to a bad one) are
    ignored whole: no blueprint, the same states as the server without a planner, every one counted."""
    spec = {"policy": "retention-only", "budget": 100}
    bad = iter(['{"plan": [{"cursor": 3, "readers": [40]}',  # unclosed
                '{"plan": [{"cursor": 3, "readers": [40]}, {"cursor": 4, "readers": [40]}]}',  # 4: not a tool
                '{"plan": [{"cursor": 3, "readers": [2]}]}'])  # a reader before the boundary
    texts = []

    def hook(job):
        texts.append(next(bad))
        return texts[-1]

    turns = TURNS + [tool_turn(13), tool_turn(15)]
    app = make_app(keeper, tmp_path / "a", hook=hook)
    sid, acks = play(app, spec, turns)
    off = make_app(keeper, tmp_path / "off", aux={**PLAN, "plan": False})
    _, oacks = play(off, spec, turns)
    assert len(texts) == 3 and counters(app) == (3, 3, 0)
    assert [a["history_key"] for a in acks] == [a["history_key"] for a in oacks]
    assert live(app, sid).session.config.blueprint == [] and live(app, sid).blueprint is None
    applied = [a["aux"]["plan"] for a in acks if a["aux"]]
    assert [p["text"] for p in applied] == texts and all(p["plan"] is None and p["error"] for p in applied)
    assert all("blueprint" not in r for r in records(tmp_path / "a", sid)[1:])


def test_serve_cli_aux_plan_flags(tmp_path):
    import typer
    from typer.testing import CliRunner

    from kvsteward.pipelines import cli_serve

    root = typer.Typer()
    root.add_typer(cli_serve.app, name="serve")
    root.command()(lambda: None)
    out = CliRunner().invoke(root, ["serve", "--help"])
    assert "--aux-plan" in out.output and "--aux-plan-max-tokens" in out.output
    bad = CliRunner().invoke(root, ["serve", "--model", str(tmp_path), "--aux-plan"])
    assert bad.exit_code != 0 and "needs a planner" in bad.output
