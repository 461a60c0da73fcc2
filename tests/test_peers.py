"""`steward bench peers`: kvpress 0.5.5 (its own virtualenv, `make kvpress-venv`) beside the engine on RULER prompts
that RULER's own generator writes offline. The independent reference is kvpress's pipeline on transformers 5.2: on
the same token ids the engine's uncompressed answer equals it, both stacks keep the same number of tokens per pair,
and StreamingLLM (the same kept set in both: 4 sinks + the newest tokens, original positions) answers the same."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvsteward.eval.peers import ruler
from kvsteward.eval.peers.bench import kept_tokens, table_rows
from kvsteward.pipelines.cli import app


def test_split_takes_the_context_question_and_ruler_answer_prefix():
    text = ("A special magic number is hidden within the following text. Make sure to memorize it.\nThe grass is "
            "green.\nOne of the special magic numbers for tidy-owl is: 123.\n" + ruler.MARK
            + "What is the special magic number for tidy-owl mentioned in the provided text?")
    t = ruler.split("niah_single_1-0", text, ["123"])
    assert t["context"].endswith("is: 123.\n") and t["question"].startswith("What is")
    assert t["answer_prefix"] == " The special magic number for tidy-owl mentioned in the provided text is"
    with pytest.raises(ValueError, match="not a RULER niah question"):
        ruler.split("x", "context" + ruler.MARK + "Who are you?", ["1"])


def test_string_match_all_is_rulers_metric():
    assert ruler.string_match_all(" 123 and 456.", ["123", "456"]) == 1.0
    assert ruler.string_match_all(" 123.", ["123", "456"]) == 0.5
    assert ruler.string_match_all(" ABC-def", ["abc-DEF"]) == 1.0
    assert kept_tokens(450, 0.5) == 225 and kept_tokens(451, 0.75) == 112  # kvpress: int(n * (1 - ratio))


@pytest.mark.slow
def test_bench_peers_side_by_side_on_the_embedded_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --workdir: RULER's generator runs inside it
    res = CliRunner().invoke(app, ["bench", "peers", "--model", "smollm2", "--tasks", "niah_single_1", "--samples",
                                   "1", "--length", "512", "--ratios", "0.5", "--presses", "streaming,snapkv",
                                   "--policies", "streaming,snapkv,snapkv-heads,tova-layers", "--max-new-tokens",
                                   "12", "--workdir", "work", "--json"])
    assert res.exit_code == 0, (res.stderr[-2000:], res.exception)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["workload"]["versions"]["kvpress"] and r["workload"]["versions"]["transformers"].startswith("5.2")
    # the same ids, the same weights, no compression: the same greedy answer in both stacks
    assert r["full_agreement"] == 1.0
    rows = {(side, row.get("press") or row.get("policy"), row["ratio"]): row
            for side in ("kvpress", "engine") for row in r["rows"][side]}
    n = r["workload"]["context_tokens_mean"]
    for pair in r["pairs"]:
        k, e = rows[("kvpress", pair["kvpress"], 0.5)], rows[("engine", pair["engine"], 0.5)]
        assert k["kept"] == e["kept"] == kept_tokens(int(n), 0.5), pair
    assert rows[("kvpress", "streaming", 0.5)]["answer"] == rows[("engine", "streaming", 0.5)]["answer"]
    # per-head selection: every head keeps as many tokens as kvpress's heads; resident is their union
    heads = rows[("engine", "snapkv-heads", 0.5)]
    assert heads["kept"] == kept_tokens(int(n), 0.5) < heads["resident"] and rows[("engine", "snapkv", 0.5)][
        "resident"] == kept_tokens(int(n), 0.5)
    layers = rows[("engine", "tova-layers", 0.5)]  # per layer: each layer keeps as many; resident is their union
    assert layers["kept"] == kept_tokens(int(n), 0.5) <= layers["resident"]
    assert {m for m, *_ in table_rows(r)} >= {"kvpress: snapkv", "engine: snapkv", "engine: full (uncompressed)"}
    assert (tmp_path / "work" / "niah_single_1" / "validation.jsonl").exists()  # RULER's generator wrote the prompts
