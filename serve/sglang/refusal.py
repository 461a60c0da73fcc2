"""Refusing a request whose pre-op state the tree no longer holds, before any work (sglang==0.5.21).

Under memory pressure sglang evicts unlocked leaves while requests wait; a waiting request's op may then follow a
state the tree holds only in part. Serving it would mean re-prefilling its survivors as plain tokens, which is not
the engine's state (the survivors' K/V were computed with the dropped tokens in view). A request that asks for it
(`miss: "refuse"` in its history, `kvsteward.serve.sglang.ops`) is refused instead, and its client rebuilds the
state exactly (`ops.generate_exact`: the pre-op state with 1 new token, then the request again).

The tree decides at admission, in `match_prefix` (the only point where the cached state is known), and marks the
request (`REFUSAL_ATTR` = (logical tokens of the pre-op state, why)). Two AROUND hooks act on the mark:

- `PrefillAdder.add_one_req`: a marked request is skipped (`CONTINUE`: nothing reserved or computed; the next
  waiting request is considered);
- `Scheduler.get_new_batch_prefill`: after the batch is built, every marked request still waiting is aborted
  through sglang's own `abort_request` (queue removal, the tokenizer told), with the finish reason
  `{"type": "abort", "status_code": 409, "err_type": "kvsteward_miss", "kvsteward_pre_op_tokens": T, ...}`. 409 is
  not one of the codes sglang turns into an HTTP error, so `/generate` answers 200 with it in `meta_info`.

The same hook is the safety valve of held seals (`OpRadixCache._hold`): when nothing runs and nothing was admitted
while requests wait, every hold is released, so holds can delay admission but never block it.

A request whose state is cached but whose reposition finds no room for its new version (the pool is full of running
rows) is deferred instead (`DEFER_ATTR`): the adder hook answers `NO_TOKEN` for it, as sglang does for a request
whose extend does not fit, so it waits in its place until a running request ends.

A retracted request (it has output) is never refused: its anchor is pinned (`OpRadixCache._pin`) and a re-prefill
there is counted. Requests without the mark are untouched, so with another `--radix-cache-backend` both hooks are
inert.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from kvsteward.serve.sglang.ops import MISS_ERR_TYPE, MISS_TOKENS

REFUSAL_ATTR = "kvsteward_refusal"
DEFER_ATTR = "kvsteward_defer"
NO_DEFER_ATTR = "kvsteward_no_defer"  # deferred while nothing could free room: not deferred again
ADD_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
logger = logging.getLogger(__name__)


def refusal(req: Any) -> tuple[int, str] | None:
    return getattr(req, REFUSAL_ATTR, None)


def finish_reason(tokens: int, why: str) -> dict:
    return {"type": "abort", "status_code": int(HTTPStatus.CONFLICT), "err_type": MISS_ERR_TYPE,
            MISS_TOKENS: int(tokens),
            "message": f"kvsteward: the state this request's op follows is not cached whole ({why}); re-send the "
                       f"history through its first {tokens} tokens (1 new token), then this request"}


def skip_refused(original, adder, req, *args, **kwargs):
    if refusal(req) is not None:
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    if getattr(req, DEFER_ATTR, None) is not None:  # waits for room, in its place: as a request that does not fit
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.NO_TOKEN
    return original(adder, req, *args, **kwargs)


def abort_refused(original, scheduler, *args, **kwargs):
    plan = original(scheduler, *args, **kwargs)
    release = getattr(scheduler.tree_cache, "release_holds", None)
    if release is not None and getattr(plan, "batch_to_run", None) is None and scheduler.waiting_queue \
            and plan.running_batch.is_empty():
        # nothing runs and nothing was admitted: held seals (`OpRadixCache._hold`, taken or not: with nothing
        # running every taker is waiting) must not be what keeps the head of the queue out. They become evictable
        # (their requests then miss and rebuild), and sglang's "batch is full" mark, which it clears only when a
        # running request finishes (none will), is cleared so the next step tries again. With no hold to release,
        # a deferred request would wait for room no one will free: it is served the old way (re-prefilled, counted)
        deferred = [r for r in scheduler.waiting_queue if getattr(r, DEFER_ATTR, None) is not None]
        if release(taken=True):
            plan.running_batch.batch_is_full = False
            logger.warning("kvsteward: no request admissible while seals are held: holds released")
        elif deferred:
            for req in deferred:
                setattr(req, NO_DEFER_ATTR, True)
            plan.running_batch.batch_is_full = False
    refused = [r for r in scheduler.waiting_queue if refusal(r) is not None]
    if refused:
        from sglang.srt.managers.io_struct import AbortReq

        for req in refused:
            tokens, why = refusal(req)
            setattr(req, REFUSAL_ATTR, None)
            scheduler.abort_request(AbortReq(rid=req.rid, finished_reason=finish_reason(tokens, why)))
    return plan


def register_hooks() -> None:
    """Register both hooks with SGLang's `HookRegistry` (idempotent); `load_plugins()` applies them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in ((ADD_TARGET, skip_refused), (BATCH_TARGET, abort_refused)):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)
