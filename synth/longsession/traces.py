"""Long coding sessions (`kvsteward.synth.longsession.generate`) re-expressed as agent traces: a second source for
hindsight.

The sessions come from the benchmark's own generator (`generate_session`); this module only changes their form:

    session                                        trace
    [system]                                       [system + tool instructions] [user: kickoff]
    [user: "<preface> `path` (lines a-b)" + code]  [assistant: (ack of the previous cursor) + read_file call]
    [assistant: ack]                               [tool: "[cursor N] read_file(...)" + the same code]
    [def user] [def assistant] (x3)                the same messages, verbatim (not cursors)
    probes (after the context)                     fact probes as question / answer steps, the final answer last

Provenance (exact by construction, recorded in `reads`):
- After every filler cursor N, step N + 1 is an assistant message that acknowledges it by naming what those lines
  define (`def` / `class` names read from the chunk itself, or their line count when they define nothing). That
  step reads N; no other step reads any filler cursor, because the filler is filtered to never mention a session
  fact (`stdlib_filler`). So every filler cursor's last use is N + 1: at the boundary right after it, it is still
  open and needed; at every later boundary it is expired.
- Definitions and probes read no cursor: the probes need the definitions, which are user/assistant messages, not
  tool responses, and are never deletion targets.
- Fact probes are answered with the exact definition line (`FEE_RATE = Decimal("0.0375")`); the final probe (default:
  the session's first fact probe) is played last and its answer ends with `Final answer: <gold>`, the form
  `kvsteward.eval.manager.evaluate` scores. Recall and code probes have no reference answer text and are left out.

Splits are a function of the session seed (8:1:1 by a stable hash), so a seed's definitions and filler stream never
appear in two splits, whatever the number of sessions or distances.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from kvsteward.synth.longsession.defs import DEFAULT_FACTS
from kvsteward.synth.longsession.generate import _PREFACES, _filler_turn, generate_session, session_seed
from kvsteward.synth.longsession.schema import Probe, Session
from kvsteward.synth.longsession.stdlib_filler import Chunk
from kvsteward.synth.rng import mix, rng
from kvsteward.synth.traces.generate import split_of
from kvsteward.synth.traces.toolcall import cursor_content, render_assistant
from kvsteward.synth.traces.trace import Trace

TOOL_NAME = "read_file"
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "Read lines start_line..end_line (1-based, inclusive) of a repository file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"},
                                                    "end_line": {"type": "integer"}},
                   "required": ["path", "start_line", "end_line"]}}}]
TOOL_NOTE = (
    "\nTools: read_file(path, start_line, end_line) returns those lines of a repository file. To call a tool, end "
    "your turn with a <tool_call> block: a JSON object {\"name\": ..., \"arguments\": {...}} followed by the closing "
    "tag. Each tool result arrives as a message starting with [cursor N].\n"
    "When you give the last answer of the session, end with a line 'Final answer: ...'.")
KICKOFF = ("Before I share the specifications, read through some of the existing code of the repository for "
           "context. I'll send the specs as we go.")
_THOUGHTS = ("Reading `{path}` (lines {a}-{b}) for context.", "Next, `{path}`, lines {a}-{b}.",
             "Let me look at `{path}` lines {a}-{b}.", "Continuing with `{path}` (lines {a}-{b}).")
_DEF_RE = re.compile(r"^\s*(?:async\s+def|def|class)\s+([A-Za-z_]\w*)")
_MAX_NAMES = 4


def split_of_seed(seed: int) -> str:
    """The split of every session made from `seed` (train / validation / test, 8:1:1 by a stable hash)."""
    return split_of(mix("longsession-split", seed))


# --- reading the generator's filler turns back ----------------------------------------------------------------------


@lru_cache(maxsize=1)
def _preface_patterns() -> tuple[re.Pattern, ...]:
    """One regex per generator preface template (built from the templates themselves, so they cannot drift)."""
    out = []
    for t in _PREFACES:
        p = re.escape(t)
        for name, group in (("path", r"(?P<path>[^`]+)"), ("a", r"(?P<a>\d+)"), ("b", r"(?P<b>\d+)")):
            p = p.replace(re.escape("{" + name + "}"), group)
        out.append(re.compile("^" + p + r"\n\n```python\n(?P<code>.*)\n```$", re.S))
    return tuple(out)


def filler_chunk(session: Session, index: int) -> Chunk:
    """The stdlib chunk of the filler turn at `messages[index]` (user) / `[index + 1]` (assistant).

    Parsed from the user message, then checked by rebuilding the turn with the generator's own `_filler_turn`: the
    two messages must come out identical, so the chunk (path, first line, lines) is exactly what the generator used.
    """
    msgs = session.messages
    if index + 1 >= len(msgs) or msgs[index].role != "user" or msgs[index + 1].role != "assistant":
        raise ValueError(f"session {session.id!r}: messages {index}, {index + 1} are not a (user, assistant) "
                         "filler turn")
    for pat in _preface_patterns():
        m = pat.match(msgs[index].content)
        if m:
            chunk = Chunk(m["path"], int(m["a"]), tuple(m["code"].split("\n")))
            if [x.model_dump() for x in _filler_turn(session.seed, chunk)] == \
                    [msgs[index].model_dump(), msgs[index + 1].model_dump()]:
                return chunk
    raise ValueError(f"session {session.id!r}: message {index} is neither a definition nor a filler turn of the "
                     "long-session generator")


# --- building the trace ---------------------------------------------------------------------------------------------


def _where(chunk: Chunk) -> dict[str, Any]:
    return {"path": chunk.path, "a": chunk.first_line, "b": chunk.first_line + len(chunk.lines) - 1}


def tool_response(chunk: Chunk) -> str:
    w = _where(chunk)
    return f'{TOOL_NAME}("{w["path"]}", lines {w["a"]}-{w["b"]}):\n{chunk.text}'


def defined_names(chunk: Chunk) -> list[str]:
    """`def` / `class` names the chunk's lines define, in order, without repeats."""
    names = [m.group(1) for line in chunk.lines for m in [_DEF_RE.match(line)] if m]
    return list(dict.fromkeys(names))


def acknowledgement(chunk: Chunk) -> str:
    """What the step after a filler cursor says: facts read from that cursor (so the step reads it)."""
    w, names = _where(chunk), defined_names(chunk)
    if not names:
        n = sum(1 for line in chunk.lines if line.strip())
        return f"Lines {w['a']}-{w['b']} of `{w['path']}` define no function or class ({n} non-blank lines)."
    shown = [f"`{x}`" for x in names[:_MAX_NAMES]]
    if len(names) > _MAX_NAMES:
        shown.append(f"{len(names) - _MAX_NAMES} more")
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    return f"Lines {w['a']}-{w['b']} of `{w['path']}` define {listed}."


def _call(seed: int, chunk: Chunk) -> tuple[str, dict[str, Any]]:
    w = _where(chunk)
    thought = rng("longsession-trace", seed, w["path"], w["a"]).choice(_THOUGHTS).format(**w)
    return thought, {"name": TOOL_NAME, "arguments": {"path": w["path"], "start_line": w["a"], "end_line": w["b"]}}


def fact_answer(session: Session, probe: Probe) -> str:
    """The exact definition line a fact probe asks for (its one needed region); checked against prefix + gold."""
    regions = {r.key: r for r in session.regions}
    if probe.kind != "fact" or len(probe.needs) != 1 or probe.needs[0] not in regions:
        raise ValueError(f"session {session.id!r}: probe {probe.id!r} is not a fact probe over one region")
    r = regions[probe.needs[0]]
    line = session.messages[r.message].content[r.start:r.end]
    if not line.startswith(probe.answer_prefix + (probe.gold or "")):
        raise ValueError(f"session {session.id!r}: region {r.key!r} ({line!r}) does not answer probe {probe.id!r}")
    return line


class _Builder:
    """Appends messages and records provenance; `pending` is the filler cursor the next assistant step reads."""

    def __init__(self, seed: int):
        self.seed, self.messages, self.reads = seed, [], {}
        self.pending: tuple[int, Chunk] | None = None

    def add(self, role: str, content: str, reads: list[int] | None = None) -> None:
        if role == "assistant":
            self.reads[len(self.messages)] = sorted(reads or [])
        self.messages.append({"role": role, "content": content})

    def flush(self) -> None:
        """A standalone acknowledgement of the pending cursor (before a definition or the probes)."""
        if self.pending:
            cid, chunk = self.pending
            self.add("assistant", acknowledgement(chunk), [cid])
            self.pending = None

    def filler(self, chunk: Chunk) -> None:
        thought, call = _call(self.seed, chunk)
        reads = []
        if self.pending:
            cid, prev = self.pending
            thought, reads = f"{acknowledgement(prev)} {thought}", [cid]
        self.add("assistant", render_assistant(thought, [call]), reads)
        cid = len(self.messages)
        self.add("tool", cursor_content(cid, tool_response(chunk)))
        self.pending = (cid, chunk)


def _final_probe(session: Session, final_probe: str | None) -> tuple[list[Probe], Probe]:
    facts = [p for p in session.probes if p.kind == "fact"]
    if not facts:
        raise ValueError(f"session {session.id!r} has no fact probe to end the trace with")
    final = facts[0] if final_probe is None else next((p for p in facts if p.id == final_probe), None)
    if final is None:
        raise ValueError(f"session {session.id!r} has no fact probe {final_probe!r}; it has {[p.id for p in facts]}")
    return [p for p in facts if p is not final], final


def session_to_trace(session: Session, split: str, final_probe: str | None = None) -> Trace:
    """The session as an agent trace with exact provenance (see the module docstring for the mapping)."""
    if split not in ("train", "validation", "test"):
        raise ValueError(f"split must be train, validation or test, got {split!r}")
    msgs = session.messages
    if msgs[0].role != "system":
        raise ValueError(f"session {session.id!r} does not start with a system message")
    defs = {step[0]: step for step in session.definition_steps}
    b = _Builder(session.seed)
    b.add("system", msgs[0].content + TOOL_NOTE)
    b.add("user", KICKOFF)
    i, paths = 1, set()
    while i < len(msgs):
        if i in defs:
            b.flush()
            for j in defs[i]:
                b.add(msgs[j].role, msgs[j].content)
            i = defs[i][-1] + 1
        else:
            chunk = filler_chunk(session, i)
            b.filler(chunk)
            paths.add(chunk.path)
            i += 2
    b.flush()
    others, final = _final_probe(session, final_probe)
    for p in others:
        for m in p.messages:
            b.add(m.role, m.content)
        b.add("assistant", fact_answer(session, p))
    for m in final.messages:
        b.add(m.role, m.content)
    answer = (final.gold or "").strip()
    b.add("assistant", f"{fact_answer(session, final)}\nFinal answer: {answer}")
    t = Trace(task_id=session.id, split=split, messages=b.messages, reads=b.reads, label_source="oracle",
              task_seed=session.seed, question=final.messages[-1].content, answer=answer, kind="longsession",
              docs=sorted(paths),
              entities=sorted({v for k, v in session.facts.items() if k.endswith("_class") or k == "status_enum"}))
    t.validate()
    return t


def resolve_distances(length: int, distances: list[int] | None) -> list[int]:
    """The distances to generate: as given, or one quarter of the length when none is given."""
    if length < 1:
        raise ValueError(f"--length must be positive, got {length}")
    distances = list(distances) if distances else [length // 4]
    if any(d < 0 for d in distances):
        raise ValueError(f"distances must be non-negative, got {distances}")
    return distances


def longsession_traces(tokenizer, n: int, length: int, seed: int, distances: list[int] | None = None,
                       chunk_tokens: int = 2000, facts: tuple[str, ...] = DEFAULT_FACTS,
                       final_probe: str | None = None,
                       progress: Callable[[int], None] | None = None) -> list[Trace]:
    """`n` session seeds × `distances` (default: length // 4), generated by `generate_session` exactly as
    `generate_sessions` does (same seeds, same order), each converted to a trace in its seed's split."""
    if n < 1:
        raise ValueError(f"--tasks must be at least 1, got {n}")
    if chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens must be at least 1, got {chunk_tokens}")
    distances = resolve_distances(length, distances)
    seeds = [session_seed(seed, i) for i in range(n)]
    if len(set(seeds)) != n:  # 31-bit hash: practically never, but two indices must not share definitions
        raise ValueError(f"session seeds collide for --seed {seed} and --tasks {n}; pick another --seed")
    out = []
    for k, s in enumerate(seeds):
        for d in distances:
            session = generate_session(tokenizer, s, length, d, facts, chunk_tokens)
            out.append(session_to_trace(session, split_of_seed(s), final_probe))
        if progress:
            progress(k + 1)
    return out


def generation_meta(n: int, seed: int, length: int, distances: list[int], chunk_tokens: int, model: str) -> dict:
    return {"generator": "kvsteward.synth.longsession.traces", "source": "longsession", "tasks": n, "seed": seed,
            "length": length, "distances": distances, "chunk_tokens": chunk_tokens, "model": model,
            "label_source": "oracle", "filler_last_use": "the next step (its acknowledgement)"}
