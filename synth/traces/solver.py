"""A scripted ReAct agent that solves a `Task` correctly and records exact provenance.

Each assistant step says what it read and what it does next; `reads[step]` lists the cursors (tool responses) whose
content that step uses — known from the script, never guessed from strings. The step right after a tool response
always reads it (the agent reacts to what it just got); facts found earlier are read again when the final answer
compares or recaps them; a search result list is read again after a detour into a wrong document.

Detours (rate `detour_rate`) are what makes cursors expire early: opening a wrong search result (preferably the
near-duplicate twin), or searching a person's surname alone before the full name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsteward.synth.traces.tasks import FIELD_WORDS, Task, compare_verdict
from kvsteward.synth.traces.toolcall import cursor_content, render_assistant
from kvsteward.synth.traces.world import SearchHit, World, _one_edit, _tokens

SYSTEM_PROMPT = (
    "You are a research agent. Answer the user's question by looking things up; never guess.\n"
    "Tools: search(query) returns ranked documents (put the query in double quotes for an exact name); "
    "open(doc_id, page) returns one page of a document.\n"
    "To call a tool, end your turn with a <tool_call> block: a JSON object {\"name\": ..., \"arguments\": {...}} "
    "followed by the closing tag. "
    "Each tool result arrives as a message starting with [cursor N].\n"
    "When you know the answer, end with a line 'Final answer: ...'."
)


@dataclass
class TraceConfig:
    min_hops: int = 2
    max_hops: int = 6
    page_words: int = 160
    doc_words: int = 240
    detour_rate: float = 0.35
    top_k: int = 5
    compare_rate: float = 0.3
    recap_rate: float = 0.5
    world_size: int = 2000
    twin_rate: float = 0.3

    def validate(self) -> None:
        if not 2 <= self.min_hops <= self.max_hops <= 12:
            raise ValueError(f"hops must satisfy 2 <= min_hops <= max_hops <= 12, got {self.min_hops}..{self.max_hops}")
        for name in ("detour_rate", "compare_rate", "recap_rate", "twin_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.page_words < 20 or self.doc_words < 20 or self.top_k < 2:
            raise ValueError("page_words and doc_words must be >= 20 and top_k >= 2")


class Solver:
    def __init__(self, world: World, cfg: TraceConfig, r: random.Random):
        self.world, self.cfg, self.r = world, cfg, r
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.reads: dict[int, list[int]] = {}
        self.docs: set[str] = set()
        self._hits: list[SearchHit] = []

    # --- recording ---------------------------------------------------------------------------------------------
    def _assistant(self, text: str, reads: set[int], call: dict | None) -> None:
        self.reads[len(self.messages)] = sorted(reads)
        self.messages.append({"role": "assistant", "content": render_assistant(text, [call] if call else [])})

    def _call(self, text: str, reads: set[int], name: str, arguments: dict) -> int:
        """One ReAct step: assistant text + tool call, then the tool's response. Returns the response's cursor id."""
        self._assistant(text, reads, {"name": name, "arguments": arguments})
        body = self._search(arguments["query"]) if name == "search" else self._open(**arguments)
        cid = len(self.messages)
        self.messages.append({"role": "tool", "content": cursor_content(cid, body)})
        return cid

    # --- tools -------------------------------------------------------------------------------------------------
    def _search(self, query: str) -> str:
        self._hits = self.world.search(query, self.cfg.top_k)
        self.docs.update(h.doc_id for h in self._hits)
        if not self._hits:
            return f'search("{query}"): no results'
        lines = [f"{h.rank}. {h.doc_id} | {h.name} | {h.snippet}" for h in self._hits]
        return f'search("{query}"): results 1-{len(lines)}\n' + "\n".join(lines)

    def _open(self, doc_id: str, page: int = 1) -> str:
        doc = self.world.document(doc_id)
        self.docs.add(doc_id)
        n = len(doc.pages(self.cfg.page_words))
        text = doc.page_text(page, self.cfg.page_words)
        return f"open({doc_id}, page {page}): {doc.title}, page {page} of {n}\n{text}"

    # --- script ------------------------------------------------------------------------------------------------
    def lookup(self, doc_id: str, fact: str, text: str, reads: set[int]) -> int:
        """Find `doc_id` by name, read the page holding `fact`; returns that page's cursor id.
        `text` / `reads` are what the next assistant step must say and read first (the previous hop's outcome)."""
        w, r, name = self.world, self.r, self.world.name(doc_id)
        if w.entities[doc_id].kind == "person" and r.random() < self.cfg.detour_rate / 2:
            surname = name.split()[-1]
            v = self._call(f"{text} I'll start with the surname {surname}.".strip(), reads, "search",
                           {"query": surname})
            found = any(h.doc_id == doc_id for h in self._hits)
            text = (f"The results for {surname} include {name}, but other people share the surname; "
                    f"searching the full name." if found else
                    f"The results for {surname} do not include {name}; searching the full name.")
            reads = {v}
        s = self._call(f"{text} Searching for {name}.".strip(), reads, "search", {"query": name})
        if not any(h.doc_id == doc_id for h in self._hits):
            s = self._call(f"None of the results is exactly {name}; searching the exact name.", {s}, "search",
                           {"query": f'"{name}"'})
        target = next(h for h in self._hits if h.doc_id == doc_id)
        wrong = [h for h in self._hits if h.doc_id != doc_id]
        if wrong and r.random() < self.cfg.detour_rate:
            twins = [h for h in wrong if _near_duplicate(h.name, name)]
            h = twins[0] if twins else r.choice(wrong)
            c = self._call(f"Result {h.rank}, {h.name} ({h.doc_id}), looks relevant; opening it.", {s}, "open",
                           {"doc_id": h.doc_id})
            text = (f"This page is about {h.name}, not {name}. Back in the search results, {name} is result "
                    f"{target.rank} ({doc_id}); opening it.")
            reads = {c, s}
        else:
            text, reads = f"Result {target.rank} is {name} ({doc_id}); opening it.", {s}
        d = self._call(text, reads, "open", {"doc_id": doc_id})
        fact_page = w.document(doc_id).page_of(fact, self.cfg.page_words)
        for page in range(2, fact_page + 1):
            d = self._call(f"Page {page - 1} of {name} does not give the {FIELD_WORDS[fact]}; reading page {page}.",
                           {d}, "open", {"doc_id": doc_id, "page": page})
        return d

    def statement(self, doc_id: str, fact: str) -> str:
        return f"The {FIELD_WORDS[fact]} of {self.world.name(doc_id)} is {self.world.fact_value(doc_id, fact)}."

    def solve(self, task: Task) -> None:
        self.messages.append({"role": "user", "content": task.question})
        text, reads = "", set()
        found: list[tuple[int, str]] = []  # (fact cursor, statement) along the way
        for bi, branch in enumerate(task.branches):
            if bi:
                text += f" Now the other side of the comparison: {self.world.name(branch[0].doc_id)}."
            for hop in branch:
                d = self.lookup(hop.doc_id, hop.fact, text.strip(), reads)
                found.append((d, self.statement(hop.doc_id, hop.fact)))
                text, reads = found[-1][1], {d}
        self._final(task, found)

    def _final(self, task: Task, found: list[tuple[int, str]]) -> None:
        if task.kind == "compare":
            ends = [found[len(task.branches[0]) - 1], found[-1]]
            last = [task.branches[0][-1], task.branches[1][-1]]
            vals = ", and ".join(s.rstrip(".") for _, s in ends)
            verdict = compare_verdict(self.world.entities[last[0].doc_id].kind, last[0].fact)
            text, reads = f"{vals}, so {task.answer} {verdict}.", {c for c, _ in ends}
        else:
            text, reads = found[-1][1], {found[-1][0]}
        if task.recap:
            text = "Recap: " + " ".join(s for _, s in found) + " " + ("" if task.kind == "chain" else text)
            reads = {c for c, _ in found}
        self._assistant(f"{text.strip()}\nFinal answer: {task.answer}", reads, None)


def _near_duplicate(a: str, b: str) -> bool:
    ta, tb = _tokens(a), _tokens(b)
    return len(ta) == len(tb) and sum(x != y for x, y in zip(ta, tb, strict=True)) == 1 and \
        all(x == y or _one_edit(x, y) for x, y in zip(ta, tb, strict=True))
