"""The `ops` environment: deterministic, valid, split-disjoint traces whose hindsight labels a content reader gets
right every time and a surface rule over notes / calls / positions does not."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

from kvsteward.synth.traces import envs
from kvsteward.synth.traces.envs.ops import FAMILIES, Options
from kvsteward.synth.traces.hindsight import boundaries, cursor_notes, expired, unread_cursors
from kvsteward.synth.traces.toolcall import cursor_body, parse_tool_calls
from kvsteward.synth.traces.trace import Trace

N_TRACES = 200


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return envs.generate("ops", N_TRACES, 3)


# --- a content reader: labels from the task and the responses' text, nothing else ---------------------------------

_METRIC_RE = re.compile(r"^(\S+) @ (\S+), (\w+) over (\w+): (\d+)")
_LOGS_RE = re.compile(r"^(\S+) @ (\S+), (\w+) logs over (\w+): (\d+) lines")
_LIST_RE = re.compile(r"^\w+ services in \S+: \d+\n")
_RECORD_RE = re.compile(r"^(\S+): team \w+, .*\nregions \(\d+\): (.+)$")
_ALERT_RE = re.compile(r"^(ALR-\d+): (\S+) @ \S+, fired (\d\d):(\d\d)")
_DEPLOYS_RE = re.compile(r"^(\S+): \d+ deploys today\n")
_DEPLOY_ROW_RE = re.compile(r"^(dep-\d+) · (\d\d):(\d\d) · ", re.M)
_DETAIL_RE = re.compile(r"^(dep-\d+): (\S+), version ")
_CMP_RE = re.compile(r"\b(above|over|higher than|below|under|lower than) (\d+) (?:ms|%)")


def _metric_of(q: str) -> str:
    q = q.lower()
    return "p95_ms" if ("p95" in q or "percentile" in q) else "cpu_pct" if "cpu" in q else "mem_pct"


def _window_of(q: str) -> str:
    q = q.lower()
    if re.search(r"\b(6|six) hours\b", q):
        return "6h"
    if re.search(r"\b24 hours\b|\bday\b", q):
        return "24h"
    return "1h"


@dataclass
class Seen:
    """What a reader has parsed from the visible context: the question and each response (cursor → body)."""

    question: str
    bodies: dict[int, str]
    read: list[int] = field(default_factory=list)  # responses the agent has already reacted to


def _seen(messages: list[dict]) -> Seen:
    unread = set(unread_cursors(messages))
    bodies = {i: cursor_body(m["content"]) for i, m in enumerate(messages) if m["role"] == "tool"}
    q = next(m["content"] for m in messages if m["role"] == "user")
    return Seen(q, bodies, [c for c in bodies if c not in unread])


def _read_filter(s: Seen) -> dict[int, bool]:
    metric, window = _metric_of(s.question), _window_of(s.question)
    level = "warn" if "warn" in s.question.lower() else "error"
    word, thr = _CMP_RE.search(s.question).groups()
    above = word in ("above", "over", "higher than")
    listed, touched, passes = [], set(), {}
    for body in s.bodies.values():
        if _LIST_RE.match(body):
            listed = [line.split(" · ")[0] for line in body.splitlines()[1:]]
        elif m := _METRIC_RE.match(body):
            touched.add(m[1])
            if (m[3], m[4]) == (metric, window):
                passes[m[1]] = int(m[5]) > int(thr) if above else int(m[5]) < int(thr)
        elif m := _LOGS_RE.match(body):
            touched.add(m[1])
    keep = {}
    for c in s.read:
        body = s.bodies[c]
        if _LIST_RE.match(body):
            keep[c] = any(x not in touched for x in listed)
        elif m := _METRIC_RE.match(body):
            keep[c] = (m[3], m[4]) == (metric, window) and passes[m[1]]
        else:
            m = _LOGS_RE.match(body)
            keep[c] = (m[3], m[4]) == (level, window) and passes[m[1]]  # its metric is shown by now
    return keep


def _extremes(values: dict[int, int], shape: str) -> set[int]:
    ranked = sorted(values, key=values.__getitem__)
    if not ranked:
        return set()
    return {"max": {ranked[-1]}, "min": {ranked[0]}, "maxmin": {ranked[0], ranked[-1]}, "top2": set(ranked[-2:])}[shape]


def _read_regional(s: Seen) -> dict[int, bool]:
    q = s.question.lower()
    metric, window = _metric_of(q), _window_of(q)
    shape = "top2" if "runner-up" in q else "maxmin" if ("highest" in q and "lowest" in q) else \
        "max" if "highest" in q else "min"
    regions, touched, values = [], set(), {}
    for c, body in s.bodies.items():
        if m := _RECORD_RE.match(body):
            regions = m[2].split(", ")
        elif m := _METRIC_RE.match(body):
            touched.add(m[2])
            if (m[3], m[4]) == (metric, window) and c in s.read:
                values[c] = int(m[5])
    kept = _extremes(values, shape)
    return {c: any(g not in touched for g in regions) if _RECORD_RE.match(s.bodies[c]) else c in kept
            for c in s.read}


def _read_incident(s: Seen) -> dict[int, bool]:
    recap_alerts = "time" in s.question
    recap_counts = bool(re.search(r"how many deploys|deploy count", s.question))
    alerts, rows, opened = {}, {}, set()  # service → alert minute; service → [(minute, id)]; deploy ids shown
    for body in s.bodies.values():
        if m := _ALERT_RE.match(body):
            alerts[m[2]] = int(m[3]) * 60 + int(m[4])
        elif m := _DEPLOYS_RE.match(body):
            rows[m[1]] = [(int(h) * 60 + int(mi), d) for d, h, mi in _DEPLOY_ROW_RE.findall(body)]
        elif m := _DETAIL_RE.match(body):
            opened.add(m[1])

    def cause(svc: str) -> str | None:
        if svc not in alerts or svc not in rows:
            return None
        return max((t, d) for t, d in rows[svc] if t < alerts[svc])[1]

    keep = {}
    for c in s.read:
        body = s.bodies[c]
        if m := _ALERT_RE.match(body):
            keep[c] = recap_alerts or cause(m[2]) not in opened
        elif m := _DEPLOYS_RE.match(body):
            keep[c] = recap_counts or cause(m[1]) not in opened
        elif _RECORD_RE.match(body):  # a side lookup (on-call, tier): the task asks nothing it holds
            keep[c] = False
        else:
            m = _DETAIL_RE.match(body)
            keep[c] = m[1] == cause(m[2])
    return keep


def read_labels(messages: list[dict]) -> dict[int, bool]:
    """Read open cursor → still needed, decided from the visible context only (the question and the responses)."""
    s = _seen(messages)
    first = s.bodies[min(s.bodies)]
    if _LIST_RE.match(first):
        return _read_filter(s)
    if _RECORD_RE.match(first):
        return _read_regional(s)
    return _read_incident(s)


def decisions(traces: list[Trace], every: int):
    """(trace, boundary, cursor, still needed) for every read open cursor at every boundary."""
    for t in traces:
        for b in boundaries(t, every):
            gone = set(expired(t, b))
            unread = set(unread_cursors(t.messages[:b]))
            for c in t.cursors():
                if c < b and c not in unread:
                    yield t, b, c, c not in gone


# --- tests ---------------------------------------------------------------------------------------------------------

def test_deterministic_and_valid(traces):
    again = envs.generate("ops", 40, 3)
    assert [t.to_json() for t in again] == [t.to_json() for t in traces[:40]]
    assert [t.to_json() for t in envs.generate("ops", 5, 4)] != [t.to_json() for t in traces[:5]]
    for i, t in enumerate(traces):
        t.validate()
        assert t.env == "ops" and t.label_source == "oracle" and t.task_id == f"s3-ops-t{i:05d}"
        assert t.kind in FAMILIES and t.hops >= 3 and t.question == t.messages[1]["content"]
        assert set(t.cues) == set(t.cursors())
        assert 6 <= len(t.cursors()) <= 14
        assert all(t.readers()[c] and t.readers()[c][0] == c + 1 for c in t.cursors())  # ReAct: read right after
    assert Counter(t.split for t in traces) == {"train": 160, "validation": 20, "test": 20}
    assert set(Counter(t.kind for t in traces)) == set(FAMILIES)


def test_split_disjoint(traces):
    by_split = defaultdict(set)
    for t in traces:
        assert t.entities and t.docs or t.kind != "incident"
        by_split[t.split] |= set(t.entities) | set(t.docs)
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["train"] & by_split["test"]
    assert not by_split["validation"] & by_split["test"]


def test_final_answer_is_read_verbatim(traces):
    for t in traces:
        last = len(t.messages) - 1
        assert t.messages[last]["content"].endswith(f"\nFinal answer: {t.answer}")
        bodies = [cursor_body(t.messages[c]["content"]) for c in t.reads[last]]
        assert any(re.search(rf"(?<![\w.-]){re.escape(t.answer)}(?![\w-]|\.\d)", b) for b in bodies), t.task_id


def test_label_balance(traces):
    for every in (1, 2):
        labels = [keep for *_, keep in decisions(traces[:100], every)]
        assert 0.25 <= sum(labels) / len(labels) <= 0.5, (every, sum(labels) / len(labels))
    per_tool = defaultdict(list)
    for t, _, c, keep in decisions(traces, 2):
        per_tool[parse_tool_calls(t.messages[c - 1]["content"])[1][0]["name"]].append(keep)
    for name, ks in per_tool.items():  # every tool yields both labels
        assert 0.15 <= sum(ks) / len(ks) <= 0.85, (name, sum(ks) / len(ks))


@pytest.mark.parametrize("every", [1, 2])
def test_content_reader_gets_every_label(traces, every):
    n = wrong = 0
    for t in traces:
        for b in boundaries(t, every):
            gone = set(expired(t, b))
            for c, keep in read_labels(t.messages[:b]).items():
                n += 1
                wrong += keep == (c in gone)
    assert n > 20 * len(traces) / every and wrong == 0, (n, wrong)


def _surface(t: Trace, b: int, c: int) -> str:
    """What a rule without content sees: the note after c, the call that made c, the next call, c's age."""
    note = cursor_notes(t.messages[:b], [c])[c]
    call = parse_tool_calls(t.messages[c - 1]["content"])[1][0]
    args = " ".join(f"{k}={v}" for k, v in call["arguments"].items() if k in ("metric", "window", "level"))
    nxt = parse_tool_calls(t.messages[c + 1]["content"])[1]
    age = sum(1 for x in t.cursors() if c < x < b)
    pos = t.cursors().index(c)
    return f"{note} || call_{call['name']} {args} || next_{nxt[0]['name'] if nxt else 'final'} || age{age} pos{pos}"


def test_surface_does_not_decide(traces):
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score

    rows = [(t.split, _surface(t, b, c), keep) for t, b, c, keep in decisions(traces, 2)]
    groups = defaultdict(set)
    for t, b, c, keep in decisions(traces, 2):
        name = parse_tool_calls(t.messages[c - 1]["content"])[1][0]["name"]
        groups[(cursor_notes(t.messages[:b], [c])[c], name, sum(1 for x in t.cursors() if c < x < b))].add(keep)
    mixed = sum(len(v) == 2 for v in groups.values())
    assert mixed >= 40, mixed  # the same note, tool and age with both labels

    vec = CountVectorizer(ngram_range=(1, 2), token_pattern=r"[^\s]+", min_df=2)
    train = [r for r in rows if r[0] == "train"]
    held = [r for r in rows if r[0] != "train"]
    x = vec.fit_transform([r[1] for r in train])
    clf = LogisticRegression(max_iter=2000, C=1.0).fit(x, [r[2] for r in train])
    pred = clf.predict(vec.transform([r[1] for r in held]))
    truth = [r[2] for r in held]
    f1_keep = f1_score(truth, pred)
    f1_gone = f1_score([not y for y in truth], [not p for p in pred])
    assert f1_keep < 0.8 and f1_gone < 0.85, (f1_keep, f1_gone)


_RARE_RE = re.compile(r"[A-Za-z]+(?:-[A-Za-z0-9]+)+|\b\d+\b")


def _rare_words(text: str) -> set[str]:
    """The task's rare words: hyphenated names and ids (services, alerts, regions), numbers, team names."""
    from kvsteward.synth.traces.envs.ops_world import TEAMS

    return set(_RARE_RE.findall(text)) | {w for w in TEAMS if re.search(rf"\b{w}\b", text)}


def test_lexical_overlap_misleads(traces):
    """Keeping what shares the task's rare words is wrong both ways: needed responses that share none (a deploy the
    alert's service and the list's id lead to) and expired ones that share them (alerts, lists, beaten regions)."""
    counts = Counter()
    for t, _, c, keep in decisions(traces, 2):
        shared = bool(_rare_words(t.question) & _rare_words(cursor_body(t.messages[c]["content"])))
        counts[(keep, shared)] += 1
    needed, gone = counts[(True, False)] + counts[(True, True)], counts[(False, False)] + counts[(False, True)]
    assert counts[(True, False)] / needed > 0.1, counts  # needed, sharing no rare word with the task (chains)
    assert counts[(False, True)] / gone > 0.5, counts  # sharing the task's words, and expired (distractors)
    overlap_f1 = 2 * counts[(True, True)] / (2 * counts[(True, True)] + counts[(False, True)] + counts[(True, False)])
    assert overlap_f1 < 0.7, overlap_f1


def test_notes_vary(traces):
    notes = Counter()
    for t, b, c, _ in decisions(traces, 2):
        notes[cursor_notes(t.messages[:b], [c])[c]] += 1
    assert len(notes) > 300
    assert notes.most_common(1)[0][1] < 0.1 * sum(notes.values())


def test_options():
    Options().validate()
    for bad in (Options(detour_rate=1.5), Options(min_items=5, max_items=4), Options(families="filter,nope"),
                Options(services_per_team=2)):
        with pytest.raises(ValueError):
            bad.validate()
    only = envs.generate("ops", 6, 1, Options(families="regional", detour_rate=0.0))
    assert {t.kind for t in only} == {"regional"}
    assert all(c != "wrong_query" for t in only for c in t.cues.values())


def test_cli(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app
    from kvsteward.synth.traces.trace import read_traces

    res = CliRunner().invoke(app, ["synth", "traces", "--env", "ops", "--tasks", "5", "--out", str(tmp_path),
                                   "--json", "-o", "families=incident"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["traces"] == 5
    assert {t.kind for t in read_traces(tmp_path)} == {"incident"}
