"""Dataset rows against independent references: the chat module's token stream, decoded labels, blueprints."""

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.traces import dataset as dsm
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.blueprint import oracle_blueprint, plan_to_blueprint
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.solver import TraceConfig
from kvsteward.synth.traces.stats import dataset_stats
from kvsteward.synth.traces.tokens import PieceTokenizer, offsets
from kvsteward.synth.traces.trace import write_traces

CFG = TraceConfig(world_size=200, max_hops=4)


@pytest.fixture(scope="module")
def traces():
    return generate_traces(10, 21, CFG)


@pytest.fixture(scope="module")
def built(tok, traces):
    return dsm.build_dataset(traces, tok, dsm.HindsightConfig(every=2, max_tokens=4096))


def _labelled(row):
    return [t for t in row["labels"] if t != -100]


def test_main_rows_are_the_engine_token_stream(tok, traces, built):
    dd, _, lengths = built
    rows = {r["task_id"]: r for s in dd for r in dd[s] if r["kind"] == "main"}
    for t in traces:
        row = rows[t.task_id]
        stream = [i for p in message_token_ids(tok, t.messages) for i in p]
        assert lengths[t.task_id] == len(stream)
        assert row["input_ids"] == stream[-4096:]
        assistant = "".join(m["content"] + "<|im_end|>" for m in t.messages if m["role"] == "assistant")
        assert tok.decode(_labelled(row)) == assistant


def test_aux_labels_spell_exactly_the_target(tok, built):
    dd, _, _ = built
    aux = [r for s in dd for r in dd[s] if r["is_aux"]]
    assert {r["kind"] for r in aux} == {"delete", "plan"}
    for r in aux:
        msgs = json.loads(r["messages"])
        assert msgs[-2]["content"] == (hs.delete_trigger(r["open_cursors"]) if r["kind"] == "delete"
                                       else hs.PLAN_TRIGGER)
        assert msgs[-1]["content"] == r["target"]
        assert tok.decode(_labelled(r)) == r["target"] + "<|im_end|>"
        first = next(i for i, t in enumerate(r["labels"]) if t != -100)
        assert all(t != -100 for t in r["labels"][first:-1]) and r["labels"][-1] == -100  # contiguous, "\n" off
        assert r["input_ids"] == [i for p in message_token_ids(tok, msgs) for i in p]
        assert tok.decode(r["input_ids"][:first]).endswith("<|im_start|>assistant\n")


def test_targets_match_hindsight_and_masking(traces, built):
    dd, _, _ = built
    by_id = {t.task_id: t for t in traces}
    for r in (r for s in dd for r in dd[s] if r["kind"] == "delete"):
        t = by_id[r["task_id"]]
        gone = set(hs.expired(t, r["step"]))
        assert set(r["masked_cursors"]) <= gone
        assert set(json.loads(r["target"])["del_cursors"]) == gone & set(r["open_cursors"])
        assert not set(r["masked_cursors"]) & set(r["open_cursors"])


def test_split_disjointness_in_dataset(traces, built):
    dd, _, _ = built
    split_of = {t.task_id: t.split for t in traces}
    for s in dsm.SPLITS:
        assert all(split_of[i] == s for i in dd[s]["task_id"])


def test_blueprint_spans_are_tool_messages(tok, traces):
    t = traces[0]
    ptok = PieceTokenizer(tok)
    stream = [i for p in ptok.pieces(t.messages) for i in p]
    bp = oracle_blueprint(t, ptok)
    readers = {c: s for c, s in t.readers().items() if s}
    assert len(bp) == len(readers)
    for item, (c, steps) in zip(bp, sorted(readers.items()), strict=True):
        a, b = item["span"]
        assert tok.decode(stream[a:b]).startswith(f"<|im_start|>tool\n[cursor {c}]")
        assert item["readers"] == steps
    # A plan target converts to the future part of the same blueprint.
    b = hs.boundaries(t, 2)[0]
    plan = hs.plan_target(t.cursors(), t, b)
    starts = offsets(ptok.pieces(t.messages))
    got = plan_to_blueprint(plan, starts)
    want = [{"span": x["span"], "readers": [s for s in x["readers"] if s >= b]} for x in bp
            if any(s >= b for s in x["readers"]) and x["span"][0] < starts[b]]
    assert got == want
    with pytest.raises(ValueError, match="outside"):
        plan_to_blueprint({"plan": [{"cursor": 999, "readers": [1]}]}, starts)


def test_max_tokens_cap(tok, traces):
    dd, skipped, _ = dsm.build_dataset(traces[:3], tok, dsm.HindsightConfig(every=1, max_tokens=900))
    rows = [r for s in dd for r in dd[s]]
    assert all(r["n_tokens"] <= 900 and len(r["input_ids"]) == r["n_tokens"] for r in rows)
    assert any(r["truncated"] for r in rows if r["kind"] == "main")
    assert sum(skipped.values()) > 0


def test_saved_dataset_stats_and_error_detection(tmp_path, tok, traces, built):
    dd, skipped, lengths = built
    src = write_traces(tmp_path / "traces", traces, {}).parent
    c = dsm.card(traces, dd, skipped, dsm.HindsightConfig(every=2), str(src), lengths)
    dsm.save(dd, tmp_path / "ds", c)
    assert "oracle: 10 traces" in (tmp_path / "ds" / "README.md").read_text()
    s = dataset_stats(tmp_path / "ds")
    assert s["label_errors"] == 0
    assert s["main"] == 10 and s["aux_delete"] == s["aux_plan"] > 0
    assert sum(s["splits"].values()) == sum(len(dd[x]) for x in dd)
    assert s["mean_cursors"] == pytest.approx(sum(len(t.cursors()) for t in traces) / 10)
    # Corrupt one delete row (add a cursor a later step reads): the independent re-check must see it.
    train = dd["train"]
    idx = next(i for i, r in enumerate(train) if r["kind"] == "delete" and hs.future_readers(
        next(t for t in traces if t.task_id == r["task_id"]), r["step"]))

    def corrupt(row, i):
        if i != idx:
            return row
        t = next(t for t in traces if t.task_id == row["task_id"])
        live = next(iter(hs.future_readers(t, row["step"])))
        msgs = json.loads(row["messages"])
        msgs[-1]["content"] = json.dumps({"del_cursors": sorted(json.loads(row["target"])["del_cursors"] + [live])})
        return {**row, "messages": json.dumps(msgs)}

    dd["train"] = train.map(corrupt, with_indices=True)
    dsm.save(dd, tmp_path / "bad", c)
    bad = dataset_stats(tmp_path / "bad", check_tokens=False)
    assert bad["label_errors"] == 1 and bad["label_error_kinds"]["harmful"] == 1


def test_mlflow_logging_is_a_noop_without_a_run(built):
    import mlflow

    assert mlflow.active_run() is None
    assert dsm.log_to_mlflow(built[0], "x") is False


@pytest.mark.slow
def test_mlflow_logs_dataset_inputs_in_an_active_run(tmp_path, built, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/ml.db")
    with mlflow.start_run() as run:
        assert dsm.log_to_mlflow(built[0], "synth") is True
    inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    assert {i.dataset.name for i in inputs} == {f"synth-{s}" for s in dsm.SPLITS if len(built[0][s])}


def test_empty_splits_save_and_load(tmp_path, tok, traces):
    from datasets import load_from_disk

    only_train = [t for t in traces if t.split == "train"][:2]
    dd, skipped, lengths = dsm.build_dataset(only_train, tok, dsm.HindsightConfig(every=4))
    dsm.save(dd, tmp_path / "ds", dsm.card(only_train, dd, skipped, dsm.HindsightConfig(), "src", lengths))
    back = load_from_disk(str(tmp_path / "ds"))
    assert len(back["validation"]) == len(back["test"]) == 0 and len(back["train"]) == len(dd["train"])
    assert set(back["test"].column_names) == set(dsm.features())
