"""The aux thread itself (SideQuest): fork the main session at a boundary, append the trigger, decode the deletion.

At a *boundary* — right after every K-th tool response, the moment `synth/traces/hindsight.py` trains the manager on —
fork the
main session (a shared fork: it reads the main K/V in place, copying none; the main session is never written), append
the trigger message (`Memory management mode`, then `Open cursors: ...`: `synth.traces.hindsight.delete_trigger`, the
text the
manager was trained on, in the layout its adapter records: `Engine.trigger_style`) and the assistant opener, then
decode `{"del_cursors": [...]}` under the grammar of `manager.decode`. The caller applies the deletion to the main
session as a `drop` at its next turn. The aux tokens never enter the main context.

An adapter trained with `--aux-context first` (`Engine.aux_context`, an ablation) is served as trained: its trigger
follows a session holding only the conversation's first message (`first_message_session`), not the fork.
"""

from __future__ import annotations

from collections.abc import Generator

from kvsteward.serve.engine.session import Session
from kvsteward.serve.manager.decode import (
    LIST_OPEN,
    PREFIX,
    AuxDecision,
    _confident_steps,
    _constrained_steps,
    drive,
)
from kvsteward.serve.manager.scores import score_steps
from kvsteward.synth.chat import generation_prompt, message_texts, message_token_ids
from kvsteward.synth.traces.hindsight import delete_trigger, unread_cursors


def open_cursors(messages: list[dict], dropped) -> list[int]:
    """Cursor ids still in the context: the indices of tool messages not dropped (the synth convention: a tool
    response is tagged `[cursor N]` with N its own message index, so an id names the span a drop removes)."""
    return [i for i, m in enumerate(messages) if m.get("role") == "tool" and i not in dropped]


def fork_point(messages: list[dict], first: int, every: int) -> int | None:
    """Where a turn that appends `messages[first:]` forks the aux thread: the index t of the last new tool message
    that is the K-th, 2K-th, ... tool response of the session (`every` = K, counting every tool message, dropped ones
    included), or None. The fork is the state right after message t (and the cache ops that belong right after it),
    before the next message or the reply: exactly `synth.traces.hindsight.boundaries(trace, K)`'s boundary t + 1. A turn
    that crosses two multiples of K forks once, at the later one."""
    if every < 1:
        raise ValueError(f"aux every K must be >= 1, got {every}")
    count = sum(m.get("role") == "tool" for m in messages[:first])
    out = None
    for i in range(first, len(messages)):
        if messages[i].get("role") == "tool":
            count += 1
            if count % every == 0:
                out = i
    return out


def aux_steps(fork: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
              close_bias: float = 0.0, keep_unread: bool = True,
              min_confidence: float | None = None) -> Generator[None, None, AuxDecision]:
    """The aux thread on `fork` (a fork of the main session, adapter set by the caller) as a generator of steps:
    every resumption runs at most one model forward (trigger prefill, the forced opener, then one decoded token), so
    a scheduler can take the model lock per step and yield to main work in between. Returns the decision.
    The decoder may list any open cursor, except the unread ones with `keep_unread` (`unread_cursors`); with none
    left to list the decision is "delete nothing" without a forward.

    With `Engine.aux_context == "first"` (an adapter trained with `--aux-context first`) the trigger follows only the
    conversation's first message, in a session of its own (`first_message_session`), not the fork: the computation
    the adapter was trained on. The notes trigger still lists every open cursor of the whole session.
    `min_confidence`: delete the ids listed with at least this probability (`_confident_steps`), not the greedy
    list."""
    unread = set(unread_cursors(messages)) if keep_unread else set()
    deletable = [c for c in open_cursors if c not in unread]
    if not deletable:
        return AuxDecision([], PREFIX + LIST_OPEN + "]}", 0)
    if fork.engine.aux_context == "first":
        fork = first_message_session(fork, tokenizer, messages)
        yield
    if fork.engine.trigger_style == "scores":  # one forward scores every open response (`manager.scores`)
        return (yield from score_steps(fork, tokenizer, messages, open_cursors, deletable, min_confidence))
    text = delete_trigger(open_cursors, messages, fork.engine.trigger_style)  # the adapter's training layout
    history = messages + [{"role": "user", "content": text}]
    trigger_text = message_texts(tokenizer, history)[-1] + generation_prompt(tokenizer, history)
    fork.append(tokenizer.encode(trigger_text, add_special_tokens=False), kind="user", logits="last")
    yield
    if min_confidence is not None:
        return (yield from _confident_steps(fork, tokenizer, deletable, min_confidence, max_tokens, close_bias))
    return (yield from _constrained_steps(fork, tokenizer, deletable, max_tokens, close_bias))


def first_message_session(fork: Session, tokenizer, messages: list[dict]) -> Session:
    """A new session on `fork`'s engine holding only `messages[0]` (as the chat template writes it at the start of
    the conversation, positions from 0), prefilled by the base model as the main thread computed it; the adapter
    setting of `fork` applies to what is appended next. Exactly the context of a `train.data.first_message_rows` row.
    Why not cut the fork: a shared fork cannot drop the main session's rows, and a copy would cost the whole
    session; this costs the first message, whatever the session's length.

    The prefilled first message (the head) is kept on the engine (`Engine.aux_heads`, least recently used first out,
    at most `Engine.aux_head_tokens` tokens in all; a session's system prompt is the same at every decision, and
    often across sessions), so a decision copies its rows instead of running its forward. A copy, not a shared fork:
    the trigger's logits are then bit for bit those of a fresh prefill (a shared fork sums attention over two
    segments). Only the aux thread touches the cache (one worker thread per engine)."""
    engine = fork.engine
    role = messages[0].get("role", "system")
    ids = tuple(message_token_ids(tokenizer, messages[:1])[0])
    key = (role, ids, fork.config.chunk)  # the chunking shapes the prefill's float rounding
    heads = engine.aux_heads
    head = heads.get(key)
    if head is None:
        head = engine.session("full", chunk=fork.config.chunk)
        head.append(list(ids), kind=role)
        heads[key] = head
        while heads and sum(len(k[1]) for k in heads) > engine.aux_head_tokens:
            heads.popitem(last=False)  # (a head longer than the whole cap is not kept: it is used once below)
    else:
        heads.move_to_end(key)
    out = head.fork()  # a copy of the head's rows: the head itself is never appended to
    out.config.use_adapter = fork.config.use_adapter
    return out


def run_aux(main: Session, tokenizer, messages: list[dict], open_cursors: list[int], max_tokens: int = 64,
            use_adapter: bool = True, close_bias: float = 0.0, keep_unread: bool = True,
            min_confidence: float | None = None) -> AuxDecision:
    """Fork the main session, append the trigger (a user message) and the assistant opener, decode the deletion."""
    fork = main.fork(shared=True)  # reads the main K/V in place: no copy
    fork.config.use_adapter = use_adapter
    return drive(aux_steps(fork, tokenizer, messages, open_cursors, max_tokens, close_bias, keep_unread,
                           min_confidence))

