"""`Engine.adapter(False)`: a PEFT model's forward is the base model's, bit for bit, the same as PEFT's own
`disable_adapter()` gives; the adapter's layers are as they were afterwards (also after an error), and a layer the
user had switched off stays off."""

from __future__ import annotations

import pytest
import torch

from kvsteward.serve.engine import Engine
from kvsteward.serve.server.testing import tiny_chat_engine

torch.set_num_threads(1)


def _peft_engine():
    from peft import LoraConfig, get_peft_model

    base = tiny_chat_engine(seed=7)
    model = get_peft_model(base.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return Engine(model, base.tokenizer)


def test_the_base_only_forward_equals_peft_s_own_and_restores_the_layers():
    from peft.tuners.tuners_utils import BaseTunerLayer

    e = _peft_engine()
    ids = torch.arange(5, 25).unsqueeze(0)
    with torch.no_grad():
        with_adapter = e.model(ids).logits
        with e.model.disable_adapter():
            peft_base = e.model(ids).logits
        with e.adapter(False):
            ours = e.model(ids).logits
        with e.adapter(True):
            again = e.model(ids).logits
    assert torch.equal(ours, peft_base) and not torch.allclose(ours, with_adapter)
    assert torch.equal(again, with_adapter)
    layers = [m for m in e.model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and not any(m.disable_adapters for m in layers)
    layers[0]._disable_adapters = True  # switched off by hand: it stays off after the context
    with pytest.raises(RuntimeError), e.adapter(False):
        assert all(m.disable_adapters for m in layers)
        raise RuntimeError("a forward failed")
    assert layers[0].disable_adapters and not any(m.disable_adapters for m in layers[1:])
