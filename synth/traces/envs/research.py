"""The `research` environment: multi-hop questions over the fictional encyclopedia (`synth.traces.world`), solved by a
scripted agent whose text does not give the hindsight labels away.

The world, its search and its documents are the templated generator's (one world per split, `world.build_worlds`);
the agent is new. The old solver wrote one fixed sentence per act, and each sentence told whether the response it
followed would be read again ("The founder of X is V." only after fact pages, "looks relevant" only before detours,
"Now the other side of the comparison" only after a branch end). Here every step is `note + plan`: the note about
the response just read comes from `grammar.note` (an informative sentence drawn the same way for every page, a
neutral acknowledgement or a random relevance claim), and the plan names the next call in one of many phrasings.

What decides whether a response is read again is its content, by fixed rules a reader can apply (the content
reader in `tests/test_env_research.py` applies them and agrees with every label; `docs/envs/research.md`):

- a search list is read again while it shows an entity the agent still has to open from it: the name it searched
  for, after the page opened from it turned out to have another title (the near-duplicate twin, one letter off), or
  a task-named entity it is the first list to show (a comparison's other side, a ranking's next candidate); by the
  step after the entity's first page when it shows a look-alike of the name (the opened title is checked against
  it); and by the final answer when its snippet holds a descriptor the answer states ("what does X do");
- a page is read again when it holds a fact the final answer states (the chain's last fact, both comparison ends,
  every ranked value, each fact of a recap, the one extra fact a partial recap asks for), and the page naming the
  next entity by the search for it and, when that search lists a look-alike of the name, by every step until the
  step after that entity's first page;
- everything else (pages of the wrong entity, pages without a needed fact, lists already used) expires after the
  step that reads it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsteward.synth.rng import mix, rng
from kvsteward.synth.traces import grammar
from kvsteward.synth.traces.envs.base import Recorder
from kvsteward.synth.traces.generate import split_of
from kvsteward.synth.traces.tasks import REL_PHRASE, Hop, phrase
from kvsteward.synth.traces.trace import Trace
from kvsteward.synth.traces.world import (
    DESCRIPTOR,
    NUMERIC,
    RELATIONS,
    SearchHit,
    World,
    _one_edit,
    _tokens,
    build_worlds,
)

__all__ = ["Options", "generate"]

ENV = "research"

SYSTEM_PROMPT = (
    "You are a research agent; answer from the encyclopedia. Tools: search(query) (quote a name for an exact "
    "match), open(doc_id, page). Call one in a <tool_call> block; results start with [cursor N]. "
    "End with 'Final answer: ...'."
)

# --- the user's language (the task): fixed tables, so a reader can parse every question ---------------------------

FIELD_NOUN = {
    "employer": "employer", "birthplace": "birthplace", "alma_mater": "university", "mentor": "mentor",
    "headquarters": "headquarters", "founder": "founder", "ceo": "chief executive", "mayor": "mayor",
    "location": "location", "rector": "rector", "birth_year": "birth year", "founded_year": "founding year",
    "employees": "headcount", "population": "population", "students": "enrolment", "occupation": "occupation",
    "industry": "industry", "region": "region", "character": "type",
}
# A short reference to the entity reached by a relation ("the founder"), used when the chain has it only once.
REF_NOUN = {
    "employer": "the employer", "birthplace": "the birthplace", "alma_mater": "the university", "mentor": "the mentor",
    "headquarters": "the headquarters city", "founder": "the founder", "ceo": "the chief executive",
    "mayor": "the mayor", "location": "the campus city", "rector": "the rector",
}
# Questions whose answer is a numeric fact of the entity {x} (one field per template).
NUMERIC_Q = {
    "birth_year": ["In what year was {x} born?", "When was {x} born?", "What is the birth year of {x}?"],
    "founded_year": ["In what year was {x} founded?", "When was {x} founded?", "What is the founding year of {x}?"],
    "employees": ["How many people does {x} employ?", "What is the headcount of {x}?"],
    "population": ["What is the population of {x}?", "How many people live in {x}?"],
    "students": ["How many students does {x} enroll?", "How many students attend {x}?"],
}
DESCRIPTOR_Q = {
    "occupation": ["What does {x} do for a living?", "What is the occupation of {x}?"],
    "industry": ["What business is {x} in?", "Which industry is {x} in?"],
    "region": ["In which region does {x} lie?", "Where does {x} lie?"],
    "character": ["What kind of school is {x}?", "What type of institution is {x}?"],
}
# Questions whose answer is a name: {x} is the noun phrase of the entity asked for ("the mentor of ...").
NAME_Q = ["Who or what is {x}?", "Name {x}.", "What is the name of {x}?", "Can you find {x}?"]
# Comparisons and rankings: (field, direction) -> templates; the answer is the winning entity's name.
COMPARE_Q = {
    ("birth_year", "min"): ["Who was born earlier: {a} or {b}?", "Of {a} and {b}, who was born first?"],
    ("birth_year", "max"): ["Who was born later: {a} or {b}?", "Of {a} and {b}, who is younger?"],
    ("founded_year", "min"): ["Which was founded earlier: {a} or {b}?", "Of {a} and {b}, which is older?"],
    ("founded_year", "max"): ["Which was founded later: {a} or {b}?", "Of {a} and {b}, which is younger?"],
    ("employees", "max"): ["Which employs more people: {a} or {b}?", "Of {a} and {b}, which has more staff?"],
    ("employees", "min"): ["Which employs fewer people: {a} or {b}?", "Of {a} and {b}, which has less staff?"],
    ("population", "max"): ["Which has more residents: {a} or {b}?", "Of {a} and {b}, which is bigger?"],
    ("population", "min"): ["Which has fewer residents: {a} or {b}?", "Of {a} and {b}, which is smaller?"],
    ("students", "max"): ["Which enrolls more students: {a} or {b}?", "Of {a} and {b}, which has more students?"],
    ("students", "min"): ["Which enrolls fewer students: {a} or {b}?", "Of {a} and {b}, which has fewer students?"],
}
RANK_Q = {
    ("birth_year", "min"): ["Which of {items} was born first?", "Among {items}, who is the oldest?"],
    ("birth_year", "max"): ["Which of {items} was born last?", "Among {items}, who is the youngest?"],
    ("founded_year", "min"): ["Which of {items} was founded first?", "Among {items}, which is the oldest?"],
    ("founded_year", "max"): ["Which of {items} was founded last?", "Among {items}, which is the newest?"],
    ("employees", "max"): ["Which of {items} employs the most people?", "Among {items}, which has the most staff?"],
    ("population", "max"): ["Which of {items} has the most residents?", "Among {items}, which is the largest?"],
    ("students", "max"): ["Which of {items} enrolls the most students?", "Among {items}, which is the biggest?"],
}
# What the user adds after the question. Recaps make every chain fact needed at the end; a partial recap one extra
# fact; the fillers (about as long) change nothing, so "the task has an extra sentence" tells nothing.
RECAP_REQUESTS = [
    "In your final answer, restate every fact you found on the way.",
    "Please walk me through each link of the chain in your answer.",
    "Show every intermediate fact before giving the answer.",
    "I want the whole chain of facts, not just the final value.",
    "Spell out each step you looked up when you answer.",
    "List each fact along the way, then the answer.",
]
FILLERS = [
    "A short answer is fine; I only need the final value.",
    "This is for a quiz, so please be careful with the names.",
    "Take care with similar-looking names in the results.",
    "I am checking a draft article, so accuracy matters here.",
    "Please answer in one line if you can manage it.",
    "No need to explain much, the result is what I need.",
]
# Comparisons and rankings may also ask for each entity's descriptor, which the search snippets show.
DESCRIBE_REQUESTS = {
    "occupation": ["Also say what each of them does for a living.", "Mention each one's occupation too."],
    "industry": ["Also say which business each of them is in.", "Mention each one's industry too."],
    "region": ["Also say where each of them lies.", "Mention each one's region too."],
    "character": ["Also say what kind of school each of them is.", "Mention each one's type too."],
}
EXTRA_WRAP = ["Also {ask}.", "In your answer, also {ask}.", "Please {ask} as well.", "And {ask}, too.",
              "While you are at it, {ask}."]
EXTRA_ASK = {
    "birth_year": "say when {x} was born", "employer": "say where {x} works", "birthplace": "say where {x} was born",
    "alma_mater": "say where {x} studied", "mentor": "say who mentored {x}", "occupation": "say what {x} does",
    "headquarters": "say where {x} is headquartered", "founder": "say who founded {x}",
    "ceo": "name the chief executive of {x}", "industry": "say what business {x} is in",
    "employees": "say how many people {x} employs", "founded_year": "say when {x} was founded",
    "mayor": "name the mayor of {x}", "population": "give the population of {x}", "region": "say where {x} lies",
    "location": "say where {x} is located", "rector": "name the rector of {x}",
    "students": "say how many students {x} has", "character": "say what kind of school {x} is",
}

# --- the agent's language: many phrasings per act, none tied to a label -------------------------------------------

START = ["", "", "Let me look this up.", "Starting from the question.", "First, a search.", "Let me begin.",
         "One step at a time."]
SEARCH = ["Searching for {name}.", "Next, {name}.", "Searching.", "Looking up {name}.", "A search next.",
          "{name} next.", "Let me search."]
SEARCH_JOINT = ["Searching for all of them.", "One search for all.", "Searching them together.", "A joint search.",
                "Let me search for all at once."]
SEARCH_EXACT = ["An exact search.", "Quoting the name.", "Exact name, then.", "Let me quote {name}.",
                "Trying an exact match."]
OPEN = ["Opening result {rank}.", "Let me open {doc}.", "Result {rank} looks relevant; opening it.",
        "{doc} should be it.", "Checking result {rank}.", "Opening {doc}.", "Result {rank} it is."]
REOPEN = ["Back to the results: result {rank}.", "From the earlier list, {doc}.", "Going back to the list.",
          "The results also show {doc}.", "Returning to the results.", "Result {rank} of that search next.",
          "Back in the list, result {rank} looks relevant; opening it."]
PAGE = ["Reading page {p}.", "On to page {p}.", "Let me check page {p}.", "Page {p} next.", "Next page.",
        "Turning to page {p}."]
SWITCH = ["Now the other side.", "One down.", "Next, the other one.", "Turning to {name}.", "Now for {name}.",
          "On to the next one.", "That leaves {name}.", "Next candidate."]
LIST_NOTE = ["{k} came back.", "The search returned {k}.", "{k} listed.", "Got {k}.", "The list has {k}.",
             "Results are in."]
PAGE_NOTE = ["Page {p} of {n} for {name}.", "This is page {p}/{n} of {name}.", "{name}, page {p} of {n}.",
             "Read page {p} of {name}.", "That was page {p} of {n}."]
STATEMENT = ["The {fw} of {n} is {v}.", "{Fw}: {v}.", "This gives {v} as the {fw}.", "So the {fw} is {v}.",
             "{n}: {fw} {v}.", "Here the {fw} is {v}.", "It says {fw} {v}."]
FINAL_STATEMENT = ["The {fw} of {n} is {v}.", "{n}'s {fw} is {v}.", "{n} has {v} as {fw}.", "For {n}, the {fw} is {v}.",
                   "{v} is the {fw} of {n}."]
RECAP_INTRO = ["Recap:", "Here is the chain:", "Step by step:", "The facts in order:", "Putting it together:"]
VERDICT = {
    "min": ["{w} has the earlier {fw}.", "The earliest {fw} is that of {w}.", "{w} comes first by {fw}.",
            "So {w} is the earliest.", "By {fw}, {w} is first."],
    "max": ["{w} has the larger {fw}.", "The largest {fw} belongs to {w}.", "{w} comes out ahead on {fw}.",
            "So {w} has the most.", "By {fw}, {w} is on top."],
}
VERDICT_YEAR_MAX = ["{w} has the later {fw}.", "The latest {fw} is that of {w}.", "{w} comes last by {fw}.",
                    "So {w} is the most recent.", "By {fw}, {w} is last."]
VERDICT_COUNT_MIN = ["{w} has the smaller {fw}.", "The smallest {fw} belongs to {w}.", "{w} has the lowest {fw}.",
                     "So {w} has the fewest.", "By {fw}, {w} is at the bottom."]

# Cue vocabulary: one role per tool response (docs/envs/research.md explains when each is read again).
CUES = ("list", "list_miss", "list_revisit", "list_pending", "snippet_fact", "wrong_page", "page_miss", "hop_fact",
        "answer_fact", "compare_end", "rank_item", "recap_fact", "extra_fact")
DESCRIPTORS = frozenset(DESCRIPTOR.values())
QUOTE = '"'
_YEAR_FIELDS = ("birth_year", "founded_year")


@dataclass
class Options:
    """Generation knobs. `detour_rate`, `top_k`, `compare_rate`, `recap_rate`, `world_size` are the CLI's shared
    flags (which pass the CLI's defaults: `--top-k 5` gives lists one line longer than the default 4 here, ~+30
    tokens per trace). Chain and page sizes have their own names: the CLI's `--max-hops` / `--page-words` defaults
    (6, 160) are sized for the templated generator and would blow this environment's size budget."""

    chain_min: int = 3  # entities on a chain task's path (each needs a search and at least one page)
    chain_max: int = 3
    words_per_page: int = 30
    words_per_doc: int = 25  # a document's length floor is 8 words per fact, so most have 2 pages
    detour_rate: float = 0.35  # chance of opening a listed near-duplicate before the right result
    top_k: int = 4
    compare_rate: float = 0.3
    rank_rate: float = 0.25
    recap_rate: float = 0.5  # chains whose answer restates facts (full or partial recap); comparisons: half that
    partial_share: float = 0.5  # of those, the share asking for one extra fact instead of the whole chain
    joint_rate: float = 0.5  # comparisons / rankings that start with one search for all task-named entities
    describe_rate: float = 0.6  # comparisons / rankings that also ask for each entity's descriptor
    twin_rate: float = 0.6
    world_size: int = 2000
    min_cursors: int = 6
    max_cursors: int = 14

    def validate(self) -> None:
        if not 2 <= self.chain_min <= self.chain_max <= 6:
            raise ValueError(f"chain_min / chain_max must satisfy 2 <= chain_min <= chain_max <= 6, got "
                             f"{self.chain_min}..{self.chain_max}")
        for name in ("detour_rate", "compare_rate", "rank_rate", "recap_rate", "partial_share", "joint_rate",
                     "describe_rate", "twin_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.compare_rate + self.rank_rate > 1:
            raise ValueError(f"compare_rate + rank_rate must be at most 1, got {self.compare_rate + self.rank_rate}")
        if self.words_per_page < 10 or self.words_per_doc < 10:
            raise ValueError("words_per_page and words_per_doc must be at least 10")
        if self.top_k < 2:
            raise ValueError(f"top_k must be at least 2, got {self.top_k}")
        if self.world_size < 200:
            raise ValueError(f"world_size must be at least 200, got {self.world_size}")
        if not 1 <= self.min_cursors <= self.max_cursors:
            raise ValueError(f"min_cursors / max_cursors must satisfy 1 <= min <= max, got "
                             f"{self.min_cursors}..{self.max_cursors}")


# --- tasks ---------------------------------------------------------------------------------------------------------

@dataclass
class Visit:
    """One entity the agent must read: `lead` is the relation whose value names the next entity of its branch
    (None at a branch end); `anchor` entities are named in the task, so any list showing them serves."""

    doc_id: str
    lead: str | None
    anchor: bool


@dataclass
class Plan:
    kind: str  # chain | recap | partial | compare | compare_recap | rank
    question: str
    answer: str
    visits: list[Visit]
    asks: list[tuple[str, str]]  # (doc_id, field) the final answer states, in the order it states them
    order: tuple[str, str] | None = None  # (field, "min" | "max") of a comparison or ranking

    def page_needs(self, v: Visit) -> list[str]:
        """Fields the agent must find on `v`'s pages: its lead, then what the answer states (descriptors excepted:
        the search list's snippet shows those)."""
        out = [v.lead] if v.lead else []
        return out + [f for d, f in self.asks if d == v.doc_id and f not in out and f not in DESCRIPTORS]

    def list_needs(self, v: Visit) -> list[str]:
        return [f for d, f in self.asks if d == v.doc_id and f in DESCRIPTORS]


def _confusable(a: str, b: str) -> bool:
    """Near-duplicate names: same token count, one token one edit away, the rest equal (the world's twins)."""
    ta, tb = _tokens(a), _tokens(b)
    diff = [(x, y) for x, y in zip(ta, tb, strict=False) if x != y]
    return len(ta) == len(tb) and len(diff) == 1 and _one_edit(*diff[0])


class Sampler:
    """Draws a task plan in one world; every path keeps its entities distinct and free of near-duplicate pairs."""

    def __init__(self, world: World, r: random.Random, opts: Options):
        self.w, self.r, self.o = world, r, opts
        twins = {e.doc_id for e in world.entities.values() if e.twin_of}
        self.twinned = sorted(twins | {world.entities[d].twin_of for d in twins})

    def plan(self) -> Plan:
        x = self.r.random()
        if x < self.o.compare_rate:
            return self._compare()
        if x < self.o.compare_rate + self.o.rank_rate:
            return self._rank()
        return self._chain()

    def _anchor(self, kind: str | None = None) -> str:
        pool = [d for d in self.twinned if kind is None or self.w.entities[d].kind == kind]
        if pool and self.r.random() < 0.6:
            return self.r.choice(pool)
        kind = kind or self.r.choice(["person", "person", "company", "city", "university"])
        return self.r.choice(self.w.by_kind[kind])

    def _distinct(self, docs: list[str]) -> bool:
        names = [self.w.name(d) for d in docs]
        return len(set(docs)) == len(docs) and not any(
            _confusable(a, b) for i, a in enumerate(names) for b in names[i + 1:])

    def _walk(self, start: str, relations: int, fixed: list[str] | None = None) -> list[Hop] | None:
        """A relation path of `relations` steps from `start` (following `fixed` relations if given)."""
        hops, doc = [], start
        for i in range(relations):
            rels = RELATIONS[self.w.entities[doc].kind]
            f = fixed[i] if fixed else self.r.choice(sorted(rels))
            if f not in rels:
                return None
            hops.append(Hop(doc, f))
            doc = self.w.entities[doc].rels[f]
        hops.append(Hop(doc, ""))
        return hops

    def _final(self, kind: str, subject: str) -> tuple[str, str]:
        """(field, question) asking for a fact of the chain's last entity: a number, a name or a descriptor."""
        x = self.r.random()
        if x < 0.25:
            fact = self.r.choice(sorted(RELATIONS[kind]))
            return fact, self.r.choice(NAME_Q).format(x=REL_PHRASE[fact].format(x=subject))
        if x < 0.45:
            fact = DESCRIPTOR[kind]
            return fact, self.r.choice(DESCRIPTOR_Q[fact]).format(x=subject)
        fact = self.r.choice(sorted(NUMERIC[kind]))
        return fact, self.r.choice(NUMERIC_Q[fact]).format(x=subject)

    def _chain(self) -> Plan:
        for _ in range(200):
            n = self.r.randint(self.o.chain_min, self.o.chain_max)
            path = self._walk(self._anchor(), n - 1)
            if path is None or not self._distinct([h.doc_id for h in path]):
                continue
            end = self.w.entities[path[-1].doc_id]
            fact, question = self._final(end.kind, phrase(self.w, path[:-1]))
            visits = [Visit(h.doc_id, h.fact, i == 0) for i, h in enumerate(path[:-1])]
            visits.append(Visit(end.doc_id, None, False))
            asks = [(end.doc_id, fact)]
            kind = "chain"
            if self.r.random() < self.o.recap_rate:
                if self.r.random() < self.o.partial_share:
                    kind, (extra, sentence) = "partial", self._extra(path)
                    asks.append(extra)
                    question += " " + sentence
                else:
                    kind = "recap"
                    asks = [(h.doc_id, h.fact) for h in path[:-1]] + asks
                    question += " " + self.r.choice(RECAP_REQUESTS)
            else:
                question = self._filler(question)
            return Plan(kind, question, self.w.fact_value(end.doc_id, fact), visits, asks)
        raise RuntimeError(f"could not sample a chain in the {self.w.split} world")

    def _extra(self, path: list[Hop]) -> tuple[tuple[str, str], str]:
        """One extra fact of an entity before the chain's end, and the sentence asking for it."""
        k = self.r.randrange(len(path) - 1)
        doc, lead = path[k].doc_id, path[k].fact
        e = self.w.entities[doc]
        others = sorted(f for f in list(e.rels) + list(e.attrs) if f != lead and f != DESCRIPTOR[e.kind])
        fact = DESCRIPTOR[e.kind] if self.r.random() < 0.4 else self.r.choice(others)
        if k == 0:
            ref = e.name
        elif sum(h.fact == path[k - 1].fact for h in path[:-1]) == 1 and self.r.random() < 0.7:
            ref = REF_NOUN[path[k - 1].fact]
        else:
            ref = phrase(self.w, path[:k])
        ask = EXTRA_ASK[fact].format(x=ref)
        return (doc, fact), self.r.choice(EXTRA_WRAP).format(ask=ask)

    def _describe(self, question: str, asks: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
        """Sometimes ask for each compared entity's descriptor too (its search list then stays needed)."""
        if self.r.random() >= self.o.describe_rate:
            return self._filler(question), asks
        desc = DESCRIPTOR[self.w.entities[asks[0][0]].kind]
        return question + " " + self.r.choice(DESCRIBE_REQUESTS[desc]), asks + [(d, desc) for d, _ in asks]

    def _filler(self, question: str) -> str:
        return question + " " + self.r.choice(FILLERS) if self.r.random() < 0.8 else question

    def _compare(self) -> Plan:
        for _ in range(200):
            kind = self.r.choice(["person", "company", "city", "university"])
            a = self._anchor(kind)
            b = self.r.choice([d for d in self.w.by_kind[kind] if d != a])
            pa = self._walk(a, 1)
            pb = self._walk(b, 1, [pa[0].fact]) if pa else None
            if pa is None or pb is None or not self._distinct([h.doc_id for h in pa + pb]):
                continue
            ea, eb = self.w.entities[pa[-1].doc_id], self.w.entities[pb[-1].doc_id]
            fact = self.r.choice(sorted(NUMERIC[ea.kind]))
            direction = self.r.choice([d for f, d in COMPARE_Q if f == fact])
            if ea.attrs[fact] == eb.attrs[fact]:
                continue
            question = self.r.choice(COMPARE_Q[(fact, direction)]).format(
                a=phrase(self.w, pa[:-1]), b=phrase(self.w, pb[:-1]))
            visits = [Visit(pa[0].doc_id, pa[0].fact, True), Visit(ea.doc_id, None, False),
                      Visit(pb[0].doc_id, pb[0].fact, True), Visit(eb.doc_id, None, False)]
            asks = [(ea.doc_id, fact), (eb.doc_id, fact)]
            winner = _winner([ea, eb], fact, direction)
            if self.r.random() < self.o.recap_rate / 2:
                asks = [(pa[0].doc_id, pa[0].fact), asks[0], (pb[0].doc_id, pb[0].fact), asks[1]]
                question += " " + self.r.choice(RECAP_REQUESTS)
                return Plan("compare_recap", question, winner.name, visits, asks, (fact, direction))
            question, asks = self._describe(question, asks)
            return Plan("compare", question, winner.name, visits, asks, (fact, direction))
        raise RuntimeError(f"could not sample a comparison in the {self.w.split} world")

    def _rank(self) -> Plan:
        for _ in range(200):
            fact, direction = self.r.choice(sorted(RANK_Q))
            kind = self.r.choice([k for k in NUMERIC if fact in NUMERIC[k]])
            n = self.r.choice([3, 3, 4])
            docs = [self._anchor(kind)]
            docs += self.r.sample([d for d in self.w.by_kind[kind] if d != docs[0]], n - 1)
            self.r.shuffle(docs)
            ents = [self.w.entities[d] for d in docs]
            if not self._distinct(docs) or len({e.attrs[fact] for e in ents}) < n:
                continue
            names = [e.name for e in ents]
            items = ", ".join(names[:-1]) + " and " + names[-1]
            question = self.r.choice(RANK_Q[(fact, direction)]).format(items=items)
            winner = _winner(ents, fact, direction)
            question, asks = self._describe(question, [(d, fact) for d in docs])
            return Plan("rank", question, winner.name, [Visit(d, None, True) for d in docs], asks, (fact, direction))
        raise RuntimeError(f"could not sample a ranking in the {self.w.split} world")


def _count(n: int) -> str:
    return f"{n} result" if n == 1 else f"{n} results"


def _winner(ents: list, fact: str, direction: str):
    pick = min if direction == "min" else max
    return pick(ents, key=lambda e: e.attrs[fact])


# --- the agent -----------------------------------------------------------------------------------------------------

@dataclass
class Listing:
    cursor: int
    query: str
    hits: list[SearchHit]

    def rank_of(self, doc_id: str) -> int | None:
        return next((h.rank for h in self.hits if h.doc_id == doc_id), None)


@dataclass
class Agent:
    """Solves one plan in one world, recording every step's reads (the script's provenance) and each response's
    cue. The next step always reads the last response (`react`) and starts with a note on it (`note`). The page
    naming the next entity (`namer`) is read by the search for it; when that search lists a look-alike of the name,
    every later step locating the entity reads the page again (it checks the spelling of the listed names and of
    the opened title against it), until the step after the entity's first page. That step also reads the list
    the page was opened from when the list shows a look-alike."""

    world: World
    opts: Options
    r: random.Random
    plan: Plan
    rec: Recorder = field(default_factory=lambda: Recorder(SYSTEM_PROMPT))
    style: grammar.NoteStyle = field(default_factory=grammar.NoteStyle)
    note: str = ""
    switch: str = ""
    react: set[int] = field(default_factory=set)
    namer: set[int] = field(default_factory=set)
    unname: set[int] = field(default_factory=set)  # namer pages the next step reads for the last time
    lists: list[Listing] = field(default_factory=list)
    source: dict[tuple[str, str], int] = field(default_factory=dict)  # (doc, field) -> cursor showing it
    docs: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.style = grammar.NoteStyle.draw(self.r)
        self.needed = {v.doc_id for v in self.plan.visits}
        self.anchors = [v.doc_id for v in self.plan.visits if v.anchor]

    # --- recording ---------------------------------------------------------------------------------------------
    def _step(self, plan_text: str, reads: set[int], name: str, arguments: dict, body: str, cue: str) -> int:
        text = grammar.join(self.note, self.switch, plan_text)
        cid = self.rec.call(text, self.react | self.namer | reads, name, arguments, body, cue)
        self.note, self.react, self.switch = "", {cid}, ""
        self.namer -= self.unname
        self.unname = set()
        return cid

    def _search(self, query: str, plan_text: str) -> Listing:
        hits = self.world.search(query, self.opts.top_k)
        self.docs.update(h.doc_id for h in hits)
        self.names.update(h.name for h in hits)
        lines = [f"{h.rank}. {h.doc_id} {h.name} ({h.snippet.split(', ', 1)[1]})" for h in hits]  # the descriptor
        head = f'search "{query.strip(QUOTE)}"' + (" (exact)" if query.startswith(QUOTE) else "")
        body = f"{head}: {_count(len(hits))}\n" + "\n".join(lines) if hits else f"{head}: no results"
        cid = self._step(plan_text, set(), "search", {"query": query}, body, "list")
        listing = Listing(cid, query, hits)
        self.lists.append(listing)
        self.note = grammar.note(self.r, grammar.say(self.r, LIST_NOTE, k=_count(len(hits))), self.style)
        return listing

    def _open(self, doc_id: str, page: int, plan_text: str, reads: set[int], sought: list[str]) -> tuple[int, set]:
        """Open one page; returns (cursor, fields of `doc_id` on that page) and leaves the note on it."""
        doc = self.world.document(doc_id)
        ranges = doc.pages(self.opts.words_per_page)
        a, b = ranges[page - 1]
        on_page = {f for f, i in doc.fact_at.items() if a <= i < b}
        body = f"{doc.title}, page {page}/{len(ranges)}\n{doc.page_text(page, self.opts.words_per_page)}"
        cue = "wrong_page" if doc_id not in self.needed else ("hop_fact" if on_page & set(sought) else "page_miss")
        args = {"doc_id": doc_id, "page": page} if page > 1 else {"doc_id": doc_id}
        cid = self._step(plan_text, reads, "open", args, body, cue)
        self.docs.add(doc_id)
        e = self.world.entities[doc_id]
        self.names.add(e.name)
        self.names.update(self.world.name(e.rels[f]) for f in on_page if f in e.rels)
        self.note = grammar.note(self.r, self._page_note(doc_id, page, len(ranges), on_page, sought), self.style)
        return cid, on_page

    def _page_note(self, doc_id: str, page: int, pages: int, on_page: set[str], sought: list[str]) -> str:
        """What the agent says about a page: a fact on it (the sought one more often) or where it is in the
        document; drawn the same way for right and wrong pages, needed or not."""
        if on_page and self.r.random() < 0.75:
            hit = [f for f in sought if f in on_page]
            return self.statement(doc_id, hit[0] if hit and self.r.random() < 0.6 else self.r.choice(sorted(on_page)))
        return grammar.say(self.r, PAGE_NOTE, p=page, n=pages, name=self.world.name(doc_id))

    def statement(self, doc_id: str, fact: str, templates: list[str] = STATEMENT) -> str:
        fw = FIELD_NOUN[fact]
        return grammar.say(self.r, templates, fw=fw, Fw=fw[0].upper() + fw[1:], n=self.world.name(doc_id),
                           v=self.world.fact_value(doc_id, fact))

    # --- script ------------------------------------------------------------------------------------------------
    def solve(self) -> None:
        self.rec.user(self.plan.question)
        self.note = grammar.say(self.r, START)
        joint = self.plan.order is not None and self.r.random() < self.opts.joint_rate
        switch_at = self.r.choice(["before", "after", "none"])
        for i, v in enumerate(self.plan.visits):
            later_anchor = bool(v.anchor and i)
            if later_anchor and switch_at == "before":
                self.switch = grammar.say(self.r, SWITCH, name=self.world.name(v.doc_id))
            self.visit(v, joint and i == 0, switch_after=later_anchor and switch_at == "after")
        self.final()

    def _first_list(self, doc_id: str) -> Listing | None:
        return next((li for li in self.lists if li.rank_of(doc_id)), None)

    def _locate(self, v: Visit, joint: bool) -> Listing:
        """The list the agent takes `v` from: for a task-named entity the first list that shows it, else a new
        search (all task-named entities at once if `joint`), then an exact search if the name is not listed."""
        name = self.world.name(v.doc_id)
        listing = self._first_list(v.doc_id) if v.anchor else None
        if listing is None:
            if joint:
                names = [self.world.name(d) for d in self.anchors]
                listing = self._search(", ".join(names), grammar.say(
                    self.r, SEARCH_JOINT, names=", ".join(names[:-1]) + " and " + names[-1]))
            else:
                listing = self._search(name, grammar.say(self.r, SEARCH, name=name))
                if not any(_confusable(h.name, name) for h in listing.hits):
                    self.namer = set()  # no look-alike listed: the name needs no second check
            if listing.rank_of(v.doc_id) is None:
                self.rec.set_cue(listing.cursor, "list_miss")
                listing = self._search(f'"{name}"', grammar.say(self.r, SEARCH_EXACT, name=name))
        return listing

    def visit(self, v: Visit, joint: bool, switch_after: bool) -> None:
        listing = self._locate(v, joint)
        for f in self.plan.list_needs(v):
            self.source[(v.doc_id, f)] = listing.cursor
        if switch_after:
            self.switch = grammar.say(self.r, SWITCH, name=self.world.name(v.doc_id))
        need = self.plan.page_needs(v)
        if not need:  # the snippet shows all the answer needs from this entity
            return
        fresh = self.react == {listing.cursor}
        wrong = self._wrong_choice(listing, v.doc_id)
        if wrong is not None:
            self._from_list(listing, wrong, fresh, need)
            self.rec.set_cue(listing.cursor, "list_revisit")
            fresh = False
        elif not fresh:
            self.rec.set_cue(listing.cursor, "list_pending")
        cid, found = self._from_list(listing, v.doc_id, fresh, need)
        if any(_confusable(h.name, self.world.name(v.doc_id)) for h in listing.hits):
            self.namer.add(listing.cursor)  # the next step checks the opened title against the look-alike
        self.unname = set(self.namer)
        self._read_rest(v, cid, found, need)

    def _from_list(self, listing: Listing, doc_id: str, fresh: bool, need: list[str]) -> tuple[int, set]:
        rank = listing.rank_of(doc_id)
        text = grammar.say(self.r, OPEN if fresh else REOPEN, rank=rank, doc=doc_id)
        return self._open(doc_id, 1, text, {listing.cursor}, need)

    def _wrong_choice(self, listing: Listing, doc_id: str) -> str | None:
        """A result the agent opens by mistake: a listed near-duplicate of the name (rate `detour_rate`), rarely
        another result that shares a word with it. Never an entity the task needs."""
        name = self.world.name(doc_id)
        others = [h for h in listing.hits if h.doc_id not in self.needed]
        twins = [h for h in others if _confusable(h.name, name)]
        if twins and self.r.random() < self.opts.detour_rate:
            return self.r.choice(twins).doc_id
        similar = [h for h in others if set(_tokens(h.name)) & set(_tokens(name))]
        if similar and self.r.random() < self.opts.detour_rate / 4:
            return self.r.choice(similar).doc_id
        return None

    def _read_rest(self, v: Visit, cid: int, found: set[str], need: list[str]) -> None:
        """Read further pages until every needed field of `v` is found; the lead's page then names the next entity
        (read by every step that locates it)."""
        pages = {f: cid for f in found}
        page = 1
        while not set(need) <= set(pages):
            page += 1
            cid, found = self._open(v.doc_id, page, grammar.say(self.r, PAGE, p=page, doc=v.doc_id), set(), need)
            pages.update({f: cid for f in found if f not in pages})
        for f in need:
            self.source[(v.doc_id, f)] = pages[f]
        if v.lead:
            self.namer.add(pages[v.lead])

    def final(self) -> None:
        p = self.plan
        reads = {self.source[a] for a in p.asks}
        for doc, f in p.asks:
            self.rec.set_cue(self.source[(doc, f)], self._ask_cue(doc, f))
        text = grammar.join(self.note, f"{self._answer_text()}\nFinal answer: {p.answer}")
        self.rec.assistant(text, self.react | self.namer | reads)

    def _ask_cue(self, doc: str, f: str) -> str:
        p = self.plan
        if f in DESCRIPTORS:
            return "snippet_fact"
        if p.kind == "rank":
            return "rank_item"
        if p.order is not None:
            return "compare_end" if doc in (p.visits[1].doc_id, p.visits[3].doc_id) else "recap_fact"
        if doc == p.visits[-1].doc_id:
            return "answer_fact"
        return "extra_fact" if p.kind == "partial" else "recap_fact"

    def _answer_text(self) -> str:
        p, r = self.plan, self.r
        facts = [self.statement(d, f, FINAL_STATEMENT) for d, f in p.asks]
        if p.kind in ("recap", "compare_recap"):
            facts = [r.choice(RECAP_INTRO)] + facts
        elif len(facts) > 1:
            r.shuffle(facts)
        if p.order is None:
            return grammar.join(*facts)
        fact, direction = p.order
        if direction == "max" and fact in _YEAR_FIELDS:
            verdicts = VERDICT_YEAR_MAX
        elif direction == "min" and fact not in _YEAR_FIELDS:
            verdicts = VERDICT_COUNT_MIN
        else:
            verdicts = VERDICT[direction]
        return grammar.join(*facts, r.choice(verdicts).format(w=p.answer, fw=FIELD_NOUN[fact]))


# --- entry point ---------------------------------------------------------------------------------------------------

def _hops(agent: Agent) -> int:
    """Tool calls the task needs: every call but the detours (wrong opens) and failed searches."""
    return sum(1 for c in agent.rec.cues.values() if c not in ("wrong_page", "list_miss"))


def solve_task(world: World, r: random.Random, opts: Options) -> Agent:
    """One plan, solved; redrawn (same rng, so deterministic) until its tool responses fit the cursor range."""
    for _ in range(100):
        agent = Agent(world, opts, r, Sampler(world, r, opts).plan())
        agent.solve()
        n = sum(1 for m in agent.rec.messages if m["role"] == "tool")
        if opts.min_cursors <= n <= opts.max_cursors:
            return agent
    raise RuntimeError(f"no task with {opts.min_cursors}-{opts.max_cursors} tool responses in 100 draws: widen "
                       "min_cursors / max_cursors or the chain range")


def generate(n_tasks: int, seed: int, options: Options, progress: Callable[[int], None] | None = None) -> list[Trace]:
    options.validate()
    worlds = build_worlds(seed, options.world_size, options.twin_rate, options.words_per_doc)
    traces = []
    for i in range(n_tasks):
        split = split_of(i)
        agent = solve_task(worlds[split], rng(seed, ENV, i), options)
        p = agent.plan
        traces.append(agent.rec.trace(
            task_id=f"s{seed}-{ENV}-t{i:05d}", split=split, env=ENV, task_seed=mix(seed, ENV, i),
            question=p.question, answer=p.answer, kind=p.kind, hops=_hops(agent), docs=sorted(agent.docs),
            entities=sorted(agent.names)))
        if progress:
            progress(i + 1)
    return traces
