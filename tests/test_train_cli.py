"""`steward train lora` refuses bad input with a clear message (exit code 2), before any training."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvsteward.models import tiny_model
from kvsteward.pipelines.cli import app
from kvsteward.train.lora import QuantizedModelError, load_base
from kvsteward.train.toy import random_ids_dataset


@pytest.fixture()
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    tiny_model().save_pretrained(tmp_path / "tiny")
    random_ids_dataset(rows=30).save_to_disk(str(tmp_path / "ds"))
    return tmp_path


def _run(tmp_path, *extra: str):
    args = ["train", "lora", "--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"), "--max-steps", "1",
            "--no-mlflow", "--json", *extra]
    return CliRunner().invoke(app, args)


def test_model_still_marked_quantized_is_refused(files):
    cfg_path = files / "tiny" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "gguf"}  # what a GGUF load leaves behind
    cfg_path.write_text(json.dumps(cfg))
    res = _run(files, "--model", str(files / "tiny"))
    assert res.exit_code == 2
    assert "marked quantized" in res.stderr and "steward models pull" in res.stderr
    assert res.stdout == ""
    with pytest.raises(QuantizedModelError):
        load_base(str(files / "tiny"))


def test_missing_dataset_and_bad_options_are_named(files):
    res = _run(files, "--model", str(files / "tiny"), "--data", str(files / "nowhere"))
    assert res.exit_code == 2 and "does not exist" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--deepspeed", "zero5")
    assert res.exit_code == 2 and "deepspeed must be none, zero2 or zero3" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--max-len", "8")
    assert res.exit_code == 2 and "raise --max-len" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--hard-weight", "0")
    assert res.exit_code == 2 and "hard_weight must be ≥ 1" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--lora-dropout", "1")
    assert res.exit_code == 2 and "lora dropout must be in [0, 1)" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--skip-trivial")  # random ids: no deletion rows to weigh
    assert res.exit_code == 2 and "need the hindsight columns" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--keep-best")
    assert res.exit_code == 2 and "keep_best needs validation rows" in res.stderr


def test_toy_data_writes_three_splits_of_chat_rows(tmp_path):
    from datasets import load_from_disk

    from kvsteward.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    tok.save_pretrained(tmp_path / "tok")
    res = CliRunner().invoke(app, ["train", "toy-data", "--out", str(tmp_path / "toy"), "--model",
                                   str(tmp_path / "tok"), "--rows", "20"])
    assert res.exit_code == 0, res.stderr[-2000:]
    ds = load_from_disk(str(tmp_path / "toy"))
    assert set(ds) == {"train", "validation", "test"} and sum(len(s) for s in ds.values()) == 20
    row = ds["train"][0]
    assert len(row["input_ids"]) == len(row["labels"]) and any(x != -100 for x in row["labels"])


def test_adapter_scope_aux_trains_without_main_rows_and_refuses_rows_without_a_fork(files):
    """`--adapter-scope aux`: main rows are left out (no KL term, `final_kl_main` null) and the adapter is written;
    a dataset whose aux rows lack `fork_at` is refused by name."""
    res = _run(files, "--model", str(files / "tiny"), "--adapter-scope", "aux", "--max-steps", "2", "--save-steps", "1",
               "--eval-rows", "2", "--keep-best")
    assert res.exit_code == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["steps"] == 2 and out["final_kl_main"] is None and out["final_ce_aux"] > 0
    assert out["best_step"] in (1, 2) and out["eval_loss"] >= out["best_eval_loss"] > 0  # validation, aux scope
    assert "main rows left out" in res.stderr
    # token-id rows carry no messages / cursors: CE only, said on stderr; choosing by F1 is refused by name
    assert out["eval_f1"] is None and out["best_eval_f1"] is None and "no decision scores" in res.stderr
    bad = _run(files, "--model", str(files / "tiny"), "--eval-rows", "2", "--best-metric", "f1",
               "--out", str(files / "run_f1"))
    assert bad.exit_code == 2 and "--best-metric f1 cannot score" in bad.stderr and "hindsight columns" in bad.stderr
    assert (files / "run" / "adapter" / "adapter_model.safetensors").exists()
    # the adapter records how it was trained: no dataset card → the `ids` trigger
    assert json.loads((files / "run" / "adapter" / "kvsteward.json").read_text()) == {"trigger": "ids",
                                                                                      "adapter_scope": "aux",
                                                                                      "aux_context": "full"}
    (files / "ds" / "card.json").write_text(json.dumps({"config": {"trigger": "notes"}}))
    res = _run(files, "--model", str(files / "tiny"), "--out", str(files / "run_notes"))
    assert res.exit_code == 0, res.stderr[-2000:]
    assert json.loads((files / "run_notes" / "adapter" / "kvsteward.json").read_text()) == {"trigger": "notes",
                                                                                            "adapter_scope": "all",
                                                                                            "aux_context": "full"}
    (files / "ds" / "card.json").unlink()
    from datasets import load_from_disk

    ds = load_from_disk(str(files / "ds"))
    ds.map(lambda r: {"fork_at": 0}).save_to_disk(str(files / "old"))
    res = _run(files, "--model", str(files / "tiny"), "--adapter-scope", "aux", "--data", str(files / "old"))
    assert res.exit_code == 2 and "no fork point" in res.stderr and "--adapter-scope all" in res.stderr
    res = _run(files, "--model", str(files / "tiny"), "--adapter-scope", "aux", "--deepspeed", "zero3")
    assert res.exit_code == 2 and "ZeRO-3" in res.stderr
