"""A model or adapter that is not here is refused with one line naming it, before any slow load."""

from __future__ import annotations

import sys

import pytest

from kvsteward import models
from kvsteward.models import ModelNotFound
from kvsteward.pipelines import cli


def test_missing_local_folder_is_named_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ModelNotFound, match="model folder .*nope does not exist"):
        models.resolve(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFound, match="does not exist"):
        models.resolve("./nope")


def test_a_hub_id_the_hub_cannot_give_becomes_model_not_found(monkeypatch):
    from transformers import AutoTokenizer

    def offline(*_a, **_k):  # what transformers raises when the hub is unreachable and nothing is cached
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files\nCheck your connection")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ModelNotFound) as e:
        models.load_tokenizer("someone/missing-model")
    msg = str(e.value)
    assert "'someone/missing-model'" in msg and "smollm2" in msg and "couldn't connect" in msg
    assert "Check your connection" not in msg  # only the first line of the library's message


def test_a_broken_local_folder_keeps_its_own_error(tmp_path):
    (tmp_path / "broken").mkdir()  # no tokenizer files: transformers' own error says so
    with pytest.raises((OSError, ValueError)) as e:
        models.load_tokenizer(str(tmp_path / "broken"))
    assert not isinstance(e.value, ModelNotFound)


def test_adapter_without_config_is_refused_before_the_base_model_loads(tmp_path, monkeypatch):
    from kvsteward.serve.engine import Engine

    def no_load(*_a, **_k):
        raise AssertionError("the base model must not load for a missing adapter")

    monkeypatch.setattr(models, "load", no_load)
    with pytest.raises(ModelNotFound, match="adapter_config.json"):
        Engine.load("smollm2", adapter=str(tmp_path / "no-adapter"))


def test_steward_prints_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["steward", "eval", "manager", "--adapter", str(tmp_path / "none"),
                                      "--data", str(tmp_path), "--traces", str(tmp_path)])
    monkeypatch.setattr("kvsteward.synth.traces.trace.read_traces", lambda _p: [_FakeTrace()])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: adapter folder") and "Traceback" not in err


class _FakeTrace:
    split = "test"
    env = "research"


def test_pull_of_an_unknown_embedded_model_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["steward", "models", "pull", "nope"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: unknown embedded model 'nope'; known: ['smollm2']"
