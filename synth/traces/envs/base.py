"""What every environment shares: a recorder for ReAct traces with exact provenance, and split-disjoint names."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsteward.synth.traces.toolcall import cursor_content, render_assistant
from kvsteward.synth.traces.trace import Trace
from kvsteward.synth.traces.world import SPLITS


@dataclass
class Recorder:
    """Builds one trace: messages, provenance (`reads`: step → cursors it uses) and per-cursor cues.

    The script says what each step reads; nothing is inferred from text. A tool response is tagged `[cursor N]` with
    N its own message index (the trace format's convention)."""

    system_prompt: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    reads: dict[int, list[int]] = field(default_factory=dict)
    cues: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def user(self, text: str) -> int:
        self.messages.append({"role": "user", "content": text})
        return len(self.messages) - 1

    def assistant(self, text: str, reads: set[int] | list[int], call: dict | None = None) -> int:
        """An assistant step reading `reads` (cursor ids), with an optional tool call `{"name", "arguments"}`."""
        step = len(self.messages)
        bad = [c for c in reads if not 0 <= c < step or self.messages[c].get("role") != "tool"]
        if bad:
            raise ValueError(f"step {step} reads {bad}, which are not tool responses")
        self.reads[step] = sorted(set(reads))
        self.messages.append({"role": "assistant", "content": render_assistant(text, [call] if call else [])})
        return step

    def tool(self, body: str, cue: str = "") -> int:
        cid = len(self.messages)
        self.messages.append({"role": "tool", "content": cursor_content(cid, body)})
        if cue:
            self.cues[cid] = cue
        return cid

    def call(self, text: str, reads: set[int] | list[int], name: str, arguments: dict, body: str,
             cue: str = "") -> int:
        """One ReAct step: assistant text + tool call, then the tool's response. Returns the response's cursor id."""
        self.assistant(text, reads, {"name": name, "arguments": arguments})
        return self.tool(body, cue)

    def set_cue(self, cursor: int, cue: str) -> None:
        if self.messages[cursor].get("role") != "tool":
            raise ValueError(f"message {cursor} is not a tool response")
        self.cues[cursor] = cue

    def trace(self, **fields: Any) -> Trace:
        """The finished trace (validated); `fields` are Trace's other fields (task_id, split, env, question, ...)."""
        t = Trace(messages=self.messages, reads=self.reads, cues=self.cues, label_source="oracle", **fields)
        t.validate()
        return t


def disjoint_names(seed: int, per_split: int, make: Callable[[random.Random], str],
                   tries: int = 50) -> dict[str, list[str]]:
    """`per_split` distinct names per split from `make`, no name in two splits (drawn from one registry)."""
    r = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for split in SPLITS:
        while len(out[split]) < per_split:
            for _ in range(tries):
                name = make(r)
                if name not in seen:
                    break
            else:
                raise RuntimeError(f"could not draw {per_split} distinct names per split (the name space is too "
                                   "small)")
            seen.add(name)
            out[split].append(name)
    return out
