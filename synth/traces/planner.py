"""Planner dependency extraction: which earlier tool responses (cursors) each later step reads.

Planners return `reads` (step → cursor ids), the same record the generator writes as provenance, so a planner's
output drops straight into hindsight annotation (deletion and plan targets) and into an engine blueprint.

- `llm`: prompts a model once per assistant step with the tool results before it and the step's text; the reply's
  integers that name a valid earlier cursor are the reads. Local model (`kvsteward.models.load`, greedy) or any
  OpenAI-compatible endpoint (`openai` client). Prompts are capped (last `max_cursors` cursors, `cursor_chars`
  characters each), so edges to older cursors are out of its reach by design — recall pays for CPU speed.
- `lexical`: no model. Each sentence of a step is attributed to the earlier cursor sharing the most rare strings
  with it (names, ids, numbers; weights 1/document-frequency; ties → the most recent cursor).
- `next_step`: the structural prior of ReAct — a step reads the tool response right before it.
Edge metrics compare (cursor, step) pairs with the oracle's; deletion-label quality compares the expired sets they
imply at every K-th boundary.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvsteward.synth.traces.hindsight import boundaries, expired
from kvsteward.synth.traces.toolcall import cursor_body
from kvsteward.synth.traces.trace import Trace

Reads = dict[int, list[int]]
# complete(messages, answer_prefix) -> reply text. A local model continues the assistant turn after `answer_prefix`
# (forced prefix: a 135M model then answers with a number instead of chatting); endpoints ignore the prefix.
Complete = Callable[[list[dict[str, str]], str], str]

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_'-]*")
_STOP = {"the", "this", "that", "page", "result", "results", "back", "searching", "search", "open", "opening",
         "recap", "final", "answer", "now", "cursor", "name", "arguments", "query", "doc_id", "none", "not", "and",
         "records", "early", "about", "by", "trade", "last", "one", "i'll"}


def reader_steps(trace: Trace) -> list[int]:
    """Assistant steps that come after at least one tool response (the only ones that can read a cursor)."""
    first = min(trace.cursors(), default=len(trace.messages))
    return [i for i, m in enumerate(trace.messages) if m.get("role") == "assistant" and i > first]


def edges(reads: Reads) -> set[tuple[int, int]]:
    return {(c, s) for s, cs in reads.items() for c in cs}


def union(*reads: Reads) -> Reads:
    """Edge-wise union of several planners' reads (e.g. an LLM planner plus the next-step prior)."""
    out: dict[int, set[int]] = {}
    for r in reads:
        for s, cs in r.items():
            out.setdefault(s, set()).update(cs)
    return {s: sorted(cs) for s, cs in sorted(out.items()) if cs}


# --- baselines ----------------------------------------------------------------------------------------------------
def next_step_reads(trace: Trace) -> Reads:
    return {s: [s - 1] for s in reader_steps(trace) if trace.messages[s - 1].get("role") == "tool"}


def _salient(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)
            if len(w) >= 3 and (w[0].isupper() or any(ch.isdigit() for ch in w)) and w.lower() not in _STOP}


def lexical_reads(trace: Trace) -> Reads:
    system = _salient(" ".join(m.get("content") or "" for m in trace.messages if m.get("role") == "system"))
    words = {c: _salient(cursor_body(trace.messages[c].get("content", ""))) - system for c in trace.cursors()}
    out: Reads = {}
    for s in reader_steps(trace):
        before = [c for c in words if c < s]
        df: dict[str, int] = {}
        for c in before:
            for w in words[c]:
                df[w] = df.get(w, 0) + 1
        chosen = set()
        for sentence in re.split(r"(?<=[.!?;])\s+|\n", trace.messages[s].get("content") or ""):
            sal = _salient(sentence) - system
            scores = {c: sum(1 / df[w] for w in sal & words[c]) for c in before}
            best = max(scores.values(), default=0.0)
            if best > 0:
                chosen.add(max((c for c in before if math.isclose(scores[c], best)), default=None))
        if chosen:
            out[s] = sorted(chosen)
    return out


# --- LLM planner --------------------------------------------------------------------------------------------------
@dataclass
class LLMPlanner:
    complete: Complete
    name: str = "llm"
    max_cursors: int = 6
    cursor_chars: int = 120
    step_chars: int = 300

    def prompt(self, trace: Trace, step: int) -> tuple[list[dict[str, str]], list[int]]:
        cands = [c for c in trace.cursors() if c < step][-self.max_cursors:]
        results = "\n".join(f"[cursor {c}] {_clip(cursor_body(trace.messages[c]['content']), self.cursor_chars)}"
                            for c in cands)
        text = _clip(trace.messages[step].get("content") or "", self.step_chars)
        user = (f"Tool results:\n{results}\n\nAgent step {step}:\n{text}\n\n"
                f"Which tool results does step {step} use? Reply with the cursor numbers only, separated by commas.")
        system = "You read an agent's log and name the earlier tool results that a step uses."
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], cands

    @staticmethod
    def answer_prefix(step: int) -> str:
        return f"Step {step} uses cursor"

    def reads(self, trace: Trace, on_step: Callable[[], None] | None = None) -> tuple[Reads, int]:
        """(reads, parse failures = replies naming no valid cursor)."""
        out: Reads = {}
        failures = 0
        for s in reader_steps(trace):
            msgs, cands = self.prompt(trace, s)
            got = parse_cursor_ids(self.complete(msgs, self.answer_prefix(s)), cands)
            if got:
                out[s] = got
            else:
                failures += 1
            if on_step:
                on_step()
        return out, failures


def parse_cursor_ids(reply: str, candidates: list[int]) -> list[int]:
    """Integers in the reply that are valid candidate cursors (anything else — words, other numbers — ignored)."""
    valid = set(candidates)
    return sorted({int(n) for n in re.findall(r"\d+", reply or "") if int(n) in valid})


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def local_completer(model: str, max_new_tokens: int = 6) -> Complete:
    """Greedy generation with a local model on the kvsteward engine (`full` policy: token for token what
    transformers' generate() gives, tested), continuing after the answer prefix."""
    from kvsteward.serve.engine import Engine

    return engine_completer(Engine.load(model), max_new_tokens)


def engine_completer(engine, max_new_tokens: int = 6) -> Complete:
    """`local_completer` on an engine already loaded (no second copy of the model)."""
    tok = engine.tokenizer

    def complete(messages: list[dict[str, str]], prefix: str = "") -> str:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
        s = engine.session("full")
        s.append(tok.encode(text, add_special_tokens=False))
        out = s.generate(max_new_tokens, stop_ids=engine.eos_ids)
        return tok.decode(out, skip_special_tokens=True)

    return complete


def endpoint_completer(url: str, model: str, max_tokens: int = 24, api_key: str | None = None) -> Complete:
    """Any OpenAI-compatible chat endpoint (temperature 0)."""
    import os

    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"))

    def complete(messages: list[dict[str, str]], prefix: str = "") -> str:
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        return r.choices[0].message.content or ""

    return complete


# --- metrics ------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    tp: int = 0
    fp: int = 0
    fn: int = 0

    def add(self, pred: set, gold: set) -> None:
        self.tp += len(pred & gold)
        self.fp += len(pred - gold)
        self.fn += len(gold - pred)

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0


def deletion_pairs(trace: Trace, reads: Reads, every: int) -> set[tuple[int, int]]:
    """(boundary, cursor) deletion labels implied by `reads`, with every earlier cursor still open."""
    t = replace(trace, reads=reads)
    return {(b, c) for b in boundaries(trace, every) for c in expired(t, b)}


def score(traces: list[Trace], predicted: list[Reads], every: int) -> dict[str, float]:
    """Edge recall / precision vs the traces' own reads (the oracle), and the deletion-label quality they give."""
    e, far, d = Tally(), Tally(), Tally()
    for t, p in zip(traces, predicted, strict=True):
        pred, gold = edges(p), edges(t.reads)
        e.add(pred, gold)
        # Edges that skip at least one message: the ones the next-step prior cannot get.
        far.add({(c, s) for c, s in pred if c < s - 1}, {(c, s) for c, s in gold if c < s - 1})
        d.add(deletion_pairs(t, p, every), deletion_pairs(t, t.reads, every))
    return {"edge_recall": e.recall, "edge_precision": e.precision, "oracle_edges": e.tp + e.fn,
            "predicted_edges": e.tp + e.fp, "far_edge_recall": far.recall, "far_edge_precision": far.precision,
            "delete_precision": d.precision, "delete_recall": d.recall, "harmful_deletions": d.fp}
