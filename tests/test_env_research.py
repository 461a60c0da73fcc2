"""The `research` environment: correct, deterministic, split-disjoint traces whose hindsight labels a content reader
recovers exactly and a surface classifier (agent notes, tool names, positions) does not."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from kvsteward.synth.traces import envs
from kvsteward.synth.traces.envs import research as R
from kvsteward.synth.traces.hindsight import boundaries, cursor_notes, expired, unread_cursors
from kvsteward.synth.traces.tasks import REL_PHRASE
from kvsteward.synth.traces.toolcall import cursor_body, parse_tool_calls
from kvsteward.synth.traces.trace import Trace
from kvsteward.synth.traces.world import _FOUNDED, DESCRIPTOR, FACT_TEMPLATES, NUMERIC, RELATIONS

SEED = 7


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    return R.generate(200, SEED, R.Options())


# --- a content reader: the task and the tool responses, parsed as a person would read them ----------------------

def _pattern(template: str, **slots: str) -> str:
    """A template with `{slot}` placeholders as a regex; a slot seen again must repeat the same text."""
    out, seen = "", set()
    for part in re.split(r"(\{\w+\})", template):
        name = part[1:-1] if part.startswith("{") and part.endswith("}") else None
        if name is None:
            out += re.escape(part)
        elif name in seen:
            out += f"(?P={name})"
        else:
            seen.add(name)
            out += f"(?P<{name}>{slots.get(name, '.+?')})"
    return out


_REL_RE = {f: re.compile(_pattern(t) + "$") for f, t in REL_PHRASE.items()}


def parse_phrase(text: str) -> tuple[str, list[str]]:
    """'the mentor of the founder of X' -> ('X', ['founder', 'mentor'])."""
    for f, rx in _REL_RE.items():
        m = rx.match(text)
        if m:
            anchor, rels = parse_phrase(m.group("x"))
            return anchor, rels + [f]
    return text, []


@dataclass
class Spec:
    """What the task asks: per branch its anchor name and relations; `asks` = (branch, position, field) that the
    final answer states (position 0 = the anchor)."""

    branches: list[tuple[str, list[str]]]
    asks: set[tuple[int, int, str]] = field(default_factory=set)


def _split_question(q: str) -> tuple[str, str]:
    m = re.search(r"[?.] ", q)
    return (q[: m.start() + 1], q[m.end():]) if m else (q, "")


def _main_question(main: str) -> Spec:
    for f, templates in R.NUMERIC_Q.items():
        for t in templates:
            m = re.fullmatch(_pattern(t), main, flags=re.I)
            if m:
                anchor, rels = parse_phrase(m.group("x"))
                return Spec([(anchor, rels)], {(0, len(rels), f)})
    for f, templates in R.DESCRIPTOR_Q.items():
        for t in templates:
            m = re.fullmatch(_pattern(t), main, flags=re.I)
            if m:
                anchor, rels = parse_phrase(m.group("x"))
                return Spec([(anchor, rels)], {(0, len(rels), f)})
    for t in R.NAME_Q:
        m = re.fullmatch(_pattern(t), main, flags=re.I)
        if m:
            anchor, rels = parse_phrase(m.group("x"))
            return Spec([(anchor, rels[:-1])], {(0, len(rels) - 1, rels[-1])})
    for (f, _), templates in R.COMPARE_Q.items():
        for t in templates:
            m = re.fullmatch(_pattern(t), main, flags=re.I)
            if m:
                sides = [parse_phrase(m.group("a")), parse_phrase(m.group("b"))]
                return Spec(sides, {(i, len(rels), f) for i, (_, rels) in enumerate(sides)})
    for (f, _), templates in R.RANK_Q.items():
        for t in templates:
            m = re.fullmatch(_pattern(t), main, flags=re.I)
            if m:
                head, last = m.group("items").rsplit(" and ", 1)
                names = head.split(", ") + [last]
                return Spec([(n, []) for n in names], {(i, 0, f) for i in range(len(names))})
    raise AssertionError(f"unparsed question {main!r}")


def _extra(extra: str, spec: Spec) -> None:
    """A recap request adds every chain fact, a describe request each compared entity's descriptor, a partial one
    the one fact it names."""
    anchor, rels = spec.branches[0]
    if extra in R.RECAP_REQUESTS:
        spec.asks |= {(b, i, f) for b, (_, rs) in enumerate(spec.branches) for i, f in enumerate(rs)}
        return
    for desc, requests in R.DESCRIBE_REQUESTS.items():
        if extra in requests:
            spec.asks |= {(b, p, desc) for b, p, _ in list(spec.asks)}
            return
    for wrap in R.EXTRA_WRAP:
        for f, ask in R.EXTRA_ASK.items():
            m = re.fullmatch(_pattern(wrap.format(ask=ask)), extra)
            if not m:
                continue
            ref = m.group("x")
            if ref == anchor:
                spec.asks.add((0, 0, f))
            elif ref in R.REF_NOUN.values():
                rel = next(r for r, noun in R.REF_NOUN.items() if noun == ref)
                spec.asks.add((0, rels.index(rel) + 1, f))
            else:
                spec.asks.add((0, len(parse_phrase(ref)[1]), f))
            return
    assert extra in R.FILLERS or not extra, f"unparsed request {extra!r}"


def parse_task(question: str) -> Spec:
    main, extra = _split_question(question)
    spec = _main_question(main)
    _extra(extra, spec)
    return spec


def _fact_patterns() -> dict[str, list[tuple[str, re.Pattern]]]:
    out: dict[str, list[tuple[str, re.Pattern]]] = {}
    for kind in RELATIONS:
        fields = list(RELATIONS[kind]) + list(NUMERIC[kind]) + [DESCRIPTOR[kind]]
        out[kind] = [(f, re.compile(_pattern(t) + "$")) for f in fields
                     for t in (_FOUNDED[kind] if f == "founded_year" else FACT_TEMPLATES[f])]
    return out


_FACTS = _fact_patterns()
_OPEN_RE = re.compile(r"^(.+) \((\w+)\), page (\d+)/(\d+)\n(.*)$", re.S)
_SEARCH_RE = re.compile(r'^search "(.*)"( \(exact\))?: ')
_HIT_RE = re.compile(r"^\d+\. (\S+) (.+) \([^()]*\)$")


def read_response(content: str) -> dict:
    """A tool response as a reader sees it: a list (query, listed names) or a page (title, facts on it)."""
    body = cursor_body(content)
    m = _SEARCH_RE.match(body)
    if m:
        hits = [_HIT_RE.match(line).group(2) for line in body.splitlines()[1:] if _HIT_RE.match(line)]
        return {"type": "list", "query": m.group(1), "names": hits}
    m = _OPEN_RE.match(body)
    assert m, f"unreadable response {body[:80]!r}"
    name, kind, text = m.group(1), m.group(2), m.group(5)
    facts = {}
    for sentence in re.findall(r"[^.]+\.", text):
        for f, rx in _FACTS[kind]:
            fm = rx.match(sentence.strip())
            if fm and fm.group("n") == name:
                facts[f] = fm.group("v")
                break
    return {"type": "page", "name": name, "facts": facts}


def content_labels(messages: list[dict]) -> dict[int, bool]:
    """Read open cursor -> still needed, decided from the context alone (task + tool responses)."""
    spec = parse_task(next(m["content"] for m in messages if m["role"] == "user"))
    who = {anchor: (i, 0) for i, (anchor, _) in enumerate(spec.branches)}
    anchors = set(who)
    tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    seen = {c: read_response(messages[c]["content"]) for c in tools}
    pages: dict[tuple[int, int], list[tuple[int, dict]]] = defaultdict(list)
    for c in tools:
        r = seen[c]
        key = who.get(r.get("name"))
        if r["type"] != "page" or key is None:
            continue
        pages[key].append((c, r["facts"]))
        lead = _lead(spec, key)
        if lead in r["facts"]:
            who[r["facts"][lead]] = (key[0], key[1] + 1)
    first_list = {}
    for c in tools:
        if seen[c]["type"] == "list":
            for n in seen[c]["names"]:
                first_list.setdefault(n, c)
    unread = set(unread_cursors(messages))
    lists = [seen[c] for c in tools if seen[c]["type"] == "list"]
    out = {}
    for c in tools:
        if c in unread:
            continue
        r = seen[c]
        if r["type"] == "list":
            targets = [n for n in r["names"] if n in who and (n == r["query"] or (n in anchors and first_list[n] == c))]
            out[c] = any(_list_needed(spec, who[n], n, r["names"], pages, tools[-1]) for n in targets)
        else:
            key = who.get(r["name"])
            out[c] = key is not None and _page_needed(spec, key, r["facts"], pages, lists, tools[-1])
    return out


DESCRIPTORS = set(DESCRIPTOR.values())  # shown in search snippets: the agent takes them from the list


def _asked(spec: Spec, key: tuple[int, int]) -> set[str]:
    return {f for b, p, f in spec.asks if (b, p) == key}


def _lead(spec: Spec, key: tuple[int, int]) -> str | None:
    rels = spec.branches[key[0]][1]
    return rels[key[1]] if key[1] < len(rels) else None


def _list_needed(spec: Spec, key: tuple[int, int], name: str, listed: list[str], pages: dict, last: int) -> bool:
    """A list the agent takes `name` from: kept until its page is open (after a look-alike was opened by mistake,
    or while a task-named entity waits its turn), to the end when its snippet gives an asked descriptor, and for the
    step after the entity's first page when a look-alike is listed beside it (the opened title is checked)."""
    if not pages.get(key) or _asked(spec, key) & DESCRIPTORS:
        return True
    return pages[key][0][0] == last and any(_look_alike(m, name) for m in listed)


def _page_needed(spec: Spec, key: tuple[int, int], facts: dict, pages: dict, lists: list, last: int) -> bool:
    """A page of an entity the task needs: kept when it holds a fact the answer states, or the name of the next
    entity until the search for it, and after it while that search lists a look-alike of the name and the agent has
    not read the entity's first page (and taken one more step)."""
    if (_asked(spec, key) - DESCRIPTORS) & set(facts):
        return True
    if _lead(spec, key) not in facts:
        return False
    succ = facts[_lead(spec, key)]
    searched = [r for r in lists if r["query"] == succ]
    if not searched:
        return True  # the search for the next name is still to come
    if not any(_look_alike(n, succ) for r in searched for n in r["names"]):
        return False
    nxt = pages.get((key[0], key[1] + 1))
    return not nxt or nxt[0][0] == last


def _look_alike(a: str, b: str) -> bool:
    """Two names one letter apart in one word (the kind of name a careful reader checks twice)."""
    ta, tb = a.lower().split(), b.lower().split()
    diff = [(x, y) for x, y in zip(ta, tb, strict=False) if x != y]
    return len(ta) == len(tb) and len(diff) == 1 and _one_edit(*diff[0])


def _one_edit(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


# --- helpers -------------------------------------------------------------------------------------------------------

def decisions(ts: list[Trace], every: int):
    """(trace, boundary, cursor, expired) for every read open cursor at every `every`-th boundary."""
    for t in ts:
        for b in boundaries(t, every):
            gone = set(expired(t, b))
            unread = set(unread_cursors(t.messages[:b]))
            for c in t.cursors():
                if c < b and c not in unread:
                    yield t, b, c, c in gone


def _mask(text: str, t: Trace) -> str:
    words = {w for name in t.entities for w in name.split()}
    text = re.sub(r"\b(tr|va|te)\d{5}\b", "DOC", text)
    text = re.sub(r"\d+", "NUM", text)
    return " ".join("NAME" if w.strip(".,:;()") in words else w for w in text.split())


def surface(t: Trace, b: int, c: int) -> tuple[str, str, int]:
    """What a rule over the agent's surface sees: its note after c (names masked), c's call, steps since c."""
    note = _mask(cursor_notes(t.messages[:b], [c])[c], t)
    _, calls = parse_tool_calls(t.messages[c - 1]["content"])
    name, args = calls[0]["name"], calls[0]["arguments"]
    call = f"{name} page{args.get('page', 1)}" if name == "open" else name
    since = sum(1 for i in t.cursors() if c < i < b)
    return note, call, since


# --- tests ---------------------------------------------------------------------------------------------------------

def test_deterministic_and_valid(traces):
    again = R.generate(12, SEED, R.Options())
    assert [t.to_json() for t in again] == [t.to_json() for t in traces[:12]]
    for t in traces:
        t.validate()
        assert t.env == "research" and t.label_source == "oracle"
        assert t.task_id.startswith(f"s{SEED}-research-t")
        assert set(t.cues) == set(t.cursors()) and set(t.cues.values()) <= set(R.CUES)
        assert 6 <= len(t.cursors()) <= 14
    assert {t.kind for t in traces} == {"chain", "recap", "partial", "compare", "compare_recap", "rank"}


def test_registry_entry_point():
    ts = envs.generate("research", 3, 1, envs.make_options("research", {"top_k": 4, "max_hops": 9}))
    assert len(ts) == 3 and all(t.env == "research" for t in ts)
    with pytest.raises(ValueError, match="detour_rate"):
        R.Options(detour_rate=2).validate()


def test_splits_are_disjoint(traces):
    by_split = defaultdict(set)
    for t in traces:
        by_split[t.split] |= set(t.entities) | set(t.docs)
    assert set(by_split) == {"train", "validation", "test"}
    assert not (by_split["train"] & by_split["validation"]) and not (by_split["train"] & by_split["test"])
    assert not (by_split["validation"] & by_split["test"])


def test_final_answer_is_copied_from_a_response_the_final_step_reads(traces):
    for t in traces:
        last = len(t.messages) - 1
        assert t.messages[last]["content"].splitlines()[-1] == f"Final answer: {t.answer}"
        assert any(t.answer in t.messages[c]["content"] for c in t.reads[last]), t.task_id
        for step in t.reads:  # ReAct: the step after a response reads it
            if t.messages[step - 1]["role"] == "tool":
                assert step - 1 in t.reads[step]


def test_label_balance(traces):
    labels = [gone for *_, gone in decisions(traces[:100], 2)]
    keep = 1 - sum(labels) / len(labels)
    assert 0.25 <= keep <= 0.5, keep


@pytest.mark.parametrize("every", [1, 2])
def test_content_reader_recovers_every_label(traces, every):
    n = wrong = 0
    for t, b, c, gone in decisions(traces, every):
        got = content_labels(t.messages[:b])
        n += 1
        if got[c] == gone:
            wrong += 1
            print(t.task_id, b, c, t.cues[c], "reader says needed" if got[c] else "reader says expired")
    assert n > 1000 and wrong == 0, f"{wrong} of {n} decisions differ"


def test_label_is_not_a_function_of_the_surface(traces):
    groups = defaultdict(list)
    for t, b, c, gone in decisions(traces, 2):
        groups[surface(t, b, c)].append(gone)
    mixed = [v for v in groups.values() if 0 < sum(v) < len(v)]
    # the same note (names masked), call and distance carry both labels, over and over
    assert len(mixed) >= 100 and sum(map(len, mixed)) / sum(map(len, groups.values())) > 0.15
    coarse = defaultdict(list)  # per (call, steps since) alone: nearly every decision sits in a mixed group
    for (_, call, since), v in groups.items():
        coarse[(call, since)] += v
    assert sum(len(v) for v in coarse.values() if 0 < sum(v) < len(v)) / sum(map(len, coarse.values())) > 0.9


def test_open_phrasing_does_not_tell_right_from_wrong(traces):
    """The step opening a result reads the same whether the result is the right one or a look-alike."""
    said = defaultdict(list)
    for t in traces:
        for c, cue in t.cues.items():
            text, calls = parse_tool_calls(t.messages[c - 1]["content"])
            if calls[0]["name"] == "open" and "page" not in calls[0]["arguments"]:
                said[cue == "wrong_page"].append("looks relevant" in text)
    share = {wrong: sum(v) / len(v) for wrong, v in said.items()}
    assert len(said[True]) > 50 and abs(share[True] - share[False]) < 0.06, share


def surface_f1(ts: list[Trace]) -> dict[str, float]:
    """Held-out F1 of a logistic regression over note n-grams + call + steps since (split by trace)."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score

    rows = {"train": ([], []), "test": ([], [])}
    for t, b, c, gone in decisions(ts, 2):
        note, call, since = surface(t, b, c)
        part = "train" if int(t.task_id[-5:]) % 2 == 0 else "test"
        rows[part][0].append(f"{note} CALL_{call.replace(' ', '_')} SINCE_{min(since, 8)}")
        rows[part][1].append(int(gone))
    vec = CountVectorizer(ngram_range=(1, 2), token_pattern=r"\S+", min_df=2)
    clf = LogisticRegression(max_iter=2000, C=1.0).fit(vec.fit_transform(rows["train"][0]), rows["train"][1])
    pred = clf.predict(vec.transform(rows["test"][0]))
    y = rows["test"][1]
    return {"expired": f1_score(y, pred), "keep": f1_score(y, pred, pos_label=0),
            "macro": f1_score(y, pred, average="macro")}


def test_surface_classifier_stays_well_below(traces):
    f1 = surface_f1(traces)
    print(f1)
    assert f1["expired"] < 0.85 and f1["keep"] < 0.7 and f1["macro"] < 0.8, f1


def _task_words(t: Trace) -> set[str]:
    return {w.strip("?,.").lower() for w in t.question.split() if w[:1].isupper()} - {"in", "what", "who", "which"}


def test_lexical_overlap_with_the_task_misleads(traces):
    """Sharing a name word with the task says nothing about being needed: many needed responses share none (the
    chain's later pages, their lists), many that share one are expired (the anchor's list and pages, twins)."""
    rows = []
    for t, _, c, gone in decisions(traces, 2):
        words = {w.strip(".,:;()\"").lower() for w in cursor_body(t.messages[c]["content"]).split()}
        rows.append((bool(words & _task_words(t)), not gone))
    needed = [o for o, keep in rows if keep]
    shared = [keep for o, keep in rows if o]
    assert needed.count(False) / len(needed) > 0.2
    assert shared.count(False) / len(shared) > 0.5
    keep_rate = sum(keep for _, keep in rows) / len(rows)
    assert sum(shared) / len(shared) < keep_rate + 0.03  # overlap does not even raise the odds
