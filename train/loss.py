"""The joint loss on gathered positions: CE on auxiliary targets + KL(student ‖ teacher) on main-trace tokens.

Logits are never materialised for the whole (batch, time, vocab) block: only the rows of final hidden states where
a loss applies are gathered, and the LM head runs on those rows, in tiles. With more than one tile each tile is
activation-checkpointed, so at most one tile of (rows, vocab) logits is alive at a time (Qwen3's 151k vocabulary at
1024 rows is ~0.6 GB per fp32 logits tensor instead of batch × time × vocab).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
Head = Callable[[torch.Tensor], torch.Tensor]


def _jsd():
    # TRL's GKD divergence (beta=1 → KL(student ‖ teacher)); imported lazily, its module lives in trl.experimental.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def target_positions(labels: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch index, position, target token) of every labelled token selected by `rows` — a (B,) row mask or a
    (B, T) token mask aligned with `labels` — shifted for next-token prediction.

    The distribution that predicts token j is read at position j−1, so label j (≠ −100, j ≥ 1) maps to (b, j−1).
    """
    shifted = labels[:, 1:]
    mask = (shifted != IGNORE) & (rows[:, None] if rows.dim() == 1 else rows[:, 1:])
    b, t = mask.nonzero(as_tuple=True)
    return b, t, shifted[b, t]


def _tiles(n: int, tile_rows: int) -> list[slice]:
    return [slice(i, min(i + tile_rows, n)) for i in range(0, n, tile_rows)] or [slice(0, 0)]


def _maybe_checkpoint(fn, n_tiles: int, *args):
    # One tile: nothing to gain from recomputation. Several: keep only hidden rows, recompute logits in backward.
    return checkpoint(fn, *args, use_reentrant=False) if n_tiles > 1 else fn(*args)


def ce_sum(head: Head, hidden_rows: torch.Tensor, targets: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """Sum of next-token cross-entropy over gathered rows (N, H) with targets (N,)."""
    tiles = _tiles(hidden_rows.shape[0], tile_rows)

    def one(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float(), y, reduction="sum")

    return sum(_maybe_checkpoint(one, len(tiles), hidden_rows[s], targets[s]) for s in tiles)


def kl_sum(head: Head, student_rows: torch.Tensor, teacher_rows: torch.Tensor, tile_rows: int,
           temperature: float = 1.0) -> torch.Tensor:
    """Sum over gathered rows of KL(student ‖ teacher) of the next-token distributions.

    `teacher_rows` are the teacher's final hidden states at the same positions (no grad); both go through the same
    LM head, which LoRA does not touch, so teacher logits = head(teacher hidden) exactly.
    """
    jsd = _jsd()
    tiles = _tiles(student_rows.shape[0], tile_rows)

    def one(hs: torch.Tensor, ht: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = head(ht).float()
        return jsd(head(hs).float(), teacher_logits, labels=None, beta=1.0, temperature=temperature,
                   reduction="sum")

    return sum(_maybe_checkpoint(one, len(tiles), student_rows[s], teacher_rows[s]) for s in tiles)
