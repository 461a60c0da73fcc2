"""Bring your own traces: OpenAI-style message JSONL ↔ the trace format.

Input: one session per line, either `{"id": ..., "messages": [...]}` or a bare JSON list of messages. Messages
follow the OpenAI chat format: roles system / developer / user / assistant / tool (legacy `function` too); assistant
`tool_calls` (`{"id", "type": "function", "function": {"name", "arguments": "<json string>"}}`); tool responses with
`tool_call_id`; `content` as a string, null, or a list of `{"type": "text", "text": ...}` parts.

Output: the same trace format the generator writes (tool calls rendered into the assistant content, each tool
response tagged `[cursor N]` with its message index). Labels come from the file's own provenance when a line carries
it — an optional `"reads"` object, `{"<step>": [<message index of a tool response it uses>, ...]}`, with indices into
that line's `messages` (the conversion keeps every message at its index), and optionally `"env"`, `"answer"` and
`"cues"` (`{"<tool message index>": "<cue>"}`) — `label_source` "provenance" (`provenance_traces`); otherwise from a
planner (`label_traces`), and `label_source` records which. `write_openai_jsonl(..., provenance=True)` writes those
fields, so a generator of any origin can hand its exact labels over in this format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsteward.synth.rng import mix
from kvsteward.synth.traces.generate import split_of
from kvsteward.synth.traces.planner import Reads, next_step_reads, union
from kvsteward.synth.traces.toolcall import cursor_body, cursor_content, parse_tool_calls, render_assistant
from kvsteward.synth.traces.trace import Trace

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"):
                parts.append(p.get("text", ""))
            elif isinstance(p, str):
                parts.append(p)
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, null or a list of text parts, got {type(content).__name__}")


def _calls(msg: dict[str, Any], where: str) -> list[dict[str, Any]]:
    calls = []
    for k, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            raise ValueError(f"{where}: tool_calls[{k}] has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: tool_calls[{k}].function.arguments is not valid JSON: {e}") from e
        calls.append({"name": fn["name"], "arguments": args})
    return calls


def openai_to_messages(msgs: list[dict[str, Any]], where: str = "session") -> list[dict[str, str]]:
    """OpenAI messages → trace messages (same count, same order: step index = message index)."""
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        at = f"{where} message {i}"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError(f"{at}: unknown role {m.get('role') if isinstance(m, dict) else m!r}; "
                             f"expected one of {sorted(_ROLES)}")
        role = _ROLES[m["role"]]
        text = _text(m.get("content"), at)
        if role == "assistant":
            out.append({"role": role, "content": render_assistant(text, _calls(m, at))})
        elif role == "tool":
            out.append({"role": role, "content": cursor_content(i, cursor_body(text))})
        else:
            out.append({"role": role, "content": text})
    return out


def read_openai_jsonl(path: str | Path) -> list[Trace]:
    """Unlabelled traces (reads empty) from an OpenAI-style JSONL file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    traces = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            msgs = rec.get("messages") if isinstance(rec, dict) else rec
            tid = str(rec.get("id", f"{path.stem}-{n:05d}")) if isinstance(rec, dict) else f"{path.stem}-{n:05d}"
            messages = openai_to_messages(msgs, f"{path}:{n}")
            seed = mix("import", tid)
            extra = rec if isinstance(rec, dict) else {}
            traces.append(Trace(task_id=tid, split=split_of(seed), messages=messages, reads={},
                                label_source="unlabeled", task_seed=seed,
                                question=str(extra.get("question") or next(
                                    (m["content"] for m in messages if m["role"] == "user"), "")),
                                answer=str(extra.get("answer") or ""), env=str(extra.get("env") or ""),
                                cues=_int_keys(extra.get("cues"), f"{path}:{n} cues", str)))
            if "reads" in extra:
                traces[-1].reads = _int_keys(extra["reads"], f"{path}:{n} reads", _cursor_list)
                traces[-1].label_source = "provenance"
    return traces


def _cursor_list(v) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in v):
        raise ValueError(f"expected a list of message indices, got {v!r}")
    return sorted(set(v))


def _int_keys(obj, where: str, value) -> dict:
    """`{"<int>": v}` → `{int: value(v)}`, refusing anything else by name (None: empty)."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object keyed by message index, got {type(obj).__name__}")
    try:
        return {int(k): value(v) for k, v in obj.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def provenance_traces(traces: list[Trace], where: str = "file") -> list[Trace]:
    """The traces whose lines carried `reads` (label_source "provenance"), validated: a step must read earlier tool
    messages. Refuses a file where some line has no provenance (mixing labelled and unlabelled sessions would
    silently score the unlabelled ones as "nothing is ever read again")."""
    missing = [t.task_id for t in traces if t.label_source != "provenance"]
    if missing:
        raise ValueError(f"{where}: {len(missing)} session(s) without a \"reads\" field (e.g. {missing[0]}): "
                         "use a planner (--planner llm | lexical | next-step) or add their provenance")
    for t in traces:
        t.validate()
    return traces


def label_traces(traces: list[Trace], planner: Callable[[Trace], Reads], name: str, next_step_prior: bool = True,
                 on_trace: Callable[[], None] | None = None) -> list[Trace]:
    """Fill `reads` with a planner's output (optionally united with the next-step prior) and record the source."""
    out = []
    for t in traces:
        reads = union(planner(t), next_step_reads(t)) if next_step_prior else union(planner(t))
        src = f"planner:{name}" + ("+next_step" if next_step_prior else "")
        labelled = Trace(**{**t.__dict__, "reads": reads, "label_source": src})
        labelled.validate()
        out.append(labelled)
        if on_trace:
            on_trace()
    return out


def trace_to_openai(trace: Trace) -> list[dict[str, Any]]:
    """Trace → OpenAI messages (tool calls as structured `tool_calls`, ids paired with the responses in order)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(trace.messages):
        if m["role"] == "assistant":
            text, calls = parse_tool_calls(m["content"])
            ids = [f"call_{i}_{k}" for k in range(len(calls))]
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = [{"id": cid, "type": "function", "function": {
                    "name": c["name"], "arguments": json.dumps(c["arguments"])}} for cid, c in zip(ids, calls,
                                                                                                  strict=True)]
            pending = ids
            out.append(msg)
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": pending.pop(0) if pending else f"call_{i}",
                        "content": cursor_body(m["content"])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def write_openai_jsonl(traces: list[Trace], path: str | Path, provenance: bool = False) -> Path:
    """One session per line; with `provenance`, also each trace's `reads`, `env`, `question`, `answer` and `cues`
    (what `read_openai_jsonl` turns back into exact labels)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in traces:
            rec: dict[str, Any] = {"id": t.task_id, "messages": trace_to_openai(t)}
            if provenance:
                rec |= {"reads": {str(k): v for k, v in sorted(t.reads.items())}, "env": t.env,
                        "question": t.question, "answer": t.answer,
                        "cues": {str(k): v for k, v in sorted(t.cues.items())}}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path
