"""Scoring functions of the long-session benchmark, on hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from kvsteward.eval.scoring import (
    code_checks,
    extract_code,
    forced_prefix_match,
    gold_nll,
    paired_compare,
    recall_score,
    residency,
    rotary_gap,
    run_code_probe,
    sign_test,
    text_prefix_match,
    wilson_interval,
)

TESTS = '''
def check_add(m):
    assert m.add(2, 3) == 5


def check_add_negative(m):
    assert m.add(-2, -3) == -5
'''


def test_text_prefix_match_requires_the_whole_value():
    assert text_prefix_match('0.0375")\n', "0.0375")
    assert text_prefix_match(" 0.0375.", "0.0375")  # sentence end is not part of the value
    assert text_prefix_match(" ROUND_HALF_UP\n", " ROUND_HALF_UP")
    assert not text_prefix_match("0.03751", "0.0375")
    assert not text_prefix_match("0.0375.5", "0.0375")
    assert not text_prefix_match("E41723", "E4172")
    assert not text_prefix_match("ROUND_HALF_UPX", "ROUND_HALF_UP")
    assert not text_prefix_match("0.037", "0.0375")
    with pytest.raises(ValueError):
        text_prefix_match("x", " ")


def test_forced_prefix_match_on_ids():
    assert forced_prefix_match([5, 6, 7], [5, 6])
    assert not forced_prefix_match([5, 7, 6], [5, 6])
    assert not forced_prefix_match([5], [5, 6])
    with pytest.raises(ValueError):
        forced_prefix_match([1], [])


class _CharTokenizer:
    """Decodes ids as characters, so different splits of the same text decode alike."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_forced_prefix_match_on_text_ignores_token_splits():
    tok = _CharTokenizer()
    gen, gold = [ord(c) for c in '0.0375")'], [ord(c) for c in "0.0375"]
    assert forced_prefix_match(gen, gold, tok)
    assert not forced_prefix_match([ord(c) for c in "0.03751"], gold, tok)


def test_gold_nll_is_mean_cross_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)]])
    assert gold_nll(logits, [1, 0]) == pytest.approx((math.log(3) + math.log(2)) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="len\\(gold_ids\\)"):
        gold_nll(logits, [1])


def test_recall_score_folds_case_and_separators_but_not_numbers():
    required = ["KestrelVoucher", "ROUND_HALF_EVEN", "0.0375", "E4172"]
    assert recall_score("class kestrelvoucher uses round half-even, FEE_RATE 0.0375, code E4172.", required) == 1.0
    assert recall_score("KestrelVoucherStatus, rate 0.03751", required) == 0.0
    assert recall_score("KestrelVoucher and\n  round_half_even", required) == 0.5
    with pytest.raises(ValueError):
        recall_score("x", [])


def test_extract_code_prefers_python_blocks():
    reply = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nand\n```\nnot this\n```\n```py\nX = 1\n```"
    assert extract_code(reply) == "def add(a, b):\n    return a + b\n\nX = 1"
    assert extract_code("```\nY = 2\n```") == "Y = 2"
    assert extract_code("Z = 3") == "Z = 3"
    assert extract_code("```python\nW = 4\n") == "W = 4"  # an unclosed fence (generation cut off)


def test_code_probe_correct_passes_wrong_fails():
    assert run_code_probe("```python\ndef add(a, b):\n    return a + b\n```", TESTS)
    wrong = code_checks("def add(a, b):\n    return abs(a) + abs(b)\n", TESTS)
    assert (wrong.passed, wrong.total, wrong.ok) == (1, 2, False)
    broken = code_checks("def add(a, b) return", TESTS)
    assert (broken.passed, broken.total) == (0, 2) and "SyntaxError" in broken.error


def test_code_probe_infinite_loop_times_out():
    r = code_checks("def add(a, b):\n    while True:\n        pass\n", TESTS, timeout=2)
    assert r.timed_out and r.passed == 0 and not r.ok


def test_code_probe_blocks_sockets():
    code = '''
import socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    OUTCOME = "connected"
except OSError as e:
    OUTCOME = str(e)
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 9))
    OUTCOME2 = "connected"
except OSError as e:
    OUTCOME2 = str(e)
'''
    tests = ('def check_blocked(m):\n    assert "disabled in code probes" in m.OUTCOME\n'
             '    assert "disabled in code probes" in m.OUTCOME2\n')
    assert run_code_probe(code, tests)  # a refused connection would say "Connection refused", not our guard


@pytest.mark.parametrize(("better", "worse", "p"), [(9, 1, 0.021484375), (1, 9, 0.021484375), (10, 0, 2 / 1024),
                                                  (0, 0, 1.0), (5, 5, 1.0), (3, 0, 0.25), (22, 0, 2 / 2 ** 22)])
def test_sign_test_hand_computed(better, worse, p):
    assert sign_test(better, worse) == pytest.approx(p, rel=1e-12)


def test_sign_test_matches_scipy():
    from scipy.stats import binomtest

    for better in range(0, 16):
        for worse in range(0, 16):
            if better + worse:
                want = binomtest(better, better + worse, 0.5).pvalue
                assert sign_test(better, worse) == pytest.approx(want, rel=1e-9)


def test_wilson_interval_hand_computed_and_matches_scipy():
    from scipy.stats import binomtest

    z2 = 1.959963984540054 ** 2
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)), rel=1e-12)  # closed form at k = 0
    assert wilson_interval(4, 4) == pytest.approx((4 / (4 + z2), 1.0), rel=1e-12)  # and at k = n
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for k, n in [(6, 176), (31, 192), (1, 3), (50, 100)]:
        ci = binomtest(k, n).proportion_ci(method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ci.low, ci.high), rel=1e-9)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(5, 4)


def test_paired_compare():
    out = paired_compare([1, 0, 1, 1, 0.5], [0, 0, 1, 0, 1])
    assert out == {"better": 2, "worse": 1, "tied": 2, "p": 1.0}
    keyed = paired_compare({("s1", "p1"): 1, ("s1", "p2"): 1}, {("s1", "p2"): 0, ("s1", "p1"): 0})
    assert keyed == {"better": 2, "worse": 0, "tied": 0, "p": 0.5}
    with pytest.raises(ValueError, match="not paired"):
        paired_compare([1, 0], [1])
    with pytest.raises(ValueError, match="different items"):
        paired_compare({"a": 1}, {"b": 1})


def test_residency_and_rotary_gap():
    assert residency({1, 2, 3, 4}, {2, 4, 9}) == 0.5
    assert residency({7}, set()) == 0.0
    with pytest.raises(ValueError):
        residency(set(), {1})
    assert rotary_gap(100, [90, 80]) == 15.0
    assert math.isnan(rotary_gap(100, []))
    with pytest.raises(ValueError, match="after the query"):
        rotary_gap(100, [101])
