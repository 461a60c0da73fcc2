"""The trace format shared by the generator, the importer, the annotator and the planners.

A trace is a list of chat messages (step index = message index) plus `reads`: step → the cursor ids (tool-message
indices) that step uses. For generated traces `reads` is the solver's provenance (label_source "oracle"); for
imported traces it comes from the file's own provenance (label_source "provenance") or a planner ("planner:<name>").
`env` names the environment that generated it ("" when unknown), `cues` (optional) names, per cursor, why the
generator's script reads it again or not (e.g. "recap_fact", "wrong_page"): the evaluation reports metrics per cue.
Stored as JSON lines, one trace per line, in `DIR/traces.jsonl` with generation parameters in `DIR/meta.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvsteward.synth.traces.toolcall import cursor_id

TRACES_FILE, META_FILE = "traces.jsonl", "meta.json"


@dataclass
class Trace:
    task_id: str
    split: str
    messages: list[dict[str, Any]]
    reads: dict[int, list[int]]
    label_source: str = "oracle"
    task_seed: int | None = None
    question: str = ""
    answer: str = ""
    kind: str = ""
    hops: int = 0
    entities: list[str] = field(default_factory=list)
    docs: list[str] = field(default_factory=list)
    env: str = ""
    cues: dict[int, str] = field(default_factory=dict)

    def cursors(self) -> list[int]:
        """Tool-response message indices (= cursor ids)."""
        return [i for i, m in enumerate(self.messages) if m.get("role") == "tool"]

    def readers(self) -> dict[int, list[int]]:
        """Cursor id → sorted steps that read it (empty list if none)."""
        out: dict[int, list[int]] = {c: [] for c in self.cursors()}
        for step, cs in self.reads.items():
            for c in cs:
                out[c].append(step)
        return {c: sorted(s) for c, s in out.items()}

    def last_use(self) -> dict[int, int]:
        """Cursor id → last step that reads it; -1 for a cursor nothing reads."""
        return {c: (s[-1] if s else -1) for c, s in self.readers().items()}

    def validate(self) -> None:
        """Refuse inconsistent provenance: reads must point back in time to tool messages with matching ids."""
        cursors = set(self.cursors())
        for i in cursors:
            cid = cursor_id(self.messages[i].get("content", ""))
            if cid != i:
                raise ValueError(f"{self.task_id}: tool message {i} is tagged [cursor {cid}], expected [cursor {i}]")
        for c in self.cues:
            if c not in cursors:
                raise ValueError(f"{self.task_id}: cue for {c}, which is not a tool message")
        for step, cs in self.reads.items():
            if not 0 <= step < len(self.messages):
                raise ValueError(f"{self.task_id}: reads step {step} is outside the {len(self.messages)} messages")
            for c in cs:
                if c not in cursors or c >= step:
                    raise ValueError(f"{self.task_id}: step {step} reads {c}, which is not an earlier tool message")

    def to_json(self) -> str:
        d = asdict(self)
        d["reads"] = {str(k): v for k, v in sorted(self.reads.items())}
        d["cues"] = {str(k): v for k, v in sorted(self.cues.items())}
        return json.dumps(d, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trace:
        d = json.loads(line)
        d["reads"] = {int(k): [int(c) for c in v] for k, v in d.get("reads", {}).items()}
        d["cues"] = {int(k): str(v) for k, v in (d.get("cues") or {}).items()}
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def write_traces(out: str | Path, traces: list[Trace], meta: dict[str, Any]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / TRACES_FILE, "w") as f:
        for t in traces:
            f.write(t.to_json() + "\n")
    (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out / TRACES_FILE


def read_traces(path: str | Path) -> list[Trace]:
    """Traces from a directory written by `write_traces`, or from a traces JSONL file."""
    path = Path(path)
    file = path / TRACES_FILE if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no traces at {file} (expected a folder made by `steward synth traces` or import)")
    traces = []
    with open(file) as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    traces.append(Trace.from_json(line))
                except (json.JSONDecodeError, TypeError, KeyError) as e:
                    raise ValueError(f"{file}:{n}: not a trace record: {e}") from e
    return traces


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.exists() else {}
