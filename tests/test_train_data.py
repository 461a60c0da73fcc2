"""Training data: collator padding, length filter, dataset checks, deletion-row difficulty and weighting, the toy chat
dataset's labels."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from datasets import Dataset, DatasetDict

from kvsteward.train.data import Collator, DataError, check_vocab, fit_length, load_splits
from kvsteward.train.toy import chat_dataset, random_ids_dataset


def test_collator_pads_labels_with_ignore_and_keeps_is_aux():
    rows = [{"input_ids": [4, 5, 6], "labels": [-100, 5, 6], "is_aux": True, "kind": "delete", "messages": "[]",
             "fork_at": 1},
            {"input_ids": [7, 8, 9, 10, 11], "labels": [-100, -100, -100, 10, 11], "is_aux": False, "kind": "main",
             "messages": "[]", "fork_at": 0}]
    batch = Collator(pad_id=2)(rows)
    assert set(batch) == {"input_ids", "labels", "attention_mask", "is_aux", "aux_tokens", "lengths", "aux_thread"}
    assert batch["lengths"].tolist() == [3, 5]
    assert batch["aux_thread"].int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]  # from fork_at; none on main
    assert batch["input_ids"].tolist() == [[4, 5, 6, 2, 2], [7, 8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[-100, 5, 6, -100, -100], [-100, -100, -100, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["is_aux"].dtype == torch.bool and batch["is_aux"].tolist() == [True, False]
    assert batch["aux_tokens"].int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]


def test_collator_mixes_packed_and_plain_rows():
    """A packed row gets its tree mask, positions and branch-only CE tokens; a plain row in the same batch gets a
    causal mask over its own tokens, positions 0..n−1, and CE on every label iff it is an aux row."""
    packed = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, -100, 4, 5], "is_aux": True,
              "position_ids": [0, 1, 2, 3, 2], "segment": [0, 0, 1, 1, 0], "time": [0, 0, 1, 1, 2],
              "expire": [2, 2, 2**30, 2**30, 2**30]}
    plain = {"input_ids": [7, 8, 9], "labels": [-100, 8, 9], "is_aux": False}
    batch = Collator(pad_id=0)([packed, plain])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4]]
    assert batch["aux_tokens"].int().tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]
    assert batch["aux_thread"].int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]  # the branch: segment > 0
    m = batch["attention_mask"][:, 0].int().tolist()
    assert m[0] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert m[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]


def test_collator_rejects_misaligned_labels():
    with pytest.raises(DataError, match="3 input_ids but 2 labels"):
        Collator(pad_id=0)([{"input_ids": [1, 2, 3], "labels": [1, 2], "is_aux": True}])


def test_fit_length_drops_long_aux_rows_and_left_truncates_main_rows():
    ids = [list(range(5)), list(range(9)), list(range(4)), list(range(12)), list(range(10))]
    labels = [[-100] * 3 + [3, 4], [-100] * 7 + [7, 8], [-100, -100, 2, 3],
              [-100] * 4 + list(range(4, 8)) + [-100] * 4,  # main, labelled tokens 4..7: survive a cut to 8
              [-100, 1] + [-100] * 8]  # main, only token 1 labelled: nothing left after the cut → dropped
    ds = Dataset.from_dict({"input_ids": ids, "labels": labels, "is_aux": [True, True, False, False, False],
                            "kind": ["delete", "plan", "main", "main", "main"]})
    kept, dropped, truncated = fit_length(ds, max_len=8)
    assert kept["input_ids"] == [list(range(5)), list(range(4)), list(range(4, 12))]
    assert kept["labels"][2] == list(range(4, 8)) + [-100] * 4  # labels cut with their tokens
    assert dropped == {"plan": 1, "main": 1} and truncated == 1
    with pytest.raises(DataError, match="no auxiliary"):
        fit_length(ds.select([2, 3]), max_len=20)
    with pytest.raises(DataError, match="no row of 2 fits max_len=3"):
        fit_length(ds.select([0, 1]), max_len=3)


def test_load_splits_names_what_is_wrong(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_splits(tmp_path / "nope")
    DatasetDict({"validation": Dataset.from_dict({"input_ids": [[1]], "labels": [[1]], "is_aux": [True]})}) \
        .save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match="'train' split is required"):
        load_splits(tmp_path / "no_train")
    DatasetDict({"train": Dataset.from_dict({"input_ids": [[1]], "labels": [[1]]})}).save_to_disk(str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"lacks columns \['is_aux'\]"):
        load_splits(tmp_path / "c")
    random_ids_dataset(rows=20).save_to_disk(str(tmp_path / "ok"))
    ds = load_splits(tmp_path / "ok")
    assert set(ds) == {"train", "validation", "test"}


def test_check_vocab_catches_a_dataset_for_another_model():
    ds = Dataset.from_dict({"input_ids": [[1, 299], [3]], "labels": [[1, 299], [3]], "is_aux": [True, False]})
    check_vocab(ds, 300)
    with pytest.raises(DataError, match="token id 299 but the model's vocabulary has 256"):
        check_vocab(ds, 256)


def test_random_ids_dataset_shape():
    ds = random_ids_dataset(rows=40)
    train = ds["train"]
    for row in train:
        assert len(row["labels"]) == len(row["input_ids"])
        marked = [t for t in row["labels"] if t != -100]
        if row["is_aux"]:
            assert marked == [5, 6, 7, 8] and row["input_ids"][-4:] == [5, 6, 7, 8]
        else:
            assert marked == row["input_ids"][len(row["input_ids"]) - len(marked):] and marked


def test_chat_dataset_labels_exactly_the_assistant_json():
    from kvsteward.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    ds = chat_dataset(tok, rows=10, cursors=(4, 6), words=(3, 5), seed=1)
    rows = [r for split in ds.values() for r in split]
    assert {r["kind"] for r in rows} == {"delete", "main"}
    for r in rows:
        answer = json.loads(r["messages"])[-1]["content"]
        labelled = tok.decode([t for t in r["labels"] if t != -100])
        assert labelled.startswith(answer) and labelled[len(answer):].strip() in ("<|im_end|>", "")
        if r["is_aux"]:
            closed = [int(line.split(":")[0].split()[1]) for line in json.loads(r["messages"])[0]["content"]
                      .splitlines() if line.endswith("closed")]
            assert json.loads(answer) == {"del_cursors": closed}


def test_delete_row_difficulty_against_the_traces_provenance():
    """Each deletion row of real hindsight rows, classified from the row alone, against the trace: trivial = only the
    boundary's own response is open; easy = the target is every other open cursor; hard = one of those others is
    still read later (and so is kept by the target). Then the weighting repeats and leaves out exactly those rows."""

    from kvsteward.models import load_tokenizer
    from kvsteward.synth.traces.dataset import HindsightConfig, build_rows, features
    from kvsteward.synth.traces.generate import generate_traces
    from kvsteward.train.data import delete_row_difficulty, weigh_delete_rows

    traces = {t.task_id: t for t in generate_traces(8, seed=3)}
    rows, _, _ = build_rows(list(traces.values()), load_tokenizer("smollm2"),
                            HindsightConfig(every=1, max_tokens=4096, plan=False, mask_prob=0.5))
    seen = Counter()
    for row in rows:
        kind = delete_row_difficulty(row)
        if row["kind"] != "delete":
            assert kind == ""
            continue
        seen[kind] += 1
        trace, b = traces[row["task_id"]], row["step"]
        read = [c for c in row["open_cursors"] if c != b - 1]  # one tool call per step: only b - 1 is unread
        needed = [c for c in read if trace.last_use()[c] >= b]
        assert kind == ("trivial" if not read else "hard" if needed else "easy"), (row["task_id"], b, kind)
    assert seen["trivial"] and seen["easy"] and seen["hard"]

    ds = Dataset.from_list(rows, features=features())
    same, counts = weigh_delete_rows(ds)
    assert same is ds and counts == seen
    weighed, _ = weigh_delete_rows(ds, hard_weight=3, skip_trivial=True)
    assert len(weighed) == len(ds) + 2 * seen["hard"] - seen["trivial"]
    assert Counter(delete_row_difficulty(r) for r in weighed)["hard"] == 3 * seen["hard"]
    with pytest.raises(DataError, match="hard_weight"):
        weigh_delete_rows(ds, hard_weight=0)


def test_dataset_trigger_from_the_card_else_from_the_rows(tmp_path, tok):
    """The layout the adapter records: the card's entry, else the first deletion row's trigger, else `ids`."""
    from kvsteward.synth.traces.dataset import HindsightConfig, build_dataset
    from kvsteward.synth.traces.generate import generate_traces
    from kvsteward.train.data import dataset_trigger

    traces = generate_traces(4, seed=2)
    for style in ("ids", "notes"):
        dd, _, _ = build_dataset(traces, tok, HindsightConfig(every=2, plan=False, trigger=style))
        assert dataset_trigger(tmp_path, dd["train"]) == style  # no card in tmp_path: read off the rows
    (tmp_path / "card.json").write_text(json.dumps({"config": {"trigger": "notes"}}))
    assert dataset_trigger(tmp_path, dd["train"].select([])) == "notes"
    assert dataset_trigger(tmp_path / "nowhere", random_ids_dataset(rows=10)["train"]) == "ids"


def test_select_envs_keeps_only_the_named_environments_in_every_split():
    """`--envs`: a leave-one-environment-out run never sees the held-out environment's rows, in any split."""
    from datasets import Dataset, DatasetDict

    from kvsteward.train.data import DataError, select_envs

    rows = {"input_ids": [[1, 2]] * 6, "labels": [[-100, 2]] * 6, "is_aux": [True] * 6,
            "env": ["ops", "research", "support", "ops", "research", "support"]}
    dd = DatasetDict({"train": Dataset.from_dict(rows), "validation": Dataset.from_dict(rows)})
    out = select_envs(dd, "research,support")
    assert all(set(out[s]["env"]) == {"research", "support"} and len(out[s]) == 4 for s in out)
    with pytest.raises(DataError, match="no rows of \\['web'\\]"):
        select_envs(dd, "ops,web")
    with pytest.raises(DataError, match="needs the `env` column"):
        select_envs(DatasetDict({"train": Dataset.from_dict({k: v for k, v in rows.items() if k != "env"})}), "ops")
