"""The engine on the embedded SmolLM2 (provisioned by `make test`): generate() equivalence and ops vs reference."""

from __future__ import annotations

import pytest
import torch

from kvsteward.models import EMBEDDED, embedded_dir

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine():
    if not (embedded_dir("smollm2") / "config.json").exists():
        pytest.skip("SmolLM2 is not provisioned: run `steward models pull smollm2` (make test does)")
    from kvsteward.serve.engine import Engine

    assert "smollm2" in EMBEDDED
    return Engine.load("smollm2")


def test_smollm2_full_engine_equals_generate(engine):
    from kvsteward.serve.bench.checks import generate_equivalence

    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                                add_generation_prompt=True, tokenize=False)
    assert generate_equivalence(engine, engine.tokenizer.encode(text), new_tokens=24)


def test_smollm2_drop_reposition_and_refresh_match_reference(engine):
    from kvsteward.serve.bench.checks import op_logit_errors

    errs = op_logit_errors(engine, n=96)
    assert errs["drop"] < 1e-3 and errs["reposition"] < 1e-3 and errs["refresh"] < 1e-3, errs
