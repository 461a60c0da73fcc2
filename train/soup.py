"""A soup of memory-manager adapters: one LoRA whose weight delta is the weighted mean of several adapters' deltas.

Seeds of one training configuration differ widely (docs/results/2026-12-01-manager-calibrated-on-validation: the same
data and budget give 5–16 % harmful deletions); averaging their weights (a "uniform model soup", Wortsman et al. 2022)
removes the luck of the draw at the cost of one adapter — one aux-thread forward per token, unlike an ensemble of
decoders. (On that recipe the soup of three seeds lands at the median seed:
docs/results/2026-12-01-manager-soup-cue-weights-60min.) PEFT's
`add_weighted_adapter(combination_type="cat")` makes it exactly: the LoRA factors side by side, rank the sum of the
ranks, ΔW = Σ wᵢ·sᵢ·BᵢAᵢ (no SVD truncation). The soup is a new manager: its close bias is calibrated afresh.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvsteward import models

# Recorded fields that must agree: a soup of managers trained on different trigger layouts, scopes or contexts
# has no single served computation.
SERVING_FIELDS = ("trigger", "adapter_scope", "aux_context")
LORA_FIELDS = ("target_modules", "layers_to_transform", "peft_type", "task_type", "use_dora", "use_rslora")


class SoupError(ValueError):
    """Adapters that cannot be souped (named in the message)."""


def soup_weights(count: int, weights: Sequence[float] | None) -> list[float]:
    """The normalized weights (summing to 1): uniform by default; refused when not finite and positive."""
    if count < 2:
        raise SoupError(f"a soup needs at least 2 adapters, got {count}")
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise SoupError(f"{len(weights)} weights for {count} adapters")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise SoupError(f"weights must be finite and > 0, got {list(weights)}")
    total = sum(weights)
    return [w / total for w in weights]


def check_soup(adapters: Sequence[str | Path]) -> dict:
    """Refuse adapters that do not share a LoRA layout and a serving record; return the shared record."""
    for a in adapters:
        models.check_adapter(a)
    configs = [json.loads((Path(a).expanduser() / "adapter_config.json").read_text()) for a in adapters]
    for key in LORA_FIELDS:
        seen = {json.dumps(sorted(v) if isinstance(v := c.get(key), list) else v) for c in configs}
        if len(seen) > 1:
            raise SoupError(f"adapters differ in {key}: {sorted(seen)}")
    metas = [models.adapter_meta(a) for a in adapters]
    for key in SERVING_FIELDS:
        seen = {m.get(key) for m in metas}
        if len(seen) > 1:
            raise SoupError(f"adapters were trained with different {key}: {sorted(map(str, seen))}")
    return {k: metas[0][k] for k in SERVING_FIELDS if k in metas[0]}


def soup(adapters: Sequence[str | Path], out: str | Path, model: str = "smollm2",
         weights: Sequence[float] | None = None) -> dict:
    """Write the soup of `adapters` (LoRA folders on the base `model`) to `out`; return its record.

    `out` must not exist (or be empty); the folder appears whole or not at all (built beside it, then renamed)."""
    from peft import PeftModel

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SoupError(f"{out} exists and is not an empty folder")
    shares = soup_weights(len(adapters), weights)
    record = check_soup(adapters)
    base, tokenizer = models.load(model)
    names = [f"part{i}" for i in range(len(adapters))]
    peft_model = PeftModel.from_pretrained(base, str(adapters[0]), adapter_name=names[0])
    for name, adapter in zip(names[1:], adapters[1:], strict=True):
        peft_model.load_adapter(str(adapter), adapter_name=name)
    peft_model.add_weighted_adapter(names, shares, "soup", combination_type="cat")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        peft_model.save_pretrained(tmp, selected_adapters=["soup"])
        built = Path(tmp) / "soup"  # PEFT saves a named adapter in a subfolder of that name
        tokenizer.save_pretrained(str(built))
        meta = {**record, "soup": {"adapters": [str(Path(a).expanduser().resolve()) for a in adapters],
                                   "weights": shares, "combination": "cat"}}
        models.write_adapter_meta(built, meta)
        if out.exists():
            out.rmdir()
        shutil.move(str(built), str(out))
    return {"adapter_dir": str(out), "rank": peft_model.peft_config["soup"].r, **meta}
