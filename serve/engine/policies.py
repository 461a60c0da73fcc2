"""Eviction policies, kvpress style: each policy is a small scorer returning one score per resident slot; one shared
step (`select_keep`) keeps the top-B, with the policy's protected sinks / recent window.

Score conventions: higher = keep. `+inf` = protected, `-inf` = must leave now even under budget (akv-rolling's
expired tool responses). All policies share the prefill schedule (chunk H, evict to B after each chunk) and the
decode cadence (evict to B after every decode step), so ablations differ only in the scorer and position mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvsteward.serve.engine.blueprint import PlannedSpan, foresight_bonus


@dataclass
class SlotView:
    """Read-only view of the resident slots that a scorer may use (all tensors [n], slots in logical order)."""

    logical: torch.Tensor
    position: torch.Tensor
    step: torch.Tensor  # message index each slot belongs to
    is_tool: torch.Tensor  # bool: slot belongs to a tool-response message
    cumulative: torch.Tensor  # H2O: attention received, summed over all queries so far
    window: torch.Tensor  # attention received from the latest forward's observation window
    current_step: int
    n_logical: int  # tokens appended so far (next logical index)
    blueprint: list[PlannedSpan] = field(default_factory=list)
    tool_steps: list[int] = field(default_factory=list)  # steps of tool-response messages, oldest first


@dataclass(frozen=True)
class Policy:
    """A named scorer plus its protection and position settings."""

    name: str
    score_mode: str  # what the attention function must collect: "none" | "cumulative" | "window"
    window: int = 1
    sinks: int = 4
    recent: int = 64
    keep_tool_responses: int = 3  # akv-rolling only
    pool_kernel: int = 7  # snapkv only

    @property
    def evicts(self) -> bool:
        return self.name != "full"

    def score(self, view: SlotView) -> torch.Tensor:
        return SCORERS[self.name](self, view)


def _recency(p: Policy, v: SlotView) -> torch.Tensor:
    return v.logical.float()


def _h2o(p: Policy, v: SlotView) -> torch.Tensor:
    return v.cumulative.clone()


def _tova(p: Policy, v: SlotView) -> torch.Tensor:
    return v.window.clone()


def _snapkv(p: Policy, v: SlotView) -> torch.Tensor:
    # SnapKV: the observation window's votes, max-pooled over neighbouring slots so whole phrases survive together.
    k = p.pool_kernel
    return F.max_pool1d(v.window.view(1, 1, -1), kernel_size=k, stride=1, padding=k // 2).view(-1)[: v.window.numel()]


def _foresight(p: Policy, v: SlotView) -> torch.Tensor:
    # PACE = H2O score + foresight bonus, nothing more.
    return v.cumulative + foresight_bonus(v.blueprint, v.logical, v.current_step)


def _foresight_recent(p: Policy, v: SlotView) -> torch.Tensor:
    # Planned spans first (the foresight bonus), then the most recent tokens: what stays besides the plan is one
    # contiguous window of text, never scattered heavy hitters, so that re-encoding the resident tokens (refresh)
    # reads text rather than a salad of isolated tokens. Recency is scaled into [0, 1), below any live bonus.
    return foresight_bonus(v.blueprint, v.logical, v.current_step) + v.logical.float() / max(v.n_logical, 1)


def _akv_rolling(p: Policy, v: SlotView) -> torch.Tensor:
    # Message-level: keep the last K tool responses, drop older ones; within budget, recency decides.
    score = v.logical.float()
    expired = v.tool_steps[: max(0, len(v.tool_steps) - p.keep_tool_responses)]
    if expired:
        gone = torch.isin(v.step, torch.tensor(expired, dtype=v.step.dtype)) & v.is_tool
        score = score.masked_fill(gone, float("-inf"))
    return score


SCORERS = {
    "full": _recency,
    "streaming": _recency,
    "h2o": _h2o,
    "tova": _tova,
    "snapkv": _snapkv,
    "foresight": _foresight,
    "foresight-recent": _foresight_recent,
    "akv-rolling": _akv_rolling,
}

POLICIES: dict[str, Policy] = {
    "full": Policy("full", "none"),
    "streaming": Policy("streaming", "none", recent=0),
    "h2o": Policy("h2o", "cumulative"),
    "tova": Policy("tova", "window", window=1),
    "snapkv": Policy("snapkv", "window", window=32),
    "foresight": Policy("foresight", "cumulative"),
    "foresight-recent": Policy("foresight-recent", "none"),
    "akv-rolling": Policy("akv-rolling", "none", recent=0),
}

# Named arms of the benchmark: (policy, bounded positions?)
ARMS: dict[str, tuple[str, bool]] = {
    **{name: (name, False) for name in POLICIES},
    "positions-only": ("h2o", True),
    "retention-only": ("foresight", False),
    "pace": ("foresight", True),
    "pace-tiered": ("foresight", True),
    # the refresh arms keep the plan plus one recent window (foresight-recent): what a refresh re-encodes is then
    # text, not the scattered heavy hitters h2o keeps (docs/results/2026-12-05-pace-refresh-misses); pace-refresh and
    # pace-refresh-tail first drop everything outside the plan, its readers' messages and the first message, so the
    # planned text sits right before the reader step (docs/results/2026-12-05-pace-refresh-plan)
    "pace-refresh": ("foresight-recent", True),
    "pace-refresh-tail": ("foresight-recent", True),
    "pace-refresh-window": ("foresight-recent", True),  # the refresh over the plan and the recent window, no drop
    "pace-refresh-h2o": ("foresight", True),  # the refresh over pace's own resident set (studies up to 2026-12-05)
}
# Arms whose evicted planned spans go to a storage tier and are rehydrated when their reader step opens.
TIERED_ARMS = frozenset({"pace-tiered"})
# Arms that re-encode their resident tokens afresh (`Session.refresh`) when a step that reads a planned span opens.
REFRESH_ARMS = frozenset({"pace-refresh", "pace-refresh-tail", "pace-refresh-window", "pace-refresh-h2o"})
# Of those, the arms whose refresh keeps the fresh prefix (rows no eviction before them touched), re-encodes the rest.
TAIL_REFRESH_ARMS = frozenset({"pace-refresh-tail"})
# Of those, the arms whose refresh first drops every token outside the plan, its readers and the first message.
PLAN_ONLY_REFRESH_ARMS = frozenset({"pace-refresh", "pace-refresh-tail"})


def get_policy(name: str, **overrides) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    base = POLICIES[name]
    return Policy(**{**base.__dict__, **overrides}) if overrides else base


def select_keep(scores: torch.Tensor, view: SlotView, policy: Policy, budget: int) -> torch.Tensor:
    """The shared selection step: indices (ascending) of the slots to keep — protected ones, then the top-B scores.

    Ties break toward the more recent slot, so a policy with flat scores degrades to a recent window.
    """
    n = scores.numel()
    scores = scores.clone()
    protected = view.logical < policy.sinks
    if policy.recent > 0:
        protected |= view.logical >= view.n_logical - policy.recent
    finite_or_pos = scores > float("-inf")
    scores[protected & finite_or_pos] = float("inf")
    if n <= budget and bool(finite_or_pos.all()):
        return torch.arange(n)
    order = torch.argsort(view.logical, descending=True, stable=True)  # newest first, then stable sort by score
    order = order[torch.argsort(scores[order], descending=True, stable=True)]
    keep = order[: min(budget, n)]
    keep = keep[scores[keep] > float("-inf")]
    return torch.sort(keep).values
