"""BFCL v4 multi-turn as agent sessions (`kvsteward.synth.traces.bfcl`): execution of the ground truth, the provenance
rule,
and the round trip through `steward synth import` and hindsight labelling."""

import json
import socket

import pytest

pytest.importorskip("bfcl_eval")

from typer.testing import CliRunner  # noqa: E402

from kvsteward.pipelines.cli import app  # noqa: E402
from kvsteward.synth.traces import bfcl  # noqa: E402
from kvsteward.synth.traces import hindsight as hs  # noqa: E402
from kvsteward.synth.traces.importer import provenance_traces, read_openai_jsonl  # noqa: E402
from kvsteward.synth.traces.toolcall import cursor_body, cursor_id, parse_tool_calls  # noqa: E402

# every simulator class, both categories, short and long responses
PICK = {"base": [3, 4, 14, 34, 80, 105, 193], "long_context": [17, 41, 107]}


def _entries():
    out = []
    for cat, idx in PICK.items():
        by_id = {e["id"]: e for e in bfcl.load_entries(cat)}
        out += [by_id[f"multi_turn_{cat}_{i}"] for i in idx]
    return out


@pytest.fixture(scope="module")
def entries():
    return _entries()


@pytest.fixture(scope="module")
def records(entries):
    return [bfcl.session(e) for e in entries]


def test_the_categories_load_whole():
    for cat in bfcl.CATEGORIES:
        es = bfcl.load_entries(cat)
        assert len(es) == 200 and all(len(e["question"]) == len(e["ground_truth"]) for e in es)
    assert {c for e in _entries() for c in e["involved_classes"]} == {
        "GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot", "TravelAPI",
        "VehicleControlAPI"}


def test_execution_is_deterministic_offline_and_writes_nothing(entries, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def no_network(*a, **k):
        raise AssertionError("a simulator opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for e in entries:
        first, second = bfcl.execute(e), bfcl.execute(e)
        assert [[c.output for c in t] for t in first] == [[c.output for c in t] for t in second], e["id"]
        assert [len(t) for t in first] == [len(t) for t in e["ground_truth"]]
        assert not any(c.output.startswith("Error during execution") for t in first for c in t), e["id"]
    assert list(tmp_path.iterdir()) == []
    long = [c.output for e in entries if e["category"] == "long_context" for t in bfcl.execute(e) for c in t]
    assert max(map(len, long)) > 10_000  # the long_context scenarios are loaded (long_context=True)


def test_the_executor_matches_bfcls_own(entries):
    """Same outputs as `bfcl_eval`'s `execute_multi_turn_func_call`, turn by turn, state carried over."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mtu

    for e in entries:
        ours = bfcl.execute(e)
        name = "kvsteward_test"
        try:
            for t, turn in enumerate(e["ground_truth"]):
                theirs, _ = mtu.execute_multi_turn_func_call(turn, e["initial_config"], e["involved_classes"], name,
                                                             e["id"], long_context=e["category"] == "long_context")
                assert theirs == [c.output for c in ours[t]], (e["id"], t)
        finally:
            for k in [k for k in vars(mtu) if k.startswith(f"{name}_")]:
                delattr(mtu, k)


def test_positional_arguments_get_their_names():
    sims = bfcl.Simulators(bfcl.load_entries("base", 1)[0], long_context=False)
    call = sims.call("sort('final_report.pdf')")  # the file is not in the root: an error dict, still named
    assert call.name == "sort" and call.arguments == {"file_name": "final_report.pdf"}
    assert call.cls == "GorillaFileSystem"


def test_session_layout(records, entries):
    for r, e in zip(records, entries, strict=True):
        m = r["messages"]
        assert m[0]["role"] == "system"
        called = {x["tool_calls"][0]["function"]["name"] for x in m if x.get("tool_calls")}
        assert all(f"- {n}(" in m[0]["content"] for n in called)  # the agent is shown every tool it calls
        assert not any(f"- {n}(" in m[0]["content"] for n in e.get("excluded_function") or [])
        assert [x["content"] for x in m if x["role"] == "user"] == [t[0]["content"] for t in e["question"]]
        calls = [x for x in m if x.get("tool_calls")]
        assert len(calls) == sum(map(len, e["ground_truth"])) == sum(x["role"] == "tool" for x in m)
        for i, x in enumerate(m):
            if x["role"] == "tool":
                assert m[i - 1]["tool_calls"][0]["id"] == x["tool_call_id"]
                assert r["cues"][str(i)] in e["involved_classes"]
        assert sum(x.get("content") == bfcl.CLOSING for x in m) == len(e["question"])
        assert r["env"] == "bfcl" and r["bfcl_id"] == e["id"]


def test_known_reads_on_real_conversations(records):
    """Edges checked by hand: the zip code that get_zipcode_based_on_city returns feeds estimate_distance; the
    order id of place_order feeds get_order_details; the booking id of book_flight feeds the invoice."""
    by = {r["bfcl_id"]: r for r in records}

    def call(r, s):
        return r["messages"][s]["tool_calls"][0]["function"]

    r = by["multi_turn_base_80"]
    assert r["reads"]["6"] == [3, 5] and call(r, 6)["name"] == "estimate_distance"
    for c in (3, 5):
        assert call(r, c - 1)["name"] == "get_zipcode_based_on_city"
        assert json.loads(r["messages"][c]["content"])["zipcode"] in json.loads(call(r, 6)["arguments"]).values()
    r = by["multi_turn_long_context_107"]
    assert call(r, 6)["name"] == "place_order" and r["reads"]["10"] == [7] and r["reads"]["14"] == [7]
    order_id = json.loads(r["messages"][7]["content"])["order_id"]
    assert json.loads(call(r, 10)["arguments"])["order_id"] == order_id
    r = by["multi_turn_base_193"]
    assert r["reads"]["6"] == [3] and call(r, 2)["name"] == "authenticate_travel"


def test_every_edge_points_back_to_the_first_showing_of_a_used_value(records):
    for r in records:
        m = r["messages"]
        for s, cs in r["reads"].items():
            s = int(s)
            assert m[s]["role"] == "assistant"
            for c in cs:
                assert c < s and m[c]["role"] == "tool"
                vals = [v for v in bfcl.step_values(m[s]) if bfcl.shows(m[c]["content"], v)]
                assert vals, (r["id"], s, c)
                assert any(not any(bfcl.shows(bfcl.shown_text(m[j]), v) for j in range(c)) for v in vals)


def test_mini_conversation_rule():
    """The rule on a hand-written conversation, labels written out by hand."""
    def call(cid, name, args):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

    def tool(cid, text):
        return {"role": "tool", "tool_call_id": cid, "content": text}

    msgs = [
        {"role": "system", "content": "Tools: find, open, pay, note."},                    # 0
        {"role": "user", "content": "Find invoice INV-7 for ACME Corp and pay it."},     # 1
        call("a", "find", {"query": "INV-7"}),                                           # 2: INV-7 from the user
        tool("a", '{"id": "doc-48213", "vendor": "ACME Corp", "total": 1250.5, "cur": "EUR"}'),  # 3
        call("b", "open", {"doc_id": "doc-48213", "vendor": "ACME Corp"}),               # 4: reads 3 (doc id)
        tool("b", '{"iban": "DE8937040044", "ref": "doc-48213", "note": "ok"}'),         # 5: repeats the doc id
        call("c", "pay", {"to": ["DE8937040044"], "amount": 1250.5, "memo": "doc-48213", "cur": "EUR"}),
        #  6: reads 5 (iban in a list) and 3 (amount; the memo's first showing is 3, not its repeat in 5);
        #     "EUR" is shorter than 4 characters: no read
        tool("c", '{"status": "paid", "receipt": "R-99102"}'),                           # 7
        call("d", "note", {"text": "ok", "tag": "paidx", "ref": "R-9910"}),              # 8: no read: "ok" is
        #     short, "paidx" is not "paid", "R-9910" only occurs inside the longer "R-99102"
        tool("d", "None"),                                                               # 9
        {"role": "assistant", "content": "Paid 1250.5 EUR, receipt R-99102; the vendor was paid."},  # 10: reads
        #     3 (the amount) and 7 (the receipt); the plain word "paid" is no value
    ]
    assert bfcl.value_reads(msgs) == {4: [3], 6: [3, 5], 10: [3, 7]}
    assert bfcl.value_reads(msgs, min_chars=3)[6] == [3, 5]  # EUR: first shown by the response 3 as well
    assert bfcl.value_reads(msgs, min_chars=20) == {}


def test_import_round_trip_and_hindsight_labels(records, tmp_path):
    path = tmp_path / "bfcl.jsonl"
    bfcl.write_sessions(path, records)
    traces = provenance_traces(read_openai_jsonl(path), str(path))
    assert [t.task_id for t in traces] == [r["id"] for r in records]
    for t, r in zip(traces, records, strict=True):
        assert t.label_source == "provenance" and t.env == "bfcl" and t.answer == ""
        assert t.reads == {int(k): v for k, v in r["reads"].items()}
        assert t.cues == {int(k): v for k, v in r["cues"].items()}
        for i, (tm, om) in enumerate(zip(t.messages, r["messages"], strict=True)):
            if om["role"] == "tool":
                assert cursor_id(tm["content"]) == i and cursor_body(tm["content"]) == om["content"]
            elif om.get("tool_calls"):
                assert parse_tool_calls(tm["content"])[1] == [
                    {"name": om["tool_calls"][0]["function"]["name"],
                     "arguments": json.loads(om["tool_calls"][0]["function"]["arguments"])}]
        # hindsight: at each boundary a cursor is expired exactly when no step from there on reads it
        readers = {c: [int(s) for s, cs in r["reads"].items() if c in cs] for c in t.cursors()}
        for b in hs.boundaries(t, 1):
            want = sorted(c for c in t.cursors() if c < b and all(s < b for s in readers[c]))
            assert hs.expired(t, b) == want
            assert hs.delete_target(t.cursors(), t, b)["del_cursors"] == want
    assert any(hs.future_readers(t, b) for t in traces for b in hs.boundaries(t, 1))


def test_a_conversation_and_its_long_context_version_share_a_split(tmp_path):
    from kvsteward.synth.rng import mix
    from kvsteward.synth.traces.generate import split_of

    for i in range(40):
        ids = [bfcl.session_id(c, i) for c in bfcl.CATEGORIES]
        assert ids[0] == f"bfcl-base-{i}" and ids[1].startswith(f"bfcl-long_context-{i}")
        assert len({split_of(mix("import", t)) for t in ids}) == 1


def test_bfcl_sessions_replay_forms():
    trace_form = bfcl.bfcl_sessions(["base"], limit=2)
    openai_form = bfcl.bfcl_sessions(["base"], limit=2, form="openai")
    assert len(trace_form) == len(openai_form) == 2
    for tf, of in zip(trace_form, openai_form, strict=True):
        assert len(tf) == len(of) and all(set(m) == {"role", "content"} for m in tf)
        assert [m["role"] for m in tf] == [m["role"] for m in of]
        assert all(cursor_id(m["content"]) == i for i, m in enumerate(tf) if m["role"] == "tool")
    with pytest.raises(ValueError):
        bfcl.bfcl_sessions(["base"], limit=1, form="xml")
    with pytest.raises(ValueError):
        bfcl.load_entries("miss_func")


def test_cli(tmp_path):
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["synth", "bfcl", "--out", str(out), "--categories", "base", "--limit", "3",
                                 "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["sessions"] == 3 and summary["categories"]["base"]["conversations"] == 3
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["bfcl_id"] for x in lines] == [f"multi_turn_base_{i}" for i in range(3)]
    assert summary["categories"]["base"]["tool_responses"] == sum(
        m["role"] == "tool" for x in lines for m in x["messages"])
    bad = CliRunner().invoke(app, ["synth", "bfcl", "--out", str(out), "--categories", "miss_func"])
    assert bad.exit_code == 2


def test_the_bench_workloads_and_what_the_pool_must_hold(tok):
    """`--workload bfcl` replays `long_context` (long tool responses, where a drop frees something), `bfcl-base`
    the short ones; `footprint` plays the sessions' drops without a server: the final rows are the histories minus
    exactly the dropped messages."""
    from kvsteward.serve.bench.sglang import footprint, workload_sessions

    long = workload_sessions(tok, "bfcl", 3, 14, keep=2, reposition_every=0)
    base = workload_sessions(tok, "bfcl-base", 3, 14, keep=2, reposition_every=0)
    longest = [max(len(ids) for role, ids in s.pieces if role == "tool") for s in (long[0], base[0])]
    assert longest[0] > 500 > 100 > longest[1]
    got = footprint(long)
    want_rows = want_hist = 0
    for s in long:  # footprint works on copies: the sessions are still unplayed
        assert s.turn == 0 and not s.messages
        while not s.done():
            msgs, cache = s.request()
            s.reply()
        gone = {i for ids in cache["drop"].values() for i in ids}
        assert gone
        want_rows += sum(len(m) for i, m in enumerate(msgs) if i not in gone)
        want_hist += sum(len(m) for m in msgs)
    assert got == {"rows": want_rows, "histories": want_hist} and got["rows"] < got["histories"]
    with pytest.raises(ValueError, match="bfcl-base"):
        workload_sessions(tok, "bfcl-long", 1, 2, keep=2, reposition_every=0)
