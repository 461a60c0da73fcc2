"""The `support` environment: deterministic, valid, split-disjoint, correct, balanced, and labelled by content.

The content reader below decides every label from what a reader of the session sees at the boundary (the task, a
follow-up question and the tool responses, parsed from their text), never from `reads` or `cues`, and must agree
with hindsight everywhere. The surface checks show the same notes / calls / distances carry both labels."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvsteward.synth.traces.envs import support
from kvsteward.synth.traces.hindsight import boundaries, cursor_notes, expired, unread_cursors
from kvsteward.synth.traces.toolcall import cursor_body, parse_tool_calls

CATS = ("electronics", "apparel", "furniture", "grocery", "kitchen", "toys", "garden", "sports")
ID_RE = re.compile(r"\b(?:C|T|O|KB|FM|DM|LT|WI|RF|WR)-\d+\b")


@pytest.fixture(scope="module")
def traces():
    return support.generate(200, 7, support.Options())


# --- the content reader -------------------------------------------------------------------------------------------

@dataclass
class Resp:
    """One tool response as a reader parses it."""

    cursor: int
    kind: str  # ticket | order | account | matches | results | article
    fields: dict = field(default_factory=dict)


def _field(body: str, name: str) -> str:
    m = re.search(rf"^{name}: (.*)$", body, re.M)
    return m.group(1) if m else ""


def parse(cursor: int, body: str) -> Resp:
    head = body.split("\n", 1)[0]
    if head.startswith("Ticket "):
        m = re.match(r"Ticket (T-\d+) \((\w+)\) · customer (C-\d+)", head)
        return Resp(cursor, "ticket", {"tid": m[1], "state": m[2], "order": _field(body, "order"),
                                       "issue": _field(body, "issue"), "message": _field(body, "message")})
    if head.startswith("Order "):
        items = [(n, c) for n, c in re.findall(r"([^;]+?) \((\w+)\) x\d+", _field(body, "items"))]
        status = _field(body, "status")
        date = re.search(r"\d{4}-\d{2}-\d{2}", status)
        return Resp(cursor, "order", {"oid": head.split()[1], "items": [(n.strip(), c) for n, c in items],
                                      "status": status.split(" ")[0] if status.startswith("delivered") else status,
                                      "date": dt.date.fromisoformat(date[0]) if date else None})
    if head.startswith("Customer "):
        tickets = re.findall(r"(T-\d+) \((\w+)\)", _field(body, "tickets"))
        orders = re.findall(r"O-\d+", _field(body, "orders"))
        tier = re.search(r"^tier: (\w+)", body, re.M)[1]
        return Resp(cursor, "account", {"tickets": tickets, "orders": orders, "tier": tier})
    if head.startswith("lookup_customer("):
        return Resp(cursor, "matches")
    if head.startswith("search_kb("):
        return Resp(cursor, "results", {"query": re.match(r'search_kb\("(.*)"\)', head)[1]})
    covers = re.search(r"^covers: (.*) · (.*)$", body, re.M)
    tier = re.search(r"^(Gold|Plus and gold) members: (\d+) days", body, re.M)
    clause = re.search(r"^Clause [A-Z]+-\d+: .*?(\d+) days", body, re.M)
    related = re.search(r"^Related: (KB-\d+)", body, re.M)
    return Resp(cursor, "article", {
        "kid": head.split(" ")[0], "issue": covers[1] if covers else "",
        "scope": covers[2].split(", ") if covers else [], "window": int(clause[1]) if clause else 0,
        "form": "Form code:" in body, "related": related[1] if related else "",
        "tiers": ({"gold"} if tier[1] == "Gold" else {"plus", "gold"}) if tier else set(),
        "tier_days": int(tier[2]) if tier else 0})


def _cat_of(order: Resp, item_text: str) -> str:
    return next(c for n, c in order.fields["items"] if n in item_text)


def _articles(rs: list[Resp]) -> list[Resp]:
    return [x for x in rs if x.kind == "article"]


def _policy_labels(rs: list[Resp], issue: str, cat: str) -> dict[int, bool]:
    """Results are kept until the article covering (issue, cat) is open; that article is kept, its related article
    when it is a form; every other article is dropped."""
    arts = _articles(rs)
    right = next((a for a in arts if a.fields["issue"] == issue and cat in a.fields["scope"]), None)
    out = {x.cursor: right is None for x in rs if x.kind == "results"}
    for a in arts:
        out[a.cursor] = a is right or (right is not None and a.fields["kid"] == right.fields["related"]
                                       and a.fields["form"])
    return out


SYMPTOM_ISSUE = (("damaged", "damaged item"), ("broken", "damaged item"), ("dented", "damaged item"),
                 ("not arrived", "late delivery"), ("waiting", "late delivery"), ("late", "late delivery"),
                 ("wrong", "wrong item"), ("something else", "wrong item"),
                 ("not what they paid", "wrong item"), ("return", "refund request"), ("refund", "refund request"),
                 ("no longer need", "refund request"), ("stopped working", "warranty claim"),
                 ("fault", "warranty claim"))


def _resolve(task: str, rs: list[Resp], follow: str | None, cut: int | None) -> dict[int, bool]:
    tid = re.search(r"T-\d+", task)[0]
    part1 = [x for x in rs if cut is None or x.cursor < cut]
    ticket = next(x for x in rs if x.kind == "ticket" and x.fields["tid"] == tid)
    # the ticket's order: named by id, or (order "not given") the order holding the item its message names
    order = next((x for x in rs if x.kind == "order" and (
        x.fields["oid"] == ticket.fields["order"] or any(n in ticket.fields["message"] for n, _ in x.fields["items"])
        and ticket.fields["order"] == "not given")), None)
    acct = next((x for x in rs if x.kind == "account"), None)
    seen = {x.fields["tid"] for x in rs if x.kind == "ticket"}
    gold = acct is not None and acct.fields["tier"] == "gold"  # replies name the tier of gold members
    out: dict[int, bool] = {x.cursor: False for x in rs if x.kind == "order" and x is not order}
    if follow is None:
        out[ticket.cursor] = not any(x.kind == "results" for x in rs)  # the search takes its issue
        if acct:
            out[acct.cursor] = gold or any(t not in seen for t, _ in acct.fields["tickets"]) or order is None
        if order is None:
            return out
        out[order.cursor] = True
        for x in rs:
            if x.kind == "ticket" and x is not ticket:
                out[x.cursor] = x.fields["order"] == order.fields["oid"]
        cat = _cat_of(order, ticket.fields["message"])
        out.update(_policy_labels(rs, ticket.fields["issue"], cat))
        return out
    # after the follow-up: the order and (plus / gold) the account at every reply, same-order earlier tickets too;
    # the first policy only for a "same clause" question; the new item's policy search as in part one
    for x in part1:
        out[x.cursor] = False
    out[order.cursor] = True
    out[acct.cursor] = gold
    for x in part1:
        if x.kind == "ticket" and x is not ticket:
            out[x.cursor] = x.fields["order"] == order.fields["oid"]
    cat1 = _cat_of(order, ticket.fields["message"])
    labels1 = _policy_labels(part1, ticket.fields["issue"], cat1)
    first_policy = next(a for a in _articles(part1) if labels1[a.cursor] and not a.fields["form"])
    question = re.split(r"(?<=[.!]) ", follow)[-1]
    out[first_policy.cursor] = "same" in question.lower()
    item2 = next(n for n, _ in order.fields["items"] if n in follow)
    issue2 = next(i for k, i in SYMPTOM_ISSUE if k in follow.replace(item2, ""))
    cat2 = _cat_of(order, item2)
    out.update(_policy_labels([x for x in rs if x.cursor > cut], issue2, cat2))
    return out


def _returns(task: str, rs: list[Resp], last: int) -> dict[int, bool]:
    today = dt.date.fromisoformat(re.search(r"\d{4}-\d{2}-\d{2}", task)[0])
    cat = next(c for c in CATS if c in task)
    acct = next((x for x in rs if x.kind == "account"), None)
    if acct is None:
        return {}
    tier = acct.fields["tier"]
    labels = _policy_labels(rs, "refund request", cat)
    right = next((a for a in _articles(rs) if labels[a.cursor] and not a.fields["form"]), None)
    out = dict(labels)
    for x in rs:
        if x.kind == "matches":
            out[x.cursor] = False
    fetched = {x.fields["oid"] for x in rs if x.kind == "order"}
    tiered = right is not None and tier in right.fields["tiers"]
    # the account gives the next order id, and the tier that picks the window (after the step that reads the
    # policy, only if a tier line applies); orders that could qualify wait for that step too
    applied = right is not None and right.cursor != last
    out[acct.cursor] = any(o not in fetched for o in acct.fields["orders"]) or not applied or tiered
    window = (right.fields["tier_days"] if tiered else right.fields["window"]) if applied else None
    for x in (x for x in rs if x.kind == "order"):
        f = x.fields
        candidate = cat in {c for _, c in f["items"]} and f["status"] == "delivered"
        out[x.cursor] = candidate and (window is None or (today - f["date"]).days <= window)
    return out


def _triage(task: str, rs: list[Resp], last: int) -> dict[int, bool]:
    cat = next((c for c in CATS if c in task), None)
    acct = next((x for x in rs if x.kind == "account"), None)
    out = {x.cursor: False for x in rs if x.kind == "matches"}
    if acct is None:
        return out
    seen = {x.fields["tid"] for x in rs if x.kind == "ticket"}
    out[acct.cursor] = any(t not in seen for t, s in acct.fields["tickets"] if s == "open")
    orders = {x.fields["oid"]: x for x in rs if x.kind == "order"}
    for t in (x for x in rs if x.kind == "ticket"):
        o = orders.get(t.fields["order"])
        if o is None:
            continue
        hit = (_cat_of(o, t.fields["message"]) == cat) if cat else o.fields["status"] != "delivered"
        out[t.cursor] = hit or o.cursor == last
        out[o.cursor] = hit
    return out


def content_labels(messages: list[dict]) -> dict[int, bool]:
    """Read open cursor -> still needed, from the visible context only (the messages before the boundary)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    task = messages[users[0]]["content"]
    follow = messages[users[1]]["content"] if len(users) > 1 else None
    rs = [parse(i, cursor_body(m["content"])) for i, m in enumerate(messages) if m["role"] == "tool"]
    if re.search(r"T-\d+", task):
        out = _resolve(task, rs, follow, users[1] if follow else None)
    elif re.search(r"\d{4}-\d{2}-\d{2}", task):
        out = _returns(task, rs, len(messages) - 1)
    else:
        out = _triage(task, rs, len(messages) - 1)
    unread = set(unread_cursors(messages))
    return {c: v for c, v in out.items() if c not in unread}


def decisions(trace, every: int):
    """(boundary, cursor, expired?) for every read open cursor at every `every`-th boundary."""
    for b in boundaries(trace, every):
        gone = set(expired(trace, b))
        unread = set(unread_cursors(trace.messages[:b]))
        for c in trace.cursors():
            if c < b and c not in unread:
                yield b, c, c in gone


# --- tests ------------------------------------------------------------------------------------------------------

def test_deterministic_and_valid():
    a = support.generate(30, 3, support.Options())
    b = support.generate(30, 3, support.Options())
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert [t.to_json() for t in a] != [t.to_json() for t in support.generate(30, 4, support.Options())]
    for t in a:
        t.validate()
        assert t.env == "support" and t.label_source == "oracle" and t.task_id.startswith("s3-support-t")
        assert set(t.cues) == set(t.cursors()) and set(t.cues.values()) <= set(support.CUES)


def test_options_validate():
    for bad in (dict(detour_rate=2.0), dict(top_k=1), dict(world_size=3), dict(families="resolve,nope")):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            support.Options(**bad).validate()
    only = support.generate(10, 1, support.Options(families="triage"))
    assert {t.kind for t in only} == {"triage"}


def test_families_and_sizes(traces):
    kinds = Counter(t.kind for t in traces)
    assert set(kinds) == set(support.FAMILIES) and min(kinds.values()) >= 30
    n = [len(t.cursors()) for t in traces]
    assert 6 <= min(n) and max(n) <= 14


def test_token_sizes(traces, tok):
    from kvsteward.synth.chat import message_token_ids

    sizes = [sum(len(x) for x in message_token_ids(tok, t.messages)) for t in traces[:100]]
    assert 800 <= sum(sizes) / len(sizes) <= 1400 and max(sizes) <= 2500


def test_split_disjoint(traces):
    seen: dict[str, set[str]] = {}
    for t in traces:
        text = " ".join(m["content"] for m in t.messages)
        seen.setdefault(t.split, set()).update(ID_RE.findall(text), t.entities, t.docs)
        assert set(ID_RE.findall(text)) <= set(t.docs)
    splits = list(seen)
    assert len(splits) == 3
    for i, a in enumerate(splits):
        for b in splits[i + 1:]:
            assert not seen[a] & seen[b], (a, b, sorted(seen[a] & seen[b])[:5])


def test_answer_in_a_response_the_final_step_reads(traces):
    for t in traces:
        final = len(t.messages) - 1
        assert t.messages[final]["content"].endswith(f"Final answer: {t.answer}")
        assert any(t.answer in cursor_body(t.messages[c]["content"]) for c in t.reads[final]), t.task_id


def test_react_reads_the_last_response(traces):
    for t in traces:
        for c in t.cursors():
            if c + 1 < len(t.messages):
                assert c in t.reads[c + 1]


def test_label_balance(traces):
    kept = [not gone for t in traces[:100] for _, _, gone in decisions(t, 2)]
    share = sum(kept) / len(kept)
    assert 0.25 <= share <= 0.5, share


@pytest.mark.parametrize("every", [1, 2])
def test_content_reader_agrees_with_hindsight(traces, every):
    n = 0
    for t in traces:
        for b in boundaries(t, every):
            gone = set(expired(t, b))
            got = content_labels(t.messages[:b])
            unread = set(unread_cursors(t.messages[:b]))
            want = {c: c not in gone for c in t.cursors() if c < b and c not in unread}
            assert got == want, (t.task_id, t.kind, b, {c: (got.get(c), want[c]) for c in want
                                                       if got.get(c) != want[c]})
            n += len(want)
    assert n > 1000


def _surface(t, b: int, c: int) -> tuple[str, str, int]:
    """What a rule over surface text sees: the note after c, the call that produced it, responses since."""
    _, calls = parse_tool_calls(t.messages[c - 1]["content"])
    since = sum(1 for x in t.cursors() if c < x < b)
    return cursor_notes(t.messages[:b], [c])[c], calls[0]["name"], since


def _shape(note: str) -> str:
    """The note proper (its first sentence; what follows names the next call) as a rule would generalise it: ids,
    dates, numbers and names become placeholders."""
    words = re.split(r"(?<=[.!?]) ", note)[0].split()
    return " ".join(w if k == 0 or not (w[0].isupper() or any(ch.isdigit() for ch in w)) else "X"
                    for k, w in enumerate(words))


def test_same_surface_both_labels(traces):
    """Most decisions share (note, tool, responses since) with others, and most such groups hold both labels."""
    groups: dict[tuple, Counter] = {}
    rows = []
    for t in traces:
        for b, c, gone in decisions(t, 1):
            note, name, since = _surface(t, b, c)
            key = (_shape(note), name, since)
            groups.setdefault(key, Counter())[gone] += 1
            rows.append(key)
    shared = [k for k in rows if sum(groups[k].values()) >= 2]
    mixed = sum(1 for k in shared if len(groups[k]) == 2)
    assert len(shared) / len(rows) > 0.6 and mixed / len(shared) > 0.6, (len(shared) / len(rows),
                                                                         mixed / len(shared))
    by_call: dict[str, Counter] = {}
    for t in traces:
        for b, c, gone in decisions(t, 1):
            by_call.setdefault(_surface(t, b, c)[1], Counter())[gone] += 1
    for name, cnt in by_call.items():  # every tool yields kept and expired responses
        assert min(cnt.values()) / sum(cnt.values()) > 0.15, (name, cnt)


def _next_call(t, b: int, c: int) -> str:
    j = c + 1
    while j < b and t.messages[j]["role"] == "tool":
        j += 1
    calls = parse_tool_calls(t.messages[j]["content"])[1] if j < b else []
    return calls[0]["name"] if calls else "none"


def _features(t, b: int, c: int) -> str:
    """Surface features: the note, the producing call (name, argument names), the next call, age and position."""
    note, name, since = _surface(t, b, c)
    args = " ".join(f"ARG_{k}" for k in parse_tool_calls(t.messages[c - 1]["content"])[1][0]["arguments"])
    since = min(since, 8)
    return (f"{note} CALL_{name} {args} NEXT_{_next_call(t, b, c)} SINCE_{since} CALLxSINCE_{name}_{since} "
            f"POS_{min(t.cursors().index(c), 10)}")


def test_surface_classifier_is_weak(traces):
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score

    train = [(x, y) for t in traces if t.split == "train" for x, y in
             ((_features(t, b, c), gone) for b, c, gone in decisions(t, 2))]
    test = [(x, y) for t in traces if t.split != "train" for x, y in
            ((_features(t, b, c), gone) for b, c, gone in decisions(t, 2))]
    vec = CountVectorizer(ngram_range=(1, 2), token_pattern=r"[^\s]+", binary=True)
    xs = vec.fit_transform([x for x, _ in train])
    clf = LogisticRegression(max_iter=2000).fit(xs, [y for _, y in train])
    pred = clf.predict(vec.transform([x for x, _ in test]))
    f1 = f1_score([y for _, y in test], pred)
    assert f1 < 0.85, f1


def _rare(words: set[str], df: Counter, n: int) -> set[str]:
    return {w for w in words if df[w] / n < 0.02}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9-]+", text.lower()))


def test_lexical_overlap_misleads(traces):
    bodies = [_words(cursor_body(t.messages[c]["content"])) for t in traces for c in t.cursors()]
    df = Counter(w for b in bodies for w in b)
    kept_disjoint = dropped_shared = kept = dropped = 0
    for t in traces:
        rare_task = _rare(_words(t.question), df, len(bodies))
        for _, c, gone in decisions(t, 2):
            shares = bool(rare_task & _words(cursor_body(t.messages[c]["content"])))
            if gone:
                dropped += 1
                dropped_shared += shares
            else:
                kept += 1
                kept_disjoint += not shares
    assert kept_disjoint / kept > 0.3 and dropped_shared / dropped > 0.15, (kept_disjoint / kept,
                                                                           dropped_shared / dropped)


def test_cli_json(tmp_path):
    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    res = CliRunner().invoke(app, ["synth", "traces", "--env", "support", "--tasks", "5", "--out", str(tmp_path),
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "traces.jsonl").read_text().count("\n") == 5
