"""The AKV operate-after grammar (AKV §4.1) turned into engine operations.

A request carries the full message list plus an optional `cache` object:

    {"drop": {"<i>": [j, ...], ...}, "reposition": [i, ...]}

Every message is an implicit append. `drop["i"]` lists the messages whose KV leaves attention right after message i
has been appended; `reposition` lists the message boundaries (after message i) at which the survivors are
repositioned. Indices are 0-based; at one boundary the drop runs before the reposition.

The request becomes a list of message-level ops, each a hashable tuple — the key of the shared prefix cache:

    ("append", kind, (token, ...))   one message (the engine chunks it; one step = one message)
    ("drop", (j, ...))               message indices whose tokens leave attention
    ("reposition",)

Two requests share state exactly as far as these tuples agree (the session config is the root of the key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvsteward.serve.engine.blueprint import BlueprintError, PlannedSpan, parse_blueprint

Op = tuple
ROLE_KIND = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class OpsError(ValueError):
    """A request whose messages / cache ops / blueprint cannot be turned into engine ops; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# -- messages -------------------------------------------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts carry meaning for a text model
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpsError(f"{where}.content[{k}] must be a text part {{'type': 'text', 'text': ...}}",
                               f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise OpsError(f"{where}.content must be a string, a list of text parts or null", f"{where}.content")


def normalize_messages(messages: Any, where: str = "messages", allow_empty: bool = False) -> list[dict]:
    """Validate OpenAI chat messages; return copies with string content (templates concatenate strings)."""
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise OpsError(f"{where} must be a non-empty list of messages", where)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpsError(f"{where}[{i}] must be an object with 'role' and 'content'", f"{where}[{i}]")
        role = m.get("role")
        if role not in ROLE_KIND:
            raise OpsError(f"{where}[{i}].role {role!r} is not one of {sorted(ROLE_KIND)}", f"{where}[{i}].role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _content_text(m.get("content"), f"{where}[{i}]")
        out.append(msg)
    return out


def _render(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    if tools is not None and not isinstance(tools, list):
        raise OpsError("tools must be a list of tool definitions", "tools")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template refusing the conversation (role order, tool format): the client's input
        raise OpsError(f"the chat template refused these messages: {type(e).__name__}: {e}", "messages") from e


# Below this many new messages the exact rule (one render per growing prefix) is cheap enough; above it the
# windowed texts are tried first (`_windowed_texts`).
WINDOWED_FROM = 8


def message_pieces(tokenizer, messages: list[dict], tools: list | None = None, start: int = 0) -> list[list[int]]:
    """Token ids of messages[start:], each the text the template's rendering of messages[:i+1] adds to that of
    messages[:i] (the same rule as `kvsteward.synth.chat.message_token_ids`, which this equals for start=0).

    Rendering every growing prefix is quadratic in the message count (1,000 short messages: ~5 s); for many new
    messages `_windowed_texts` finds the same texts in linear time, and the exact rule runs only where it cannot."""
    texts = None
    if len(messages) - start >= WINDOWED_FROM:
        texts = _windowed_texts(tokenizer, messages, tools, start)
    if texts is None:
        texts = _prefix_texts(tokenizer, messages, tools, start)
    pieces = [tokenizer.encode(x, add_special_tokens=False) for x in texts]
    for i, p in enumerate(pieces):
        if not p:
            raise OpsError(f"message {start + i} renders to zero tokens: nothing to append", f"messages[{start + i}]")
    return pieces


def _prefix_texts(tokenizer, messages: list[dict], tools: list | None, start: int) -> list[str]:
    """The exact rule: render every growing prefix, cut what each message adds."""
    prev = _render(tokenizer, messages[:start], tools)
    texts = []
    for i in range(start, len(messages)):
        full = _render(tokenizer, messages[: i + 1], tools)
        if not full.startswith(prev):
            raise OpsError(f"the chat template is not prefix-stable at message {i}: it cannot be split into "
                           "per-message appends", "messages")
        texts.append(full[len(prev):])
        prev = full
    return texts


def _windowed_texts(tokenizer, messages: list[dict], tools: list | None, start: int) -> list[str] | None:
    """What each message adds, rendered in a window (the first message, then it) instead of its whole prefix: for
    a template that renders a message from its own fields and the conversation's opening (ChatML, SmolLM2, Llama,
    Qwen without reasoning) the texts are the exact rule's. They are taken only if they rebuild the whole rendering
    and the exact prefix renderings at a few cut points (linear: a constant number of whole renders); else None."""
    try:
        head = messages[:1]
        base = _render(tokenizer, head, tools)
        texts = []
        for i in range(max(start, 1), len(messages)):
            window = _render(tokenizer, head + [messages[i]], tools)
            if not window.startswith(base):
                return None
            texts.append(window[len(base):])
        if start == 0:
            texts.insert(0, base)
        prev = _render(tokenizer, messages[:start], tools)
        if prev + "".join(texts) != _render(tokenizer, messages, tools):
            return None
        n = len(messages) - start
        for k in sorted({1, n // 3, (2 * n) // 3, n - 1} - {0}):  # cut points: prefix renderings, exactly
            if _render(tokenizer, messages[: start + k], tools) != prev + "".join(texts[:k]):
                return None
    except OpsError:  # a template refusing a window (role order): the exact rule decides
        return None
    return texts


def generation_prompt_ids(tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
    """Tokens the template adds to open the assistant reply after `messages`."""
    text = _render(tokenizer, messages, tools, add_generation_prompt=True)[len(_render(tokenizer, messages, tools)):]
    return tokenizer.encode(text, add_special_tokens=False)


def message_ranges(pieces: list[list[int]], offset: int = 0) -> list[tuple[int, int]]:
    """Half-open logical token range of each message, starting at logical index `offset`."""
    ranges = []
    for p in pieces:
        ranges.append((offset, offset + len(p)))
        offset += len(p)
    return ranges


# -- the cache grammar ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    drop: dict[int, tuple[int, ...]] = field(default_factory=dict)  # boundary i -> messages dropped after i
    reposition: frozenset[int] = frozenset()

    def as_json(self) -> dict:
        return {"drop": {str(i): list(js) for i, js in sorted(self.drop.items())},
                "reposition": sorted(self.reposition)}

    def boundaries(self) -> list[int]:
        return sorted(set(self.drop) | set(self.reposition))


_INDEX_RE = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only (str.isdigit() also takes '²' and '١')


def _index(x: Any, what: str, param: str) -> int:
    if isinstance(x, str) and _INDEX_RE.fullmatch(x.strip()):
        x = int(x.strip())
    if not isinstance(x, int) or isinstance(x, bool):
        raise OpsError(f"{what} {x!r} is not a message index (0-based integer)", param)
    return x


def parse_cache(cache: Any, n_messages: int, first: int = 0, dropped: frozenset[int] = frozenset()) -> CacheSpec:
    """Validate `cache` for a conversation of `n_messages` messages of which messages[first:] are new.

    Boundaries must lie where the new ops can still run: after a new message, or right after the last old one
    (`first - 1`). `dropped` are messages already dropped earlier (a persistent session); dropping one twice, or a
    message not appended yet at that boundary, is an error.
    """
    if cache is None:
        return CacheSpec()
    if not isinstance(cache, dict):
        raise OpsError("cache must be an object {'drop': {...}, 'reposition': [...]}", "cache")
    unknown = set(cache) - {"drop", "reposition"}
    if unknown:
        raise OpsError(f"cache has unknown field(s) {sorted(unknown)}: only 'drop' and 'reposition'", "cache")
    lowest = max(0, first - 1)
    last = n_messages - 1

    def boundary(x: Any, param: str) -> int:
        i = _index(x, "boundary", param)
        if not lowest <= i <= last:
            if i < lowest:
                raise OpsError(f"{param}: boundary after message {i} has already passed (ops can run after message "
                               f"{lowest} or later)", param)
            raise OpsError(f"{param}: boundary after message {i} is out of range: there are {n_messages} messages "
                           f"(0..{last})", param)
        return i

    drops: dict[int, tuple[int, ...]] = {}
    raw_drop = cache.get("drop") or {}
    if not isinstance(raw_drop, dict):
        raise OpsError("cache.drop must map 'after message i' -> [message indices]", "cache.drop")
    gone = set(dropped)
    for key in sorted(raw_drop, key=lambda k: _index(k, "cache.drop key", "cache.drop")):
        param = f"cache.drop[{key!r}]"
        i = boundary(key, param)
        if i in drops:
            raise OpsError(f"{param}: boundary {i} is listed twice", param)
        targets = raw_drop[key]
        if not isinstance(targets, list) or not targets:
            raise OpsError(f"{param} must be a non-empty list of message indices", param)
        js = []
        for t in targets:
            j = _index(t, "dropped message", param)
            if not 0 <= j < n_messages:
                raise OpsError(f"{param}: message {j} is unknown: there are {n_messages} messages (0..{last})", param)
            if j > i:
                raise OpsError(f"{param}: message {j} is not yet appended at the boundary after message {i}", param)
            if j in gone:
                raise OpsError(f"{param}: message {j} is already dropped", param)
            gone.add(j)
            js.append(j)
        drops[i] = tuple(sorted(js))
    raw_rep = cache.get("reposition") or []
    if not isinstance(raw_rep, list):
        raise OpsError("cache.reposition must be a list of message boundaries", "cache.reposition")
    reps = [boundary(x, "cache.reposition") for x in raw_rep]
    if len(set(reps)) != len(reps):
        raise OpsError("cache.reposition lists a boundary twice", "cache.reposition")
    return CacheSpec(drop=drops, reposition=frozenset(reps))


def build_ops(pieces: list[list[int]], kinds: list[str], spec: CacheSpec, first: int = 0) -> list[Op]:
    """The message-level op list for messages[first:] (pieces/kinds cover those only): boundary ops that belong
    right after message first-1 come first, then each message's append followed by its drop, then reposition."""

    def boundary_ops(i: int) -> list[Op]:
        out: list[Op] = []
        if i in spec.drop:
            out.append(("drop", spec.drop[i]))
        if i in spec.reposition:
            out.append(("reposition",))
        return out

    ops: list[Op] = boundary_ops(first - 1) if first > 0 else []
    for k, (piece, kind) in enumerate(zip(pieces, kinds, strict=True)):
        ops.append(("append", kind, tuple(piece)))
        ops.extend(boundary_ops(first + k))
    return ops


def apply_op(session, op: Op, ranges: list[tuple[int, int]], lock) -> None:
    """Run one message-level op on an engine session. Appends hold `lock` (one model forward at a time)."""
    if op[0] == "append":
        with lock:
            session.append(list(op[2]), kind=op[1], logits=None)
    elif op[0] == "drop":
        session.drop([t for j in op[1] for t in range(*ranges[j])])
    elif op[0] == "reposition":
        with lock:  # a re-rotation of every resident key: compute, serialised like a forward
            session.reposition()
    else:
        raise OpsError(f"unknown op {op[0]!r}")


def op_tokens(op: Op) -> int:
    return len(op[2]) if op[0] == "append" else 0


# -- session config (the root of the state key) ---------------------------------------------------------------------
@dataclass(frozen=True)
class SessionSpec:
    policy: str = "full"
    budget: int | None = None
    limit: int | None = None
    chunk: int = 512
    blueprint: tuple[PlannedSpan, ...] = ()

    def new_session(self, engine):
        return engine.session(self.policy, budget=self.budget, chunk=self.chunk, limit=self.limit,
                              blueprint=list(self.blueprint))

    def as_json(self) -> dict:
        return {"policy": self.policy, "budget": self.budget, "limit": self.limit, "chunk": self.chunk,
                "blueprint": [{"span": [s.start, s.end], "readers": list(s.readers)} for s in self.blueprint]}


def _opt_int(x: Any, name: str, minimum: int = 1) -> int | None:
    if x is None:
        return None
    if not isinstance(x, int) or isinstance(x, bool) or x < minimum:
        raise OpsError(f"{name} must be an integer >= {minimum}, got {x!r}", name)
    return x


MAX_BLUEPRINT_INT = 2**62  # well inside int64: span ends and reader steps beyond are refused at parse time


def resolve_blueprint(data: Any, ranges: list[tuple[int, int]] | None) -> tuple[PlannedSpan, ...]:
    """Blueprint entries are engine spans `{"span": [start, end], "readers": [...]}` (logical tokens, half-open)
    or, when the messages are known (`ranges`), `{"message": j, "readers": [...]}` for the whole of message j."""
    if data is None:
        return ()
    if isinstance(data, list):
        converted = []
        for k, entry in enumerate(data):
            if isinstance(entry, dict) and "message" in entry:
                if ranges is None:
                    raise OpsError(f"blueprint[{k}] is keyed by message, but the messages are not known here: "
                                   "use token spans {'span': [start, end], 'readers': [...]}", "blueprint")
                j = entry["message"]
                if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < len(ranges):
                    raise OpsError(f"blueprint[{k}].message {j!r} is unknown: there are {len(ranges)} messages",
                                   "blueprint")
                rest = {key: v for key, v in entry.items() if key != "message"}
                converted.append({**rest, "span": list(ranges[j])})
            else:
                converted.append(entry)
        data = converted
    try:
        spans = tuple(parse_blueprint(data))
    except BlueprintError as e:
        raise OpsError(str(e), "blueprint") from e
    for k, s in enumerate(spans):  # the engine keeps spans and reader steps in int64 tensors
        if s.end > MAX_BLUEPRINT_INT or any(r > MAX_BLUEPRINT_INT for r in s.readers):
            raise OpsError(f"blueprint[{k}]: token and step indices must be at most {MAX_BLUEPRINT_INT}", "blueprint")
    return spans


def session_spec(engine, defaults: SessionSpec, policy: Any = None, budget: Any = None, limit: Any = None,
                 blueprint: tuple[PlannedSpan, ...] = ()) -> SessionSpec:
    """Request overrides on the server defaults, checked by building a session (cheap: no forward)."""
    from kvsteward.serve.engine.policies import ARMS, POLICIES

    name = defaults.policy if policy is None else policy
    if not isinstance(name, str) or (name not in POLICIES and name not in ARMS):
        raise OpsError(f"unknown policy {name!r}; known: {sorted(set(POLICIES) | set(ARMS))}", "policy")
    spec = SessionSpec(
        policy=name,
        budget=_opt_int(budget, "budget") if budget is not None else (defaults.budget if policy is None else None),
        limit=_opt_int(limit, "limit") if limit is not None else (defaults.limit if policy is None else None),
        chunk=defaults.chunk,
        blueprint=blueprint,
    )
    if name == "full":  # the full cache ignores budget/limit; normalise so equal states get equal keys
        if spec.limit is not None:
            raise OpsError("policy 'full' keeps everything: bounded positions (limit) need an evicting policy",
                           "limit")
        spec = SessionSpec(policy="full", chunk=spec.chunk, blueprint=spec.blueprint)
    problem = _VALIDATED.get(spec, "?")
    if problem == "?":
        try:
            spec.new_session(engine)  # the engine's own checks (arms, budget, L > B + H), done once per spec
            problem = None
        except ValueError as e:  # CacheOpError / unknown arm settings: name the problem
            problem = str(e)
        if len(_VALIDATED) > 4096:
            _VALIDATED.clear()
        _VALIDATED[spec] = problem
    if problem is not None:
        raise OpsError(problem, "policy")
    return spec


_VALIDATED: dict[SessionSpec, str | None] = {}  # spec -> None (valid) or the engine's refusal; specs are engine-free
