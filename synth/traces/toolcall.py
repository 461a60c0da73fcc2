"""The tool-call format of traces, for chat templates without native tool support (SmolLM2's has none).

Assistant turns carry their calls in the content, Hermes-style (the format Qwen2.5/Qwen3 templates render natively):

    Thought text ...
    <tool_call>
    {"name": "search", "arguments": {"query": "Jon Harlan"}}
    </tool_call>

Tool responses are messages with role `tool` whose content starts with `[cursor N] ` where N is the message's own
index in the session (= its step index), so a cursor id names both the response and the span the engine drops.
Any template that prints role + content renders this; `parse_tool_calls` recovers the calls from rendered text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_CURSOR_RE = re.compile(r"^\[cursor (\d+)\] ?")

TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the document collection by name; returns ranked results.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "open", "description": "Open a document by id; long documents are split into pages.",
        "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}, "page": {"type": "integer"}},
                       "required": ["doc_id"]}}},
]


def render_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def render_assistant(text: str, calls: list[dict[str, Any]]) -> str:
    """Assistant content: the reasoning text, then one block per call."""
    blocks = [render_call(c["name"], c.get("arguments", {})) for c in calls]
    return "\n".join([text] + blocks) if text else "\n".join(blocks)


def parse_tool_calls(content: str) -> tuple[str, list[dict[str, Any]]]:
    """(text without the call blocks, [{"name", "arguments"}]) from assistant content or rendered text."""
    calls = []
    for m in _CALL_RE.finditer(content):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed tool call JSON {m.group(1)[:80]!r}: {e}") from e
        if not isinstance(obj, dict) or "name" not in obj:
            raise ValueError(f"tool call without a name: {m.group(1)[:80]!r}")
        args = obj.get("arguments", {})
        if isinstance(args, str):  # OpenAI style: arguments as a JSON string
            args = json.loads(args) if args.strip() else {}
        calls.append({"name": obj["name"], "arguments": args})
    return _CALL_RE.sub("", content).strip(), calls


def cursor_content(step: int, body: str) -> str:
    return f"[cursor {step}] {body}"


def cursor_id(content: str) -> int | None:
    m = _CURSOR_RE.match(content or "")
    return int(m.group(1)) if m else None


def cursor_body(content: str) -> str:
    return _CURSOR_RE.sub("", content or "", count=1)


def template_supports_tools(tokenizer) -> bool:
    """Whether the model's chat template renders `tools` / `tool_calls` itself (SmolLM2's does not)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tool_calls" in template or "tools" in template
