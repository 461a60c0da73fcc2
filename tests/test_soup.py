"""`steward train soup`: the soup's forward equals the base model with the weighted mean of the adapters' merged
weights (the model-soup definition, computed independently through PEFT's merge), and bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvsteward.models import ADAPTER_META, adapter_meta
from kvsteward.pipelines.cli import app
from kvsteward.train.soup import SoupError, check_soup, soup, soup_weights

META = {"trigger": "notes", "adapter_scope": "aux", "aux_context": "first"}


def _adapter(tiny_folder, path, seed: int, rank: int = 2, meta: dict | None = None, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so each adapter really changes the model
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False, **lora)
    get_peft_model(base, config).save_pretrained(path)
    (path / ADAPTER_META).write_text(json.dumps({**META, "close_bias": 1.0, **(meta or {})}))
    return path


def _merged_state(tiny_folder, adapter) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()


def test_the_soup_is_the_weighted_mean_of_the_merged_models(tiny_folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    parts = [_adapter(tiny_folder, tmp_path / f"a{i}", seed=i, rank=r) for i, r in enumerate((2, 4, 2))]
    result = soup(parts, tmp_path / "soup", model=str(tiny_folder), weights=[1, 2, 1])
    assert result["rank"] == 8 and result["soup"]["weights"] == [0.25, 0.5, 0.25]

    # reference: merge each adapter into the weights, average the weights, run the plain model
    states = [_merged_state(tiny_folder, p) for p in parts]
    reference = AutoModelForCausalLM.from_pretrained(tiny_folder)
    reference.load_state_dict({k: 0.25 * states[0][k] + 0.5 * states[1][k] + 0.25 * states[2][k] for k in states[0]})
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_folder), str(tmp_path / "soup"))
    ids = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, served(ids).logits
        single = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_folder), str(parts[1]))(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(got, single, atol=1e-3)  # the soup is not just one of its parts

    meta = adapter_meta(tmp_path / "soup")
    assert {k: meta[k] for k in META} == META
    assert meta["close_bias"] == 0.0  # a new manager: calibrated afresh, not the parts' bias
    assert (tmp_path / "soup" / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob(".soup.*"))  # nothing left of the build folder


def test_bad_soups_are_refused_before_anything_is_written(tiny_folder, tmp_path):
    a = _adapter(tiny_folder, tmp_path / "a", seed=0)
    with pytest.raises(SoupError, match="at least 2"):
        soup_weights(1, None)
    with pytest.raises(SoupError, match="finite and > 0"):
        soup_weights(2, [1.0, 0.0])
    with pytest.raises(SoupError, match="2 weights for 3"):
        soup_weights(3, [1.0, 1.0])
    other_context = _adapter(tiny_folder, tmp_path / "b", seed=1, meta={"aux_context": "full"})
    with pytest.raises(SoupError, match="different aux_context"):
        check_soup([a, other_context])
    other_layers = _adapter(tiny_folder, tmp_path / "c", seed=1, layers_to_transform=[0])
    with pytest.raises(SoupError, match="layers_to_transform"):
        check_soup([a, other_layers])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    with pytest.raises(SoupError, match="not an empty folder"):
        soup([a, _adapter(tiny_folder, tmp_path / "d", seed=2)], tmp_path / "taken", model=str(tiny_folder))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]


def test_cli_soup(tiny_folder, tmp_path):
    parts = [str(_adapter(tiny_folder, tmp_path / f"a{i}", seed=i)) for i in range(2)]
    runner = CliRunner()
    ok = runner.invoke(app, ["train", "soup", *parts, "--out", str(tmp_path / "s"), "--model", str(tiny_folder),
                             "--json"])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout.strip().splitlines()[-1])
    assert out["rank"] == 4 and out["soup"]["weights"] == [0.5, 0.5] and out["aux_context"] == "first"
    bad = runner.invoke(app, ["train", "soup", *parts, "--out", str(tmp_path / "t"), "--weights", "1,x"])
    assert bad.exit_code == 2 and "comma-separated numbers" in bad.output
    missing = runner.invoke(app, ["train", "soup", parts[0], str(tmp_path / "nope"), "--out", str(tmp_path / "u")])
    assert missing.exit_code == 2 and "adapter_config.json" in missing.output
