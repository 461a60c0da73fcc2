"""The operations session domain: layout, determinism, fact isolation, prose filler (SmolLM2 tokenizer only)."""

from __future__ import annotations

import re

import pytest

from kvsteward.serve.engine.blueprint import parse_blueprint
from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.longsession.generate import generate_session, generate_sessions
from kvsteward.synth.longsession.ops import OPS_FACT_KINDS, make_ops_spec, ops_probes
from kvsteward.synth.longsession.prose_filler import docstrings_of, prose_stream, reference_topics

LENGTH, DISTANCES = 6000, [400, 4500]


@pytest.fixture(scope="module")
def sessions(tok):
    return generate_sessions(tok, 2, LENGTH, DISTANCES, seed=5, domain="ops")


def _def_indices(s):
    return {i for step in s.definition_steps for i in step}


def _stream(tok, s):
    return [t for piece in message_token_ids(tok, [m.model_dump() for m in s.messages]) for t in piece]


def test_ids_length_distance_and_determinism(tok, sessions):
    assert [s.id.startswith("lsops") for s in sessions] == [True] * 4
    for s in sessions:
        n = len(_stream(tok, s))
        assert s.layout.n_tokens == n and abs(n - LENGTH) <= 0.05 * LENGTH
        assert s.distance - 300 <= s.layout.distance_tokens <= s.distance
    again = generate_session(tok, sessions[1].seed, LENGTH, DISTANCES[1], domain="ops")
    assert again.model_dump() == sessions[1].model_dump()


def test_facts_appear_only_in_definition_messages(sessions):
    for s in sessions:
        defs = " ".join(s.messages[i].content for i in _def_indices(s))
        others = [m.content for i, m in enumerate(s.messages) if i not in _def_indices(s)]
        others += [m.content for p in s.probes for m in p.messages] + [p.answer_prefix for p in s.probes]
        for secret in make_ops_spec(s.seed).secrets():
            assert secret in defs, secret
            word = re.compile(r"(?<![\w.-])" + re.escape(secret) + r"(?![\w-])", re.IGNORECASE)
            assert not any(word.search(o) for o in others), secret


def test_each_fact_probe_answer_is_a_line_of_its_definition(tok, sessions):
    """The answer prefix plus the gold is written verbatim in the definitions; the needed span holds it; the
    oracle blueprint reads it at the probe's question and answer steps."""
    for s in sessions:
        defs = "\n".join(s.messages[i].content for i in _def_indices(s))
        stream = _stream(tok, s)
        spans = parse_blueprint(s.layout.blueprint)
        for p in (p for p in s.probes if p.kind == "fact"):
            assert p.answer_prefix + p.gold in defs, p.id
            text = "".join(tok.decode(stream[a:b]) for a, b in s.layout.needed_spans[p.id])
            assert p.gold.strip() in text
            assert any({p.step, p.step + 1} <= set(sp.readers) for sp in spans), p.id
        recall = next(p for p in s.probes if p.kind == "recall")
        text = "".join(tok.decode(stream[a:b]) for a, b in s.layout.needed_spans[recall.id])
        assert all(r in text for r in recall.required)


def test_confusable_values_are_distinct(sessions):
    for seed in [s.seed for s in sessions] + list(range(50)):
        spec = make_ops_spec(seed)
        assert spec.primary_region != spec.failover_region and spec.drain_timeout_s != spec.cooldown_s


def test_filler_is_documentation_prose_not_code(sessions):
    topics = reference_topics()
    for s in sessions:
        for i, m in enumerate(s.messages):
            if i == 0 or i in _def_indices(s) or m.role != "user":
                continue
            name = re.search(r"`([^`]+)`:", m.content).group(1)
            assert name.startswith("reference/") or name.endswith(".py"), name
            body = m.content.split("\n\n", 1)[1]
            if name.startswith("reference/"):
                assert body.splitlines()[0] in topics[name.removeprefix("reference/")]
            assert "```" not in m.content and "def " not in body.split("\n")[0]


def test_fact_gold_tokenizes_as_its_own_continuation(tok):
    for seed in range(5):
        for p in ops_probes(make_ops_spec(seed), OPS_FACT_KINDS):
            if p.kind != "fact":
                continue
            whole = tok.encode(p.answer_prefix + p.gold, add_special_tokens=False)
            assert whole == tok.encode(p.answer_prefix, add_special_tokens=False) + tok.encode(
                p.gold, add_special_tokens=False), p.id


def test_docstrings_and_secret_filter_on_hand_made_input(tok):
    src = '"""Module doc."""\n\nclass Foo:\n    """Foo doc."""\n    def bar(self):\n        """Bar doc."""\n' \
          'def _hidden():\n    """not shown"""\n'
    assert docstrings_of(src) == "Module doc.\n\nFoo:\nFoo doc.\n\nFoo.bar:\nBar doc."
    assert docstrings_of("def (") == ""
    chunks = prose_stream(tok, 0, ["the"], chunk_tokens=200)
    for _ in range(5):
        assert re.search(r"(?<![\w.-])the(?![\w-])", next(chunks).text, re.IGNORECASE) is None


def test_unknown_domain_is_refused(tok):
    with pytest.raises(ValueError, match="unknown session domain"):
        generate_sessions(tok, 1, LENGTH, DISTANCES, seed=5, domain="cooking")
