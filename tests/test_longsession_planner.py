"""Long-session planners: the plans they make, their edge metrics against the oracle, and the runner following a
planner's plan instead of the oracle's."""

from __future__ import annotations

import bisect

import pytest

from kvsteward.eval.longsession import runner as ls
from kvsteward.serve.server.testing import tiny_chat_engine
from kvsteward.synth.longsession import planner as lp
from kvsteward.synth.longsession.generate import generate_sessions
from kvsteward.synth.longsession.schema import Message, Probe, Session, ensure_layout


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=1)


@pytest.fixture(scope="module")
def sessions(engine):
    return generate_sessions(engine.tokenizer, 2, 2400, [600], seed=5)


def _widened(sess: Session) -> list[dict]:
    """Independent reference: each fact span of the layout's blueprint widened to the message holding it (found by
    token offset), the readers of one message's spans united."""
    offsets = sess.layout.message_offsets
    readers: dict[int, set[int]] = {}
    for entry in sess.layout.blueprint:
        m = bisect.bisect_right(offsets, entry["span"][0]) - 1
        readers.setdefault(m, set()).update(entry["readers"])
    return [{"span": [offsets[m], offsets[m + 1]], "readers": sorted(r)} for m, r in sorted(readers.items())]


def test_oracle_reads_give_the_oracle_message_blueprint(sessions):
    for sess in sessions:
        assert lp.blueprint_of(sess, lp.oracle_reads(sess)) == _widened(sess) == ls.plan_of(sess, "messages")
    got = lp.score(sessions, [lp.oracle_reads(s) for s in sessions])
    assert got["edge_recall"] == got["edge_precision"] == got["fact_edge_recall"] == 1.0
    assert got["oracle_edges"] == got["predicted_edges"] > 0


def test_previous_planner_names_the_last_message_and_misses_every_definition(sessions):
    sess = sessions[0]
    reads = lp.previous_reads(sess)
    assert set(reads) == {p.id for p in sess.probes}
    assert all(r == [len(sess.messages) - 1] for r in reads.values())
    got = lp.score(sessions, [lp.previous_reads(s) for s in sessions])
    assert got["edge_recall"] == 0.0 and got["predicted_edges"] == sum(len(s.probes) for s in sessions)


def _hand_session(tok) -> Session:
    """Hand-worked: the probe names PELICAN_LIMIT, which only message 2 defines; message 3 shares common words."""
    msgs = [Message(role="system", content="You are a coding assistant."),
            Message(role="user", content="Some source: def parse(line): return line.split(',') # parse the line"),
            Message(role="user", content='Constants: PELICAN_LIMIT = Decimal("7.25") and the GULL_MODE flag.'),
            Message(role="user", content="More source: def render(value): return str(value) # render the value"),
            Message(role="assistant", content="Noted.")]
    probe = Probe(id="fact:limit", kind="fact", messages=[Message(role="user", content="What is PELICAN_LIMIT?")],
                  answer_prefix='PELICAN_LIMIT = Decimal("', gold="7.25", needs=[])
    return ensure_layout(Session(id="hand", seed=0, length=100, distance=0, messages=msgs, definition_steps=[[2]],
                                 probes=[probe]), tok)


def test_lexical_planner_finds_the_message_that_defines_the_named_identifier(engine):
    sess = _hand_session(engine.tokenizer)
    assert lp.lexical_reads(sess) == {"fact:limit": [2]}
    bp = lp.blueprint_of(sess, lp.lexical_reads(sess))
    offsets = sess.layout.message_offsets
    assert bp == [{"span": [offsets[2], offsets[3]], "readers": [5, 6]}]  # the probe's question and answer steps


def test_lexical_planner_reads_nothing_of_the_generators_record(sessions):
    """The same messages and probes with `regions` and `needs` removed: the same plan."""
    for sess in sessions:
        blind = sess.model_copy(update={"regions": [], "facts": {},
                                        "probes": [p.model_copy(update={"needs": []}) for p in sess.probes]})
        assert lp.lexical_reads(blind) == lp.lexical_reads(sess)
        assert lp.lexical_reads(sess)  # it does name messages


def test_lexical_ratio_is_checked(sessions):
    with pytest.raises(ValueError, match="ratio"):
        lp.lexical_reads(sessions[0], 0)


def test_llm_planner_prompt_parse_and_failures(sessions):
    sess = sessions[0]
    seen = []
    replies = iter(["1, 3 and 999", "none"] + ["2"] * 10)

    def complete(messages, prefix):
        seen.append((messages, prefix))
        return next(replies)

    planner = lp.LLMSessionPlanner(complete, message_chars=50)
    reads, failures = planner.reads(sess)
    first = sess.probes[0]
    assert reads[first.id] == [1, 3]  # 999 is no message; the system prompt (0) is never a candidate
    assert sess.probes[1].id not in reads and failures == 1
    user = seen[0][0][1]["content"]
    assert "[message 1]" in user and "[message 0]" not in user and first.messages[0].content[:30] in user
    assert all(len(line) <= 50 + len("[message 99] ") for line in user.splitlines() if line.startswith("[message"))


def test_plan_sessions_checks_its_planner(sessions):
    with pytest.raises(ValueError, match="unknown planner"):
        lp.plan_sessions(sessions, "psychic")
    with pytest.raises(ValueError, match="needs a model"):
        lp.plan_sessions(sessions, "llm")


def test_blueprint_of_refuses_a_plan_outside_the_session(sessions):
    with pytest.raises(ValueError, match="unknown probe"):
        lp.blueprint_of(sessions[0], {"fact:nope": [1]})
    with pytest.raises(ValueError, match="outside the context"):
        lp.blueprint_of(sessions[0], {sessions[0].probes[0].id: [10_000]})


def test_run_config_needs_message_granularity_for_a_planner():
    with pytest.raises(ValueError, match="--blueprint messages"):
        ls.RunConfig(planner="lexical")
    with pytest.raises(ValueError, match="planner must be one of"):
        ls.RunConfig(planner="psychic", blueprint="messages")


def test_runner_follows_the_planners_plan(engine, sessions, tmp_path, result_text):
    """A planner whose plan is the oracle's gives exactly the oracle run; another plan changes what pace keeps; a
    planner run without plans is refused; its journal is not mixed with an oracle run's."""
    base = dict(arms=("pace",), budget=128, chunk=64, limit=512, code=False, max_fact_tokens=4, max_recall_tokens=4,
                blueprint="messages")
    oracle = ls.run(engine, sessions, ls.RunConfig(**base))
    cfg = ls.RunConfig(**base, planner="lexical")
    as_oracle = {s.id: lp.blueprint_of(s, lp.oracle_reads(s)) for s in sessions}
    assert result_text(ls.run(engine, sessions, cfg, plans=as_oracle)) == result_text(oracle)

    previous = {s.id: lp.blueprint_of(s, lp.previous_reads(s)) for s in sessions}
    got = ls.run(engine, sessions, cfg, plans=previous)
    assert got["arms"]["pace"]["by_distance"]["600"]["residency"] < \
        oracle["arms"]["pace"]["by_distance"]["600"]["residency"]

    with pytest.raises(ValueError, match="needs its plan"):
        ls.run(engine, sessions, cfg, plans={})
    journal = tmp_path / ls.JOURNAL
    ls.run(engine, sessions[:1], cfg, plans=previous, journal=journal)
    with pytest.raises(ValueError, match="written with config"):
        ls.run(engine, sessions[:1], ls.RunConfig(**base), journal=journal)
