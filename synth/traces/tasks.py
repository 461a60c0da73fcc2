"""Multi-hop research tasks over a `World`: a relation path from an anchor entity to a final fact.

`chain`: "In what year was the mentor of the founder of Veltria Systems born?" (one branch, 2–6 documents).
`compare`: "Which was established earlier: the employer of A or the employer of B?" (two branches of equal shape,
the answer is the winning entity's name). Hops = documents that must be read. Answers are checkable strings.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsteward.synth.traces.world import NUMERIC, RELATIONS, World

REL_PHRASE = {
    "employer": "the employer of {x}", "birthplace": "the birthplace of {x}",
    "alma_mater": "the university where {x} studied", "mentor": "the mentor of {x}",
    "headquarters": "the city where {x} is headquartered", "founder": "the founder of {x}",
    "ceo": "the chief executive of {x}", "mayor": "the mayor of {x}",
    "location": "the city where {x} is located", "rector": "the rector of {x}",
}
FIELD_WORDS = {
    "employer": "employer", "birthplace": "birthplace", "alma_mater": "university", "mentor": "mentor",
    "headquarters": "headquarters", "founder": "founder", "ceo": "chief executive", "mayor": "mayor",
    "location": "location", "rector": "rector", "birth_year": "birth year", "founded_year": "founding year",
    "employees": "number of employees", "population": "population", "students": "number of students",
}
_NUMERIC_Q = {
    ("person", "birth_year"): "In what year was {x} born?",
    ("company", "founded_year"): "In what year was {x} established?",
    ("company", "employees"): "How many people does {x} employ?",
    ("city", "population"): "What is the population of {x}?",
    ("city", "founded_year"): "In what year was {x} settled?",
    ("university", "founded_year"): "In what year did {x} open its doors?",
    ("university", "students"): "How many students does {x} enroll?",
}
# (kind, field) -> (question, "min" | "max" wins, verb phrase for the conclusion)
_COMPARE_Q = {
    ("person", "birth_year"): ("Who was born earlier: {a} or {b}?", "min", "was born earlier"),
    ("company", "founded_year"): ("Which was established earlier: {a} or {b}?", "min", "was established earlier"),
    ("company", "employees"): ("Which employs more people: {a} or {b}?", "max", "employs more people"),
    ("city", "population"): ("Which has the larger population: {a} or {b}?", "max", "has the larger population"),
    ("city", "founded_year"): ("Which was settled earlier: {a} or {b}?", "min", "was settled earlier"),
    ("university", "founded_year"): ("Which opened its doors earlier: {a} or {b}?", "min", "opened earlier"),
    ("university", "students"): ("Which enrolls more students: {a} or {b}?", "max", "enrolls more students"),
}


@dataclass
class Hop:
    doc_id: str
    fact: str  # the field read in this document


@dataclass
class Task:
    kind: str  # "chain" | "compare"
    question: str
    answer: str
    branches: list[list[Hop]]
    recap: bool  # the final answer restates every fact of the path (so early cursors are read again at the end)

    @property
    def hops(self) -> int:
        return sum(len(b) for b in self.branches)


def phrase(world: World, path: list[Hop]) -> str:
    """Noun phrase for the entity reached after following `path` (all hops are relations)."""
    x = world.name(path[0].doc_id)
    for hop in path:
        x = REL_PHRASE[hop.fact].format(x=x)
    return x


def _walk(world: World, r: random.Random, anchor: str, relations: int) -> list[str] | None:
    """Docs visited by a random relation walk of the given length from anchor, without revisits."""
    docs = [anchor]
    for _ in range(relations):
        e = world.entities[docs[-1]]
        options = [f for f in RELATIONS[e.kind] if e.rels[f] not in docs]
        if not options:
            return None
        docs.append(e.rels[r.choice(options)])
    return docs


def _rel_between(world: World, a: str, b: str) -> str:
    e = world.entities[a]
    return next(f for f in RELATIONS[e.kind] if e.rels[f] == b)


def sample_chain(world: World, r: random.Random, hops: int, recap: bool) -> Task:
    for _ in range(200):
        anchor = r.choice(world.by_kind[r.choice(["person", "person", "company", "city", "university"])])
        docs = _walk(world, r, anchor, hops - 1)
        if docs is None:
            continue
        path = [Hop(a, _rel_between(world, a, b)) for a, b in zip(docs, docs[1:], strict=False)]
        last = world.entities[docs[-1]]
        subject = phrase(world, path) if path else last.name
        if r.random() < 0.25:  # final fact is itself a relation: the answer is a name
            fact = r.choice(sorted(RELATIONS[last.kind]))
            question = f"Who is {REL_PHRASE[fact].format(x=subject)}?" if _rel_kind(last.kind, fact) == "person" \
                else f"What is {REL_PHRASE[fact].format(x=subject)}?"
        else:
            fact = r.choice(sorted(NUMERIC[last.kind]))
            question = _NUMERIC_Q[(last.kind, fact)].format(x=subject)
        question = question[0].upper() + question[1:]
        path.append(Hop(last.doc_id, fact))
        return Task("chain", question, world.fact_value(last.doc_id, fact), [path], recap)
    raise RuntimeError(f"could not sample a {hops}-hop chain in the {world.split} world")


def _rel_kind(kind: str, fact: str) -> str:
    return RELATIONS[kind][fact]


def sample_compare(world: World, r: random.Random, hops: int, recap: bool) -> Task:
    if hops % 2 or hops < 2:
        raise ValueError(f"compare tasks need an even number of hops >= 2, got {hops}")
    relations = hops // 2 - 1
    for _ in range(200):
        kind = r.choice(["person", "company", "city", "university"])
        a, b = r.sample(world.by_kind[kind], 2)
        da = _walk(world, r, a, relations)
        if da is None:
            continue
        facts = [_rel_between(world, x, y) for x, y in zip(da, da[1:], strict=False)]
        db = [b]
        for f in facts:  # follow the same relations from b
            db.append(world.entities[db[-1]].rels[f])
        end_kind = world.entities[da[-1]].kind
        fact = r.choice(sorted(NUMERIC[end_kind]))
        ea, eb = world.entities[da[-1]], world.entities[db[-1]]
        if len(set(da + db)) < len(da) + len(db) or ea.attrs[fact] == eb.attrs[fact]:
            continue
        q, direction, _ = _COMPARE_Q[(end_kind, fact)]
        pa = [Hop(x, f) for x, f in zip(da, facts, strict=False)]
        pb = [Hop(x, f) for x, f in zip(db, facts, strict=False)]
        sa = phrase(world, pa) if pa else ea.name
        sb = phrase(world, pb) if pb else eb.name
        wins_a = (ea.attrs[fact] < eb.attrs[fact]) == (direction == "min")
        question = q.format(a=sa, b=sb)
        pa.append(Hop(da[-1], fact))
        pb.append(Hop(db[-1], fact))
        return Task("compare", question, (ea if wins_a else eb).name, [pa, pb], recap)
    raise RuntimeError(f"could not sample a {hops}-hop comparison in the {world.split} world")


def compare_verdict(kind: str, fact: str) -> str:
    return _COMPARE_Q[(kind, fact)][2]


RECAP_REQUEST = " In your final answer, restate every fact you found on the way."


def sample_task(world: World, r: random.Random, min_hops: int, max_hops: int, compare_rate: float,
                recap_rate: float) -> Task:
    if not 2 <= min_hops <= max_hops:
        raise ValueError(f"need 2 <= min_hops <= max_hops, got {min_hops}..{max_hops}")
    hops = r.randint(min_hops, max_hops)
    recap = r.random() < recap_rate
    if hops % 2 == 0 and r.random() < compare_rate:
        task = sample_compare(world, r, hops, recap)
    else:
        task = sample_chain(world, r, hops, recap)
    if recap:  # the user asks for it, so whether early pages are read again is visible in the context
        task.question += RECAP_REQUEST
    return task


def check_answer(task_answer: str, text: str) -> bool:
    """The final answer line of `text` equals the task's answer (case and punctuation insensitive)."""
    marker = "Final answer:"
    if marker not in text:
        return False
    got = text.rsplit(marker, 1)[1].strip().splitlines()[0] if text.rsplit(marker, 1)[1].strip() else ""
    norm = lambda s: " ".join("".join(c.lower() if c.isalnum() else " " for c in s).split())  # noqa: E731
    return norm(got) == norm(task_answer)
