"""The trainer on the real embedded model: its head passes the gathered-row check (tied embeddings), KL starts at 0
and moves once the adapter trains."""

from __future__ import annotations

import pytest
import torch

from kvsteward.train.data import Collator
from kvsteward.train.lora import LoraRunConfig, load_base, training_args, wrap_lora
from kvsteward.train.toy import chat_dataset
from kvsteward.train.trainer import StewardTrainer

torch.set_num_threads(1)


@pytest.mark.slow
def test_smollm2_two_steps(tmp_path):
    base, tok, _ = load_base("smollm2")
    ds = chat_dataset(tok, rows=12, cursors=(3, 5), words=(4, 8), seed=2)["train"]
    cfg = LoraRunConfig(data="-", out=str(tmp_path), max_steps=2, lr=1e-3, batch_size=2, save_steps=100)
    model = wrap_lora(base, cfg)
    trainer = StewardTrainer(model=model, args=training_args(cfg, tmp_path / "ck"), train_dataset=ds,
                             data_collator=Collator(pad_id=tok.pad_token_id or 0))
    aux = [r for r in ds if r["is_aux"]][:1]
    main = [r for r in ds if not r["is_aux"]][:1]
    batch = Collator(pad_id=tok.pad_token_id or 0)(aux + main)
    with torch.no_grad():
        _, parts = trainer.compute_loss(model, batch, return_outputs=True)
    assert parts["kl_main"].item() == 0.0 and 0 < parts["ce_aux"].item() < 20
    trainer.train()
    assert trainer.state.global_step == 2
    model.eval()
    with torch.no_grad():
        _, parts = trainer.compute_loss(model, batch, return_outputs=True)
    assert parts["kl_main"].item() > 0
