"""Blueprints (PACE planner output) and the foresight bonus.

Format (JSON): a list of `{"span": [start_token, end_token], "readers": [step, ...]}`.
- `span` is a half-open range of logical token indices (0-based, in append order);
- `readers` are the future steps that will read the span, where step = message index (each `Session.append`
  opens a new step unless told to continue the current message).

Foresight bonus at step t for a span whose next reader is s_n = min{s in readers : s >= t}: τ / (s_n − t + 1),
τ = 1e5; 0 once t is past its last reader. τ dwarfs any cumulative-attention score, so planned spans outrank
unplanned ones and the soonest-needed span ranks highest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

TAU = 1e5


class BlueprintError(ValueError):
    """A malformed blueprint; the message names the entry and the problem."""


@dataclass(frozen=True)
class PlannedSpan:
    start: int
    end: int
    readers: tuple[int, ...]

    def next_reader(self, step: int) -> int | None:
        upcoming = [s for s in self.readers if s >= step]
        return min(upcoming) if upcoming else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_blueprint(data) -> list[PlannedSpan]:
    """Validate a blueprint (JSON text, or the decoded list) into PlannedSpans."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise BlueprintError(f"blueprint is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise BlueprintError(f"blueprint must be a list of spans, got {type(data).__name__}")
    spans = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or set(entry) - {"span", "readers"} or "span" not in entry:
            raise BlueprintError(f"blueprint[{i}] must be an object with keys 'span' and 'readers', got {entry!r}")
        span, readers = entry["span"], entry.get("readers", [])
        if not isinstance(span, (list, tuple)) or len(span) != 2 or not all(_is_int(x) for x in span):
            raise BlueprintError(f"blueprint[{i}].span must be [start_token, end_token] integers, got {span!r}")
        start, end = span
        if start < 0 or end <= start:
            raise BlueprintError(f"blueprint[{i}].span [{start}, {end}) is empty or negative")
        if not isinstance(readers, list) or not all(_is_int(s) and s >= 0 for s in readers):
            raise BlueprintError(f"blueprint[{i}].readers must be a list of non-negative step ints, got {readers!r}")
        spans.append(PlannedSpan(start, end, tuple(sorted(set(readers)))))
    return spans


def foresight_bonus(spans: list[PlannedSpan], logical: torch.Tensor, step: int, tau: float = TAU) -> torch.Tensor:
    """Bonus per slot (float32, same shape as `logical`): the largest bonus of any planned span covering the slot."""
    bonus = torch.zeros(logical.shape, dtype=torch.float32, device=logical.device)
    for span in spans:
        s_next = span.next_reader(step)
        if s_next is None:
            continue
        inside = (logical >= span.start) & (logical < span.end)
        bonus = torch.where(inside, torch.clamp(bonus, min=tau / (s_next - step + 1)), bonus)
    return bonus
