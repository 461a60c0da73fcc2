"""Long-session records (pydantic), their token layout for a given tokenizer, and JSONL I/O.

Documented field by field in `docs/sessions-schema.md`. The token-independent part (messages, regions, probes) is
what an external `--sessions-file` must provide; the token layout (spans, blueprint, needed spans) is derived from it
for a tokenizer by `ensure_layout` and cached in the record together with the tokenizer's fingerprint.

Steps: the engine appends one message per step, so step = message index (0-based). Probes are played in order after
the context; each probe appends its `messages` (one step each) and then one assistant answer message (one step).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from kvsteward.synth.chat import message_texts

SCHEMA_VERSION = 1


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Region(BaseModel):
    """A named fact: a half-open character range inside `messages[message].content`."""

    key: str
    message: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(gt=0)


class Probe(BaseModel):
    id: str
    kind: Literal["fact", "recall", "code"]
    messages: list[Message] = Field(min_length=1)
    answer_prefix: str = ""
    gold: str | None = None
    required: list[str] = Field(default_factory=list)
    tests: str | None = None
    needs: list[str] = Field(default_factory=list)
    step: int | None = None  # message index of this probe's first message when probes are played in order

    @model_validator(mode="after")
    def _kind_fields(self) -> Probe:
        if self.kind == "fact" and not self.gold:
            raise ValueError(f"fact probe {self.id!r} needs a non-empty `gold`")
        if self.kind == "recall" and not self.required:
            raise ValueError(f"recall probe {self.id!r} needs a non-empty `required` list")
        if self.kind == "code" and not self.tests:
            raise ValueError(f"code probe {self.id!r} needs `tests`")
        return self


class Layout(BaseModel):
    """Token positions of a session for one tokenizer (logical indices in the session's token stream)."""

    tokenizer: str
    n_tokens: int
    message_offsets: list[int]  # start token of each context message, plus n_tokens at the end
    definition_spans: list[tuple[int, int]]  # one half-open span per definition step
    distance_tokens: int  # tokens from the end of the last definition to the first probe token
    blueprint: list[dict]  # engine format: [{"span": [s, e], "readers": [step, ...]}]
    needed_spans: dict[str, list[tuple[int, int]]]  # probe id -> half-open spans of the tokens it needs


class Session(BaseModel):
    schema_version: int = SCHEMA_VERSION
    id: str
    seed: int
    length: int  # target context length in tokens (messages only, probes excluded)
    distance: int  # target distance in tokens from the definitions' end to the first probe
    messages: list[Message] = Field(min_length=1)
    definition_steps: list[list[int]]  # message indices of each definition step (contiguous)
    regions: list[Region] = Field(default_factory=list)
    facts: dict[str, str] = Field(default_factory=dict)  # informative: the session's facts by name
    probes: list[Probe] = Field(min_length=1)
    layout: Layout | None = None

    @model_validator(mode="after")
    def _check(self) -> Session:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"session {self.id!r}: schema_version {self.schema_version} != {SCHEMA_VERSION}")
        n = len(self.messages)
        for i, step in enumerate(self.definition_steps):
            if not step or step != list(range(step[0], step[0] + len(step))) or step[-1] >= n:
                raise ValueError(f"session {self.id!r}: definition_steps[{i}] = {step} must be contiguous message "
                                 f"indices below {n}")
        keys = set()
        for r in self.regions:
            if r.message >= n or r.end > len(self.messages[r.message].content) or r.start >= r.end:
                raise ValueError(f"session {self.id!r}: region {r.key!r} [{r.start}, {r.end}) does not fit in "
                                 f"message {r.message}")
            keys.add(r.key)
        step = n
        for p in self.probes:
            missing = set(p.needs) - keys
            if missing:
                raise ValueError(f"session {self.id!r}: probe {p.id!r} needs unknown regions {sorted(missing)}")
            if p.step is not None and p.step != step:
                raise ValueError(f"session {self.id!r}: probe {p.id!r} has step {p.step}, but played in order it "
                                 f"starts at message {step}")
            p.step = step
            step += len(p.messages) + 1  # its messages, then the assistant's answer
        return self


def tokenizer_id(tokenizer) -> str:
    """A fingerprint that changes when the tokenization or the chat template does (paths differ across machines)."""
    name = Path(str(getattr(tokenizer, "name_or_path", "") or "tokenizer")).name
    probe = "def fee_for(amount):\n    return Decimal(\"0.0375\")  # ünïcödé"
    material = json.dumps([len(tokenizer), getattr(tokenizer, "chat_template", None) or "",
                           tokenizer.encode(probe, add_special_tokens=False)])
    return f"{name}:{hashlib.sha256(material.encode()).hexdigest()[:12]}"


def _token_range(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Indices of the tokens overlapping the character range [start, end)."""
    hit = [i for i, (a, b) in enumerate(offsets) if b > start and a < end]
    if not hit:
        raise ValueError(f"no token covers characters [{start}, {end})")
    return hit[0], hit[-1] + 1


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def compute_layout(session: Session, tokenizer) -> Layout:
    """Token layout of `session` for `tokenizer` (pieces as in `kvsteward.synth.chat.message_token_ids`)."""
    messages = [m.model_dump() for m in session.messages]
    pieces = message_texts(tokenizer, messages)
    offsets, encodings = [0], []
    for piece in pieces:
        enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        encodings.append(enc)
        offsets.append(offsets[-1] + len(enc["input_ids"]))
    region_tokens: dict[str, tuple[int, int]] = {}
    for r in session.regions:
        piece, content = pieces[r.message], session.messages[r.message].content
        base = piece.rfind(content)
        if base < 0:
            raise ValueError(f"session {session.id!r}: the chat template does not render message {r.message} verbatim")
        s, e = _token_range(encodings[r.message]["offset_mapping"], base + r.start, base + r.end)
        region_tokens[r.key] = (offsets[r.message] + s, offsets[r.message] + e)
    def_spans = [(offsets[st[0]], offsets[st[-1] + 1]) for st in session.definition_steps]
    needed = {p.id: _merge([region_tokens[k] for k in p.needs]) for p in session.probes}
    # Oracle blueprint at fact granularity: each named fact's tokens → the probe steps (question and answer) that
    # need it. A whole-definition blueprint (~670 tokens) would not fit a 512-slot budget; the facts (~440) do.
    blueprint = []
    for r in session.regions:
        readers = sorted({s for p in session.probes if r.key in p.needs
                          for s in range(p.step, p.step + len(p.messages) + 1)})
        if readers:
            blueprint.append({"span": list(region_tokens[r.key]), "readers": readers})
    last_def = max((s[1] for s in def_spans), default=offsets[-1])
    return Layout(tokenizer=tokenizer_id(tokenizer), n_tokens=offsets[-1], message_offsets=offsets,
                  definition_spans=def_spans, distance_tokens=offsets[-1] - last_def, blueprint=blueprint,
                  needed_spans=needed)


def ensure_layout(session: Session, tokenizer) -> Session:
    """The session with a layout for `tokenizer`: kept if its fingerprint matches, recomputed otherwise."""
    if session.layout is None or session.layout.tokenizer != tokenizer_id(tokenizer):
        session = session.model_copy(update={"layout": compute_layout(session, tokenizer)})
    return session


def write_jsonl(sessions: list[Session], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in sessions:
            f.write(s.model_dump_json() + "\n")
    return path


def read_jsonl(path: str | Path, tokenizer=None) -> list[Session]:
    """Parse and validate a sessions file; with a tokenizer, also (re)compute each layout for it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"sessions file {path} does not exist")
    sessions = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            s = Session.model_validate_json(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not a valid session record: {e}") from e
        sessions.append(ensure_layout(s, tokenizer) if tokenizer is not None else s)
    if not sessions:
        raise ValueError(f"sessions file {path} holds no sessions")
    return sessions
