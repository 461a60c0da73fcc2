"""The benchmark journal: finished (session, arm) pairs survive a kill, are not played again, and a partial sweep can
be reported. A tiny random model behind SmolLM2's tokenizer plays short generated sessions."""

from __future__ import annotations

import json

import pytest

from kvsteward.eval.longsession import runner as ls
from kvsteward.serve.server.testing import tiny_chat_engine
from kvsteward.synth.longsession.generate import generate_sessions


@pytest.fixture(scope="module")
def setup():
    engine = tiny_chat_engine(seed=1)
    sessions = generate_sessions(engine.tokenizer, 2, 1200, [300], seed=5)
    cfg = ls.RunConfig(arms=("h2o", "pace"), budget=128, chunk=64, limit=512, code=False, max_fact_tokens=4,
                       max_recall_tokens=4)
    return engine, sessions, cfg


def test_resume_plays_only_missing_pairs_and_equals_a_fresh_run(setup, tmp_path, monkeypatch, result_text):
    engine, sessions, cfg = setup
    journal = tmp_path / ls.JOURNAL
    fresh = ls.run(engine, sessions, cfg, journal=journal)
    lines = journal.read_text().splitlines()
    assert len(lines) == len(sessions) * len(cfg.arms)

    # Simulate a kill during the last pair: its line is torn. Resuming replays exactly that pair.
    journal.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    played = []
    real_play = ls.play
    monkeypatch.setattr(ls, "play", lambda e, s, a, c, **kw: played.append((s.id, a)) or real_play(e, s, a, c, **kw))
    resumed = ls.run(engine, sessions, cfg, journal=journal)
    last = json.loads(lines[-1])
    assert played == [(last["session"], last["arm"])]
    assert result_text(resumed) == result_text(fresh)
    assert resumed["paired"] == fresh["paired"]


class RecordingBar:
    def __init__(self):
        self.starts, self.advances, self.finishes = [], 0, 0

    def start(self, label: str, messages: int) -> None:
        self.starts.append((label, messages))

    def advance(self) -> None:
        self.advances += 1

    def finish(self) -> None:
        self.finishes += 1


def test_partial_report_uses_only_finished_pairs(setup, tmp_path):
    engine, sessions, cfg = setup
    journal = tmp_path / ls.JOURNAL
    bar = RecordingBar()
    ls.run(engine, sessions[:1], cfg, journal=journal, bar=bar)  # the progress bars: one per pair, per message
    n_msgs = len(sessions[0].messages)
    assert [m for _, m in bar.starts] == [n_msgs] * len(cfg.arms) and bar.advances == n_msgs * len(cfg.arms)
    assert bar.finishes == len(cfg.arms) and "pace" in bar.starts[-1][0]
    bar = RecordingBar()
    partial = ls.run(engine, sessions, cfg, journal=journal, play_missing=False, bar=bar)
    assert not bar.starts and bar.finishes == len(cfg.arms)  # journal pairs count, nothing is played
    n_facts = sum(1 for p in sessions[0].probes if p.kind == "fact")
    for arm in cfg.arms:
        assert sum(c["n"] for c in partial["arms"][arm]["by_distance"].values()) == n_facts
    assert sum(partial["paired"]["pace"][k] for k in ("better", "worse", "tied")) == n_facts


def test_journal_from_another_config_is_refused(setup, tmp_path):
    engine, sessions, cfg = setup
    journal = tmp_path / ls.JOURNAL
    ls.run(engine, sessions[:1], ls.RunConfig(**{**cfg.__dict__, "arms": ("h2o",)}), journal=journal)
    other = ls.RunConfig(**{**cfg.__dict__, "budget": 96})
    with pytest.raises(ValueError, match="written with config"):
        ls.run(engine, sessions, other, journal=journal)
    with pytest.raises(ValueError, match="no finished"):
        ls.run(engine, sessions, cfg, journal=tmp_path / "empty.jsonl", play_missing=False)
    # bfloat16 pairs are another experiment; float32 journals written before the option still read
    with pytest.raises(ValueError, match="written with config"):
        ls.run(engine, sessions, ls.RunConfig(**{**cfg.__dict__, "dtype": "bfloat16"}), journal=journal)
    assert "dtype" not in ls._journal_key(cfg)
    with pytest.raises(ValueError, match="dtype"):
        ls.RunConfig(dtype="float16")


def test_shards_play_disjoint_sessions_and_their_journals_report_as_one_sweep(setup, tmp_path, monkeypatch,
                                                                          result_text):
    engine, sessions, cfg = setup
    (tmp_path / "one").mkdir()
    fresh = ls.run(engine, sessions, cfg, journal=tmp_path / "one" / ls.JOURNAL)
    played = []
    real_play = ls.play
    monkeypatch.setattr(ls, "play", lambda e, s, a, c, **kw: played.append(s.id) or real_play(e, s, a, c, **kw))
    for i in range(2):
        ls.run(engine, ls.shard(sessions, i, 2), cfg, journal=tmp_path / ls.shard_journal(i, 2))
    assert sorted(played) == sorted(s.id for s in sessions for _ in cfg.arms)  # each pair played once, by one shard
    assert {p.name for p in tmp_path.glob("journal*.jsonl")} == {ls.shard_journal(0, 2), ls.shard_journal(1, 2)}
    merged = ls.run(engine, sessions, cfg, journal=tmp_path / ls.JOURNAL, play_missing=False)
    assert result_text(merged) == result_text(fresh) and merged["paired"] == fresh["paired"]
    with pytest.raises(ValueError, match="shard must be I/N"):
        ls.shard(sessions, 2, 2)


def test_message_granularity_widens_each_fact_to_its_message(setup, tmp_path):
    """`--blueprint messages`: every planned span is the whole message holding a needed fact (readers united), it
    covers the fact spans and holds more tokens; a pace run under it plays, and a journal of one granularity is
    not reused for the other."""
    engine, sessions, cfg = setup
    sess = sessions[0]
    facts, whole = ls.plan_of(sess, "facts"), ls.plan_of(sess, "messages")
    offsets = sess.layout.message_offsets
    for w in whole:  # a whole message: from one message offset to the next
        assert offsets.index(w["span"][1]) == offsets.index(w["span"][0]) + 1
    for f in facts:
        (w,) = [w for w in whole if w["span"][0] <= f["span"][0] and f["span"][1] <= w["span"][1]]
        assert set(f["readers"]) <= set(w["readers"])
    assert sum(b - a for a, b in (w["span"] for w in whole)) > sum(b - a for a, b in (f["span"] for f in facts))
    journal = tmp_path / ls.JOURNAL
    wide = ls.RunConfig(**{**cfg.__dict__, "arms": ("pace",), "budget": 384, "blueprint": "messages"})
    ls.run(engine, [sess], wide, journal=journal)
    with pytest.raises(ValueError, match="written with config"):
        ls.run(engine, [sess], ls.RunConfig(**{**wide.__dict__, "blueprint": "facts"}), journal=journal)
    with pytest.raises(ValueError, match="granularity"):
        ls.RunConfig(blueprint="lines")
