"""Long-session generator: layout, determinism, fact isolation, blueprint, hidden tests (SmolLM2 tokenizer only)."""

from __future__ import annotations

import re
import sysconfig
from decimal import Decimal
from pathlib import Path

import pytest

from kvsteward.eval.scoring import code_checks
from kvsteward.serve.engine.blueprint import parse_blueprint
from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.longsession.code_tests import reference_solution
from kvsteward.synth.longsession.defs import Spec, code_probes, make_spec
from kvsteward.synth.longsession.generate import generate_session, generate_sessions
from kvsteward.synth.longsession.schema import read_jsonl, write_jsonl
from kvsteward.synth.longsession.stdlib_filler import is_test_path, stdlib_files

LENGTH, DISTANCES = 6000, [400, 2500, 5000]


@pytest.fixture(scope="module")
def sessions(tok):
    return generate_sessions(tok, 2, LENGTH, DISTANCES, seed=3)


def _stream(tok, s):
    return [t for piece in message_token_ids(tok, [m.model_dump() for m in s.messages]) for t in piece]


def _def_indices(s):
    return {i for step in s.definition_steps for i in step}


def test_one_session_per_seed_and_distance(sessions):
    assert len(sessions) == 2 * len(DISTANCES)
    assert [s.distance for s in sessions] == DISTANCES * 2
    assert len({s.seed for s in sessions}) == 2


def test_deterministic_by_seed(tok, sessions):
    again = generate_sessions(tok, 1, LENGTH, DISTANCES[:1], seed=3)[0]
    assert again.model_dump_json() == sessions[0].model_dump_json()


def test_definitions_shared_across_distances_and_differ_across_seeds(sessions):
    def defs(s):
        return [s.messages[i].content for i in sorted(_def_indices(s))]

    a, b = sessions[: len(DISTANCES)], sessions[len(DISTANCES):]
    assert all(defs(s) == defs(a[0]) for s in a) and all(defs(s) == defs(b[0]) for s in b)
    assert defs(a[0]) != defs(b[0])
    assert make_spec(a[0].seed).fee_rate != make_spec(b[0].seed).fee_rate or \
        make_spec(a[0].seed).item != make_spec(b[0].seed).item


def test_facts_appear_only_in_definition_messages(sessions):
    for s in sessions:
        secrets = make_spec(s.seed).secrets()
        defs = " ".join(s.messages[i].content for i in _def_indices(s)).casefold()
        others = [m.content for i, m in enumerate(s.messages) if i not in _def_indices(s)]
        others += [m.content for p in s.probes for m in p.messages] + [p.answer_prefix for p in s.probes]
        for secret in secrets:
            assert secret.casefold() in defs, secret
            assert not any(secret.casefold() in o.casefold() for o in others), secret


def test_length_within_5_percent_and_layout_matches_the_chat_template(tok, sessions):
    for s in sessions:
        n = len(_stream(tok, s))
        assert s.layout.n_tokens == n
        assert abs(n - LENGTH) <= 0.05 * LENGTH


def test_distance_is_honoured(tok, sessions):
    for s in sessions:
        pieces = message_token_ids(tok, [m.model_dump() for m in s.messages])
        last_def = max(_def_indices(s))
        after = sum(len(p) for p in pieces[last_def + 1:])
        assert after == s.layout.distance_tokens
        assert s.distance - 300 <= after <= s.distance  # cut at a line boundary: well inside one 2K chunk


def test_blueprint_spans_are_the_facts_inside_definitions(tok, sessions):
    """Oracle blueprint at fact granularity: each span is one named fact, inside a definition message, read by
    exactly the probes that need it (question and answer steps)."""
    for s in sessions:
        stream = _stream(tok, s)
        spans = parse_blueprint(s.layout.blueprint)
        regions = {r.key: r for r in s.regions}
        assert len(spans) == len([r for r in s.regions if any(r.key in p.needs for p in s.probes)])
        def_ranges = [(a, b) for a, b in s.layout.definition_spans]
        for span, key in zip(spans, [r.key for r in s.regions if any(r.key in p.needs for p in s.probes)],
                             strict=True):
            assert any(a <= span.start and span.end <= b for a, b in def_ranges)
            region = regions[key]
            fact = s.messages[region.message].content[region.start:region.end]
            assert fact.strip() in tok.decode(stream[span.start:span.end])
            want = {st for p in s.probes if key in p.needs for st in (p.step, p.step + 1)}
            assert set(span.readers) == want
        # every probe reads at least one span, at its own step and its answer step
        for p in s.probes:
            assert any({p.step, p.step + 1} <= set(sp.readers) for sp in spans), p.id


def test_probe_steps_are_message_indices_when_played_in_order(sessions):
    s = sessions[0]
    assert [p.step for p in s.probes] == [len(s.messages) + 2 * k for k in range(len(s.probes))]
    kinds = [p.kind for p in s.probes]
    assert kinds.count("fact") >= 3 and "recall" in kinds and kinds.count("code") == 3


def test_needed_spans_hold_the_fact_values(tok, sessions):
    for s in sessions:
        stream = _stream(tok, s)
        for p in s.probes:
            text = "".join(tok.decode(stream[a:b]) for a, b in s.layout.needed_spans[p.id])
            if p.kind == "fact":
                assert p.gold.strip() in text and p.answer_prefix.strip().split()[0] in text
            if p.kind == "recall":
                assert all(r in text for r in p.required)


def test_filler_is_stdlib_source_never_tests(sessions):
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = 0
    for s in sessions:
        for i, m in enumerate(s.messages):
            if i in _def_indices(s) or m.role != "user":
                continue
            path = re.search(r"`([^`]+\.py)`", m.content).group(1)
            assert (root / path).is_file() and not is_test_path(path)
            assert not {"test", "tests", "idle_test"} & set(Path(path).parts)
            code = m.content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
            assert code in (root / path).read_text(encoding="utf-8")  # verbatim lines of that file
            seen += 1
    assert seen >= 4


def test_stdlib_file_list_excludes_tests():
    files = stdlib_files()
    assert len(files) > 300
    assert not [f for f in files if {"test", "tests", "idle_test"} & set(Path(f).parts)]
    assert all(is_test_path(p) for p in ["test/test_os.py", "idlelib/idle_test/test_calltip.py", "lib2to3/tests/x.py",
                                         "unittest/test/test_case.py", "ctypes/test/__init__.py", "test_x.py"])
    assert not any(is_test_path(p) for p in ["doctest.py", "unittest/case.py", "json/decoder.py"])


def test_jsonl_roundtrip_and_layout_recomputed_for_another_tokenizer(tok, sessions, tmp_path):
    path = write_jsonl(sessions[:2], tmp_path / "s.jsonl")
    back = read_jsonl(path)
    assert [b.model_dump() for b in back] == [s.model_dump() for s in sessions[:2]]
    stale = sessions[0].model_copy(update={"layout": sessions[0].layout.model_copy(
        update={"tokenizer": "other:0", "n_tokens": 1, "blueprint": []})})
    write_jsonl([stale], tmp_path / "stale.jsonl")
    fixed = read_jsonl(tmp_path / "stale.jsonl", tokenizer=tok)[0]
    assert fixed.layout == sessions[0].layout


def test_bad_records_and_parameters_are_rejected(tok, sessions, tmp_path):
    (tmp_path / "bad.jsonl").write_text(sessions[0].model_dump_json().replace('"needs":["fee_rate"]',
                                                                             '"needs":["nope"]') + "\n")
    with pytest.raises(ValueError, match="unknown regions"):
        read_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="distance 7000 does not fit"):
        generate_session(tok, 1, 6000, 7000)


def test_fee_rule_reference_on_hand_worked_values():
    spec = Spec(project="p", item="I", account="A", status_enum="S", error="E", statuses={}, status_order=(),
                item_fields={}, account_fields={}, fee_rate="0.0375", min_fee="1.25", fee_cap="42.50",
                error_code="E1", quantum="0.05", rounding="ROUND_HALF_UP")
    assert spec.fee_for(Decimal("100")) == Decimal("3.75")  # 3.75 exactly
    assert spec.fee_for(Decimal("101")) == Decimal("3.80")  # 3.7875 -> 75.75 quanta -> 76
    assert spec.fee_for(Decimal("102")) == Decimal("3.85")  # 3.825 -> 76.5 quanta -> half up 77
    assert spec.fee_for(Decimal("10")) == Decimal("1.25")  # 0.375 -> 0.40, clamped up to MIN_FEE
    assert spec.fee_for(Decimal("2000")) == Decimal("42.50")  # 75 clamped down to FEE_CAP
    even = Spec(**{**spec.__dict__, "rounding": "ROUND_HALF_EVEN"})
    assert even.fee_for(Decimal("102")) == Decimal("3.80")  # 76.5 quanta -> half even 76


def test_hidden_tests_pass_a_correct_module_and_catch_a_wrong_one():
    spec = make_spec(11)
    good = reference_solution(spec)
    no_clamp = good.replace("min(max(fee, MIN_FEE), FEE_CAP)", "fee")
    probes = {p.id: p for p in code_probes(spec)}
    for p in probes.values():
        r = code_checks(f"Here it is:\n```python\n{good}```", p.tests)
        assert r.ok and r.total >= 4, (p.id, r)
    bad = code_checks(no_clamp, probes["code:fee_for"].tests)
    assert bad.total >= 4 and bad.passed == bad.total - 2  # the two clamp checks fail, the interior ones pass


def test_minimal_record_from_the_schema_doc_loads(tok, tmp_path):
    import json

    doc = (Path(__file__).parents[1] / "docs" / "sessions-schema.md").read_text()
    example = doc.split("## Minimal external record", 1)[1].split("```json\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "ext.jsonl").write_text(json.dumps(json.loads(example)) + "\n")
    s = read_jsonl(tmp_path / "ext.jsonl", tokenizer=tok)[0]
    stream = _stream(tok, s)
    (a, b), = s.layout.needed_spans["fact:rate"]
    assert tok.decode(stream[a:b]) == "RATE = 0.25"
    assert s.layout.blueprint == [{"span": [a, b], "readers": [2, 3]}]  # the fact's tokens, read by the probe


def test_fact_gold_tokenizes_as_its_own_continuation(tok):
    """Teacher forcing needs encode(prefix + gold) == encode(prefix) + encode(gold) for every fact kind."""
    from kvsteward.synth.longsession.defs import FACT_KINDS, fact_probes

    for seed in range(3):
        for p in fact_probes(make_spec(seed), FACT_KINDS):
            whole = tok.encode(p.answer_prefix + p.gold, add_special_tokens=False)
            assert whole == tok.encode(p.answer_prefix, add_special_tokens=False) + tok.encode(
                p.gold, add_special_tokens=False), p.id
