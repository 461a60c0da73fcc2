"""Scoring for the long-session benchmark: fact probes, recall, code probes, paired tests and the residency ledger.

Choices (see also `docs/sessions-schema.md`):
- Fact probes are scored on *decoded text* when a tokenizer is given (recommended): the greedy continuation, with
  leading whitespace stripped, must start with the gold value (leading whitespace stripped), and the character after
  it must not extend the value (not a letter, digit or `_`, and not a `.` followed by a digit), so `0.0375` matches
  `0.0375")` but not `0.03751`. Text is compared because the same value can be spelled by different token splits.
  Without a tokenizer the match is exact on token ids (the generation starts with `gold_ids`).
- Recall compares case-insensitively with `_`, `-` and runs of whitespace folded to one space, and requires a
  required string to stand alone (not inside a longer word or number).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# ---------------------------------------------------------------------------------------------- fact probes


def _continues_value(rest: str) -> bool:
    return bool(rest) and (rest[0].isalnum() or rest[0] == "_" or (rest[0] == "." and rest[1:2].isdigit()))


def text_prefix_match(generated: str, gold: str) -> bool:
    """The generation starts with the gold value, which is not the start of a longer value."""
    gen, want = generated.lstrip(), gold.strip()
    if not want:
        raise ValueError("gold text is empty")
    return gen.startswith(want) and not _continues_value(gen[len(want):])


def forced_prefix_match(generated_ids: Sequence[int], gold_ids: Sequence[int], tokenizer=None) -> bool:
    """Did the greedy continuation after the answer prefix reproduce the gold value?

    With `tokenizer`: compare decoded text (`text_prefix_match`). Without: exact token-id prefix.
    """
    if len(gold_ids) == 0:
        raise ValueError("gold_ids is empty")
    if tokenizer is not None:
        return text_prefix_match(tokenizer.decode(list(generated_ids), skip_special_tokens=True),
                                 tokenizer.decode(list(gold_ids), skip_special_tokens=True))
    return list(generated_ids[: len(gold_ids)]) == list(gold_ids)


def gold_nll(logits: torch.Tensor, gold_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood (nats/token) of the gold tokens under teacher forcing.

    `logits[i]` is the distribution that predicts `gold_ids[i]`: the logits at the last answer-prefix token and at
    the first n-1 gold tokens.
    """
    if logits.dim() != 2 or logits.shape[0] != len(gold_ids) or len(gold_ids) == 0:
        raise ValueError(f"logits must be [n, vocab] with n = len(gold_ids) = {len(gold_ids)} > 0, "
                         f"got shape {tuple(logits.shape)}")
    target = torch.as_tensor(list(gold_ids), dtype=torch.long, device=logits.device)
    return torch.nn.functional.cross_entropy(logits.float(), target, reduction="mean").item()


# ---------------------------------------------------------------------------------------------- recall


def appended_gold_nll(session, gold_ids: Sequence[int]) -> float:
    """Teacher-force `gold_ids` onto `session` (they stay appended, as assistant text continuing the open message)
    and return their mean NLL: the logits after the prefix predict the first token, each gold token the next."""
    first = session.last_logits[None]
    rest = session.append(list(gold_ids), kind="assistant", continue_message=True, logits="all")
    return gold_nll(torch.cat([first, rest[:-1]]), gold_ids)


def mean(xs: Sequence[float]) -> float:
    """Mean of the non-NaN values (NaN if there are none)."""
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[_\-]", " ", text.casefold())).strip()


def recall_score(text: str, required: Sequence[str]) -> float:
    """Fraction of `required` strings the text contains (folded, whole-token matches)."""
    if not required:
        raise ValueError("required is empty: nothing to recall")
    folded = _fold(text)
    hits = 0
    for item in required:
        want = _fold(item)
        if not want:
            raise ValueError(f"required string {item!r} is blank")
        pattern = r"(?<![\w])" + re.escape(want) + r"(?![\w]|\.\d)"
        hits += re.search(pattern, folded) is not None
    return hits / len(required)


# ---------------------------------------------------------------------------------------------- code probes

_FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Best effort, not a sandbox: blocks the socket module's entry points before the solution is imported; code that
# reaches the OS another way (ctypes, subprocess) is not stopped. Timeouts and the temp dir are the real limits.
_GUARD = '''
try:  # limits set in the child itself: preexec_fn is unsafe in a parent that runs threads (torch)
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
except (ImportError, ValueError, OSError):
    pass

import socket as _socket_mod, _socket

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in code probes")

class _NoSocket(_socket_mod.socket):
    def __init__(self, *args, **kwargs):
        _no_network()

for _mod in (_socket_mod, _socket):
    _mod.socket = _NoSocket
_socket_mod.create_connection = _no_network
_socket_mod.getaddrinfo = _no_network
_socket_mod.socketpair = _no_network
'''

_HARNESS = '''
import json, sys, traceback
sys.path.insert(0, {here!r})
sys.setrecursionlimit(10000)
checks = {{}}
exec(compile(open({tests!r}).read(), "hidden_tests.py", "exec"), checks)
names = [n for n in checks if n.startswith("check_") and callable(checks[n])]
print("@@TOTAL " + json.dumps(len(names)), flush=True)
try:
    import solution
except BaseException as e:
    print("@@IMPORT " + json.dumps(repr(e)[:500]), flush=True)
    sys.exit(0)
for n in names:
    try:
        checks[n](solution)
        print("@@PASS " + json.dumps(n), flush=True)
    except BaseException as e:
        print("@@FAIL " + json.dumps([n, repr(e)[:300]]), flush=True)
'''


def extract_code(text: str) -> str:
    """The ```python blocks of a reply, joined; else any fenced blocks; else the text itself."""
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = py or [body for lang, body in blocks if not lang]
    return "\n\n".join(b.strip("\n") for b in chosen) if chosen else text


@dataclass
class CodeResult:
    passed: int
    total: int
    timed_out: bool = False
    error: str = ""  # import error of the solution, or the harness's stderr tail

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total


def code_checks(code: str, tests: str, timeout: float = 10) -> CodeResult:
    """Run the `check_*(m)` functions of `tests` against `code` (or its fenced block) in an isolated subprocess:
    `python -I`, a fresh temp dir as cwd, a bare environment, 2 GiB address space, no sockets, `timeout` seconds."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="kvsteward-probe-") as tmp:
        here = Path(tmp)
        (here / "solution.py").write_text(extract_code(code), encoding="utf-8")
        (here / "hidden_tests.py").write_text(tests, encoding="utf-8")
        (here / "run.py").write_text(_GUARD + _HARNESS.format(here=tmp, tests=str(here / "hidden_tests.py")))
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(here / "run.py")], cwd=tmp, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp})
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the solution may have spawned children
            out, err = proc.communicate()
            timed_out = True
    return _parse(out, err, timed_out)


def _parse(out: str, err: str, timed_out: bool) -> CodeResult:
    total, passed, error = 0, 0, ""
    for line in out.splitlines():
        tag, _, payload = line.partition(" ")
        if tag == "@@TOTAL":
            total = json.loads(payload)
        elif tag == "@@PASS":
            passed += 1
        elif tag == "@@IMPORT":
            error = json.loads(payload)
    if timed_out:
        passed, error = 0, error or f"timed out; stderr: {err[-300:]}"
    elif not total:
        error = error or f"harness failed: {err[-500:]}"
    return CodeResult(passed, total, timed_out, error)


def run_code_probe(code: str, tests: str, timeout: float = 10) -> bool:
    """True iff every hidden check passes (see `code_checks`)."""
    return code_checks(code, tests, timeout).ok


# ---------------------------------------------------------------------------------------------- paired tests


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided binomial sign test p-value (ties already excluded): P(|X - n/2| >= |k - n/2|), X ~ B(n, 1/2)."""
    if better < 0 or worse < 0:
        raise ValueError(f"counts must be non-negative, got better={better}, worse={worse}")
    n, k = better + worse, min(better, worse)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2 ** n)


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k / n (z = the normal quantile). Not the normal approximation: a rate of
    a few percent on ~100 deletions (the harmful rate) would get a negative lower bound from it. (0, 1) for n = 0."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def paired_compare(arm_scores: Sequence[float] | Mapping, ref_scores: Sequence[float] | Mapping) -> dict:
    """Per-item better/worse/tied of an arm against the reference arm, and the sign-test p-value.

    Items pair by position (sequences) or by key (mappings, e.g. keyed by (session id, probe id)).
    """
    if isinstance(arm_scores, Mapping) != isinstance(ref_scores, Mapping):
        raise ValueError("arm_scores and ref_scores must both be sequences or both be mappings")
    if isinstance(arm_scores, Mapping):
        if set(arm_scores) != set(ref_scores):
            diff = sorted(map(str, set(arm_scores) ^ set(ref_scores)))[:5]
            raise ValueError(f"arm and reference score different items, e.g. {diff}")
        pairs = [(arm_scores[k], ref_scores[k]) for k in arm_scores]
    else:
        if len(arm_scores) != len(ref_scores):
            raise ValueError(f"arm has {len(arm_scores)} scores, reference {len(ref_scores)}: not paired")
        pairs = list(zip(arm_scores, ref_scores, strict=True))
    better = sum(a > r for a, r in pairs)
    worse = sum(a < r for a, r in pairs)
    return {"better": better, "worse": worse, "tied": len(pairs) - better - worse, "p": sign_test(better, worse)}


# ---------------------------------------------------------------------------------------------- ledger


def residency(needed_logical: set[int], resident_logical: set[int]) -> float:
    """Fraction of the needed logical tokens that are resident."""
    if not needed_logical:
        raise ValueError("needed_logical is empty: residency is undefined")
    return len(set(needed_logical) & set(resident_logical)) / len(needed_logical)


def rotary_gap(query_pos: int, needed_positions: Sequence[int]) -> float:
    """Mean physical (RoPE) distance from the query position to the *resident* needed tokens' positions.

    NaN when none of the needed tokens is resident (the gap is then undefined, not zero).
    """
    if not needed_positions:
        return float("nan")
    ahead = [p for p in needed_positions if p > query_pos]
    if ahead:
        raise ValueError(f"needed positions {ahead[:3]} are after the query position {query_pos}")
    return sum(query_pos - p for p in needed_positions) / len(needed_positions)
