"""A fitted rule as the memory manager, and the manager folder that says which manager a server runs.

On the embedded 135M model no adapter has beaten the structure classifier (docs/training.md), so the pipeline
chooses the served manager on validation (`steward eval choose`) among the adapter and the fitted rules, and writes
a manager folder:

    manager.json   {"arm": "structure" | "delete_all_read" | "adapter", "point": "f1", "adapter_dir": ...,
                    "rules": "rules", "validation": {arm: summary}, "reason": ...}
    rules/         the fitted rules (`synth.traces.baselines.save_baselines`)

`steward serve --manager DIR` (and the SGLang manager, `serve.sglang.manager.SglangManager.for_choice`) serve what
it names: the adapter as `--adapter` serves it, or a `RuleManager`, the evaluation's rule arm
(`eval.manager.arms.RuleArm` decides through it) at the same boundaries: the rule reads the visible messages, so a
decision costs no forward. A rule never deletes a response the agent has not read (those are no decisions:
`synth.traces.decisions.decisions_at`).
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsteward.serve.manager.decode import AuxDecision, rule_decision
from kvsteward.serve.manager.stack import StackManager
from kvsteward.synth.traces.baselines import POINTS, Baseline, load_baselines

CHOICE_FILE = "manager.json"
RULES_DIR = "rules"
# what `steward eval choose` picks among; `stack` (structure + a per-response adapter's P(no)) serves the adapter and
# the fitted head together (`manager.stack.StackManager`)
MANAGER_ARMS = ("adapter", "stack", "structure", "delete_all_read")
ADAPTER_ARMS = ("adapter", "stack")  # the arms whose folder names an adapter the server loads


class ManagerError(ValueError):
    """A manager folder that cannot be served (missing file, unknown arm, rule not fitted)."""


@dataclass
class RuleManager:
    """A fitted `Baseline` at an operating point, deciding from the visible messages (indexed as the cursor ids)."""

    name: str
    baseline: Baseline
    point: str = "f1"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ManagerError(f"rule {self.name}: operating point must be one of {POINTS}, got {self.point!r}")

    def decide(self, messages: list[dict], open_cursors: list[int]) -> AuxDecision:
        return rule_decision(self.baseline.decide_at(messages, open_cursors, self.point))

    needs_model = False  # decides from the messages alone (the worker passes no fork it would use)

    def steps(self, fork, tokenizer, messages: list[dict],
              open_cursors: list[int]) -> Generator[None, None, AuxDecision]:
        """`decide` as an aux step generator (no forward, so no step: the worker's loop ends at once); `fork` and
        `tokenizer` unused (the signature of every served manager: `manager.stack.StackManager` reads them)."""
        return self.decide(messages, open_cursors)
        yield  # (a generator)


@dataclass
class ManagerChoice:
    """What a manager folder names: the arm, and either its adapter folder or its fitted rule."""

    arm: str
    point: str = "f1"
    adapter_dir: str | None = None
    rule: RuleManager | None = None
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def is_rule(self) -> bool:
        """A fitted rule (or the stacked head) decides; with `stack` it reads `adapter_dir`'s forward."""
        return self.rule is not None

    @property
    def serves_adapter(self) -> bool:
        return self.arm in ADAPTER_ARMS


def save_choice(folder: str | Path, arm: str, rules: dict[str, Baseline], adapter_dir: str | None,
                record: dict[str, Any], point: str = "f1") -> Path:
    """Write `folder/manager.json` and the fitted rules under `folder/rules` (every fitted rule, so the folder also
    serves as `--baselines` for `steward eval manager`)."""
    from kvsteward.synth.traces.baselines import save_baselines

    if arm not in MANAGER_ARMS:
        raise ManagerError(f"unknown manager arm {arm!r}; known: {', '.join(MANAGER_ARMS)}")
    if arm in ADAPTER_ARMS and not adapter_dir:
        raise ManagerError(f"the {arm} arm won, but no adapter folder was given")
    if arm != "adapter" and arm not in rules:
        raise ManagerError(f"the rule {arm!r} won, but it is not among the fitted rules {sorted(rules)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if rules:
        save_baselines(rules, folder / RULES_DIR)
    body = {"arm": arm, "point": point, "adapter_dir": adapter_dir, "rules": RULES_DIR if rules else None,
            **record}
    (folder / CHOICE_FILE).write_text(json.dumps(body, indent=2, default=str))
    return folder / CHOICE_FILE


def load_choice(folder: str | Path) -> ManagerChoice:
    """The manager a folder from `save_choice` names, ready to serve; `ManagerError` naming what is wrong."""
    folder = Path(folder)
    path = folder / CHOICE_FILE
    if not path.is_file():
        raise ManagerError(f"{folder} is not a manager folder: no {CHOICE_FILE} (`steward eval choose --out DIR`)")
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManagerError(f"{path}: not JSON ({e})") from e
    arm, point = body.get("arm"), body.get("point", "f1")
    if arm not in MANAGER_ARMS:
        raise ManagerError(f"{path}: unknown manager arm {arm!r}; known: {', '.join(MANAGER_ARMS)}")
    if arm == "adapter":
        adapter = body.get("adapter_dir")
        if not adapter or not Path(adapter).is_dir():
            raise ManagerError(f"{path}: the chosen adapter folder {adapter!r} does not exist")
        return ManagerChoice(arm, point, adapter_dir=adapter, record=body)
    try:
        fitted = load_baselines(folder / (body.get("rules") or RULES_DIR))
    except (FileNotFoundError, ValueError) as e:
        raise ManagerError(f"{path}: the chosen rule cannot be loaded ({e})") from e
    if arm not in fitted:
        raise ManagerError(f"{path}: the rule {arm!r} is not among the saved rules {sorted(fitted)}")
    if arm == "stack":
        adapter = body.get("adapter_dir")
        if not adapter or not Path(adapter).is_dir():
            raise ManagerError(f"{path}: the stack's per-response adapter folder {adapter!r} does not exist")
        return ManagerChoice(arm, point, adapter_dir=adapter, rule=StackManager(fitted[arm], point), record=body)
    return ManagerChoice(arm, point, adapter_dir=body.get("adapter_dir"),
                         rule=RuleManager(arm, fitted[arm], point), record=body)
