"""The learned memory manager as served: the aux thread that reads the session and deletes stale tool responses.

Layers, imported one way (`worker` → `rule` → `stack` → `thread` → `planner`, `scores`, `decode` → the engine):
- `decode`: the deletion list's grammar and its decision rules (greedy, close bias, confidence);
- `scores`: the per-response decision of the `scores` trigger (every open response's P(still needed), one forward);
- `rule`: a fitted rule as the manager, and the manager folder `steward eval choose` writes (`load_choice`);
- `stack`: the structure trees over a per-response adapter's P(no) as the manager (`StackManager`);
- `planner`: `Planning mode`, its grammar and the blueprint it becomes;
- `thread`: one aux decision on a fork of the main session (`run_aux`, `aux_steps`, `fork_point`);
- `worker`: the server's background worker and the model lock with priorities (`AuxWorker`, `Scheduler`).
"""

from kvsteward.serve.manager.decode import (
    LIST_OPEN,
    PREFIX,
    AuxDecision,
    check_close_bias,
    check_min_confidence,
    closing_tokens,
    confident_del_cursors,
    constrained_del_cursors,
    drive,
    valid_tail,
)
from kvsteward.serve.manager.planner import (
    PLAN_HORIZON,
    PLAN_PREFIX,
    PlanDecision,
    PlanError,
    PlanGrammar,
    check_plan,
    parse_plan,
    plan_blueprint,
    plan_steps,
    run_plan,
)
from kvsteward.serve.manager.rule import ManagerChoice, ManagerError, RuleManager, load_choice, save_choice
from kvsteward.serve.manager.stack import StackManager
from kvsteward.serve.manager.thread import aux_steps, first_message_session, fork_point, open_cursors, run_aux
from kvsteward.serve.manager.worker import AuxConfig, AuxJob, AuxWorker, Scheduler

__all__ = [
    "LIST_OPEN", "PLAN_HORIZON", "PLAN_PREFIX", "PREFIX", "AuxConfig", "AuxDecision", "AuxJob", "AuxWorker",
    "ManagerChoice", "ManagerError", "PlanDecision", "PlanError", "PlanGrammar", "RuleManager", "Scheduler",
    "StackManager",
    "aux_steps", "check_close_bias", "check_min_confidence", "check_plan", "closing_tokens", "confident_del_cursors",
    "constrained_del_cursors", "drive", "first_message_session", "fork_point", "load_choice", "open_cursors",
    "parse_plan", "plan_blueprint", "plan_steps", "run_aux", "run_plan", "save_choice", "valid_tail",
]
