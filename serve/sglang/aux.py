"""The SideQuest auxiliary thread on SGLang: a prefix fork of the main thread, and its decision as a drop.

The fork is a plain request whose history is the main thread's up to and including the K-th tool response — the
boundary the manager was trained on (`kvsteward.synth.traces.hindsight.boundaries`), i.e. the main request's prompt
before
its reply — plus the trigger message: it matches the main's cached state in the tree (same op path, no copy;
the tree's lock references keep the shared nodes alive) and appends the trigger in its own new slots, which never
enter the main's path. Its `{"del_cursors": [...]}` reply becomes a drop (with a reposition unless the caller asks
for a plain drop, see `kvsteward.serve.sglang.ops`) in the cache ops of the main thread's *next* request, right
after the current turn.
The same fork works as a session branch (`session_params={"id": S, "rid": main_rid}`) when the client uses SGLang
sessions; either way it must carry the same op history, which is what `fork_request` builds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvsteward.serve.engine.ops import OpsError
from kvsteward.serve.sglang.ops import request_fields

_DEL = re.compile(r'\{\s*"del_cursors"\s*:\s*\[([0-9,\s]*)\]\s*\}')


def fork_request(messages: list[list[int]], cache: dict | None, trigger: list[int], via: str = "custom_params",
                 max_new_tokens: int = 64, close_bias: float = 0.0, closing_tokens: list[int] = (),
                 miss: str | None = None) -> dict:
    """`/generate` body for the aux thread: the main history up to the boundary (message token ids ending with the
    tool response; the main's prompt, which the tree holds as a prefix of its cached path) plus the trigger (the
    trigger message and the assistant opener, as token ids). `close_bias` is the engine's `AuxConfig.close_bias`, as
    SGLang's `logit_bias` on `closing_tokens` (`kvsteward.serve.manager.decode.closing_tokens(tokenizer)`); for an
    adapter calibrated by `steward eval calibrate`, `kvsteward.models.adapter_meta(adapter)["close_bias"]`. `miss`:
    as in `request_fields` ("refuse": a lost pre-op state is refused, for `ops.generate_exact` to rebuild)."""
    if close_bias and not closing_tokens:
        raise ValueError("close_bias needs the closing token ids "
                         "(kvsteward.serve.manager.decode.closing_tokens(tokenizer))")
    body = request_fields([*messages, list(trigger)], cache, via=via, miss=miss)
    params = body.setdefault("sampling_params", {})
    params.update({"max_new_tokens": max_new_tokens, "temperature": 0.0})
    if close_bias:
        params["logit_bias"] = {str(t): float(close_bias) for t in closing_tokens}
    return body


def parse_del_cursors(text: str, open_cursors: list[int]) -> list[int]:
    """Cursor ids of a `{"del_cursors": [...]}` reply, keeping only open ones (once each, in order)."""
    m = _DEL.search(text)
    if m is None:
        raise OpsError(f"aux reply is not {{\"del_cursors\": [...]}}: {text[:80]!r}", "del_cursors")
    ids = [int(x) for x in re.findall(r"\d+", m.group(1))]
    allowed, seen, out = set(open_cursors), set(), []
    for i in ids:
        if i in allowed and i not in seen:
            seen.add(i)
            out.append(i)
    return out


def apply_del_cursors(cache: dict | None, boundary: int, cursors: list[int], reposition: bool = True) -> dict:
    """The main thread's cache ops with the aux decision added: drop the cursors' messages (a cursor id is the tool
    message's index) right after message `boundary` (the main's last message of the current turn), and (by default)
    reposition there. With `reposition=False` the survivors keep their positions (AKV's plain drop; SGLang applies
    the position offset through the plugin's `ForwardBatch.init_new` hook)."""
    cache = json.loads(json.dumps(cache or {}))  # a copy: the caller's ops stay as they were
    if not cursors:
        return cache
    drop = cache.setdefault("drop", {})
    key = str(boundary)
    drop[key] = sorted(set(drop.get(key, [])) | set(cursors))
    if reposition:
        rep = cache.setdefault("reposition", [])
        if boundary not in rep:
            rep.append(boundary)
    return cache


def next_main_request(messages: list[list[int]], cache: dict | None, aux_reply: str, open_cursors: list[int],
                      new_messages: list[list[int]], via: str = "custom_params") -> dict[str, Any]:
    """`/generate` body of the main thread's next turn: the aux decision applied after the current turn's last
    message, then the new messages (the last one ending with the generation prompt)."""
    cursors = parse_del_cursors(aux_reply, open_cursors)
    ops = apply_del_cursors(cache, len(messages) - 1, cursors)
    return request_fields([*messages, *new_messages], ops, via=via)
