"""A fictional, deterministic world: people, companies, cities and universities linked by relations.

One world per dataset split, generated together so that no entity name is shared between splits (split
disjointness by construction). Every entity has one document; a document's text is built lazily from a seed, so a
world of thousands of documents costs milliseconds until it is read. Some entities have a near-duplicate *twin*
(one vowel changed) — a real, separate entity that the search tool ranks as high as the original: the distractor
an agent may open by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kvsteward.synth.rng import mix, rng

SPLITS = ("train", "validation", "test")
SPLIT_TAG = {"train": "tr", "validation": "va", "test": "te"}
KINDS = ("person", "company", "city", "university")
_KIND_SHARE = {"person": 0.5, "company": 0.22, "city": 0.16, "university": 0.12}

# Relations: field -> target kind. Attributes: field -> (low, high) integer range, or a vocabulary name.
RELATIONS = {
    "person": {"employer": "company", "birthplace": "city", "alma_mater": "university", "mentor": "person"},
    "company": {"headquarters": "city", "founder": "person", "ceo": "person"},
    "city": {"mayor": "person"},
    "university": {"location": "city", "rector": "person"},
}
NUMERIC = {
    "person": {"birth_year": (1931, 1999)},
    "company": {"founded_year": (1851, 2015), "employees": (40, 90000)},
    "city": {"population": (2000, 900000), "founded_year": (1102, 1890)},
    "university": {"founded_year": (1405, 1990), "students": (800, 60000)},
}
DESCRIPTOR = {"person": "occupation", "company": "industry", "city": "region", "university": "character"}

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m", "n", "p", "pr", "r", "s",
           "st", "t", "tr", "v", "w", "z", "th", "sh", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "x", "v", "ll"]
_COMPANY_SUFFIX = ["Systems", "Labs", "Works", "Holdings", "Foundry", "Group", "Industries", "Dynamics", "Partners",
                   "Logistics", "Analytics", "Textiles", "Motors", "Press"]
_UNIVERSITY_SUFFIX = ["University", "Institute", "College", "Polytechnic", "Academy"]
_VOCAB = {
    "occupation": ["cartographer", "engineer", "economist", "botanist", "architect", "historian", "chemist",
                   "surveyor", "luthier", "translator", "geologist", "actuary", "editor", "pilot", "archivist"],
    "industry": ["shipping", "textiles", "optics", "agriculture", "software", "mining", "publishing", "ceramics",
                 "logistics", "biotech", "aviation", "insurance"],
    "region": ["the northern coast", "the lake district", "the eastern plateau", "the river delta",
               "the southern hills", "the western marches", "the central valley"],
    "character": ["public research university", "technical institute", "liberal arts college",
                  "maritime academy", "agricultural college"],
}

# Fact sentences (two phrasings each); {n} is the entity name, {v} the value.
FACT_TEMPLATES = {
    "birth_year": ["{n} was born in {v}.", "Records give {v} as the year {n} was born."],
    "employer": ["{n} works at {v}.", "{n} is employed by {v}."],
    "birthplace": ["{n}'s birthplace is {v}.", "{n} grew up in {v}, where {n} was born."],
    "alma_mater": ["{n} studied at {v}.", "{n} graduated from {v}."],
    "mentor": ["{n} was mentored by {v}.", "Early on, {n} trained under {v}."],
    "occupation": ["{n} is a {v} by profession.", "By trade, {n} is a {v}."],
    "headquarters": ["{n} is headquartered in {v}.", "The head office of {n} is in {v}."],
    "founder": ["{n} was founded by {v}.", "{v} founded {n}."],
    "ceo": ["The chief executive of {n} is {v}.", "{v} serves as chief executive of {n}."],
    "industry": ["{n} operates in {v}.", "The main business of {n} is {v}."],
    "employees": ["{n} employs {v} people.", "The workforce of {n} numbers {v}."],
    "mayor": ["The mayor of {n} is {v}.", "{v} serves as mayor of {n}."],
    "population": ["{n} has a population of {v}.", "The last census counted {v} residents in {n}."],
    "region": ["{n} lies in {v}.", "{n} is a city in {v}."],
    "location": ["{n} is located in {v}.", "The campus of {n} is in {v}."],
    "rector": ["The rector of {n} is {v}.", "{v} leads {n} as rector."],
    "students": ["{n} enrolls {v} students.", "About {v} students attend {n}."],
    "character": ["{n} is a {v}.", "{n} describes itself as a {v}."],
}
_FOUNDED = {"company": ["{n} was established in {v}.", "{n} opened for business in {v}."],
            "city": ["{n} was settled in {v}.", "The first settlers reached {n} in {v}."],
            "university": ["{n} opened its doors in {v}.", "{n} admitted its first students in {v}."]}

_FILLER_SUBJ = ["The archive", "The council record", "A local guide", "An old survey", "The annual report",
                "A visiting critic", "A regional paper", "One profile", "A later review", "The yearbook"]
_FILLER_VERB = ["describes", "mentions", "praises", "questions", "recalls", "compares", "documents", "lists"]
_FILLER_ADJ = ["quiet", "ambitious", "unusual", "modest", "celebrated", "overlooked", "careful", "long", "early",
               "disputed", "seasonal", "formal"]
_FILLER_NOUN = ["exhibition", "partnership", "renovation", "expedition", "lecture series", "archive project",
                "harvest fair", "rail link", "workshop", "festival", "charter", "committee", "garden", "bridge"]
_FILLER_TAIL = ["in some detail", "without giving dates", "as a turning point", "among other things",
                "with evident pride", "in a footnote", "at length", "only briefly"]


@dataclass
class Entity:
    doc_id: str
    kind: str
    name: str
    attrs: dict[str, int | str] = field(default_factory=dict)
    rels: dict[str, str] = field(default_factory=dict)  # field -> doc_id
    twin_of: str | None = None


@dataclass
class Document:
    """A document: title plus sentences; `fact_at[field]` is the sentence index holding that field."""

    doc_id: str
    title: str
    sentences: list[str]
    fact_at: dict[str, int]

    def pages(self, page_words: int) -> list[tuple[int, int]]:
        """Half-open sentence ranges of each page (pages break at sentence ends, ~page_words words each)."""
        if page_words <= 0:
            raise ValueError(f"page_words must be positive, got {page_words}")
        ranges, start, words = [], 0, 0
        for i, s in enumerate(self.sentences):
            words += len(s.split())
            if words >= page_words:
                ranges.append((start, i + 1))
                start, words = i + 1, 0
        if start < len(self.sentences) or not ranges:
            ranges.append((start, len(self.sentences)))
        return ranges

    def page_of(self, fact: str, page_words: int) -> int:
        """1-based page holding `fact`."""
        idx = self.fact_at[fact]
        for p, (a, b) in enumerate(self.pages(page_words), start=1):
            if a <= idx < b:
                return p
        raise AssertionError("unreachable: every sentence is on a page")

    def page_text(self, page: int, page_words: int) -> str:
        ranges = self.pages(page_words)
        if not 1 <= page <= len(ranges):
            raise ValueError(f"{self.doc_id} has {len(ranges)} page(s); page {page} does not exist")
        a, b = ranges[page - 1]
        return " ".join(self.sentences[a:b])


@dataclass
class SearchHit:
    rank: int
    doc_id: str
    name: str
    snippet: str


class World:
    """One split's world. Build all three with `build_worlds` (they share a name registry)."""

    def __init__(self, split: str, seed: int, entities: list[Entity], doc_words: int):
        self.split, self.seed, self.doc_words = split, seed, doc_words
        self.entities = {e.doc_id: e for e in entities}
        self.by_kind = {k: [e.doc_id for e in entities if e.kind == k] for k in KINDS}
        self._docs: dict[str, Document] = {}

    def name(self, doc_id: str) -> str:
        return self.entities[doc_id].name

    def fact_value(self, doc_id: str, fact: str) -> str:
        """The value of a fact as written in documents (relation targets by name)."""
        e = self.entities[doc_id]
        if fact in e.rels:
            return self.name(e.rels[fact])
        return str(e.attrs[fact])

    def fact_sentence(self, doc_id: str, fact: str) -> str:
        d = self.document(doc_id)
        return d.sentences[d.fact_at[fact]]

    def document(self, doc_id: str) -> Document:
        if doc_id not in self._docs:
            if doc_id not in self.entities:
                raise KeyError(f"no document {doc_id!r} in the {self.split} world")
            self._docs[doc_id] = self._build_document(self.entities[doc_id])
        return self._docs[doc_id]

    def _build_document(self, e: Entity) -> Document:
        r = rng(self.seed, "doc", e.doc_id)
        facts = []
        for f in list(e.rels) + list(e.attrs):
            templates = _FOUNDED[e.kind] if f == "founded_year" else FACT_TEMPLATES[f]
            facts.append((f, r.choice(templates).format(n=e.name, v=self.fact_value(e.doc_id, f))))
        target = max(len(facts) * 8, int(self.doc_words * r.uniform(0.6, 1.4)))
        filler = []
        words = sum(len(s.split()) for _, s in facts)
        while words < target:
            s = _filler_sentence(r, e.name)
            filler.append(s)
            words += len(s.split())
        # Fact sentences land at random places among the filler, so some facts sit on later pages.
        slots = sorted(r.sample(range(len(filler) + len(facts)), len(facts)))
        r.shuffle(facts)
        sentences, fact_at, fi, it = [], {}, iter(filler), iter(facts)
        for i in range(len(filler) + len(facts)):
            if slots and i == slots[0]:
                slots.pop(0)
                f, s = next(it)
                fact_at[f] = i
                sentences.append(s)
            else:
                sentences.append(next(fi))
        return Document(e.doc_id, f"{e.name} ({e.kind})", sentences, fact_at)

    def snippet(self, doc_id: str) -> str:
        e = self.entities[doc_id]
        return f"{e.kind}, {e.attrs[DESCRIPTOR[e.kind]]}"

    @cached_property
    def _index(self) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
        exact: dict[str, set[str]] = {}
        fuzzy: dict[str, set[str]] = {}
        for e in self.entities.values():
            for tok in _tokens(e.name):
                exact.setdefault(tok, set()).add(e.doc_id)
                for key in _deletions(tok):
                    fuzzy.setdefault(key, set()).add(e.doc_id)
        return exact, fuzzy

    def search(self, query: str, top_k: int = 5) -> list[SearchHit]:
        """Rank documents by name-token matches; a token one edit away counts like an exact one (so near-duplicate
        names tie with the original), ties broken by a stable hash of (query, doc). A query in double quotes
        matches the exact full name only."""
        q = query.strip()
        if len(q) >= 2 and q[0] == q[-1] == '"':
            want = q[1:-1].strip().lower()
            hits = sorted(d for d, e in self.entities.items() if e.name.lower() == want)
            return [SearchHit(i + 1, d, self.name(d), self.snippet(d)) for i, d in enumerate(hits[:top_k])]
        exact, fuzzy = self._index
        scores: dict[str, float] = {}
        for tok in set(_tokens(q)):
            matched = set(exact.get(tok, ()))
            for key in _deletions(tok):
                for d in fuzzy.get(key, ()):
                    if d not in matched and any(_one_edit(tok, t) for t in _tokens(self.name(d))):
                        matched.add(d)
            for d in matched:
                scores[d] = scores.get(d, 0.0) + 1.0
        ranked = sorted(scores, key=lambda d: (-scores[d], rng(query, d).random()))
        return [SearchHit(i + 1, d, self.name(d), self.snippet(d)) for i, d in enumerate(ranked[:top_k])]


def _tokens(text: str) -> list[str]:
    return [t for t in "".join(c.lower() if c.isalnum() else " " for c in text).split() if t]


def _deletions(tok: str) -> set[str]:
    return {tok} | {tok[:i] + tok[i + 1:] for i in range(len(tok))}


def _one_edit(a: str, b: str) -> bool:
    """Exactly one substitution, insertion or deletion apart."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def _filler_sentence(r, name: str) -> str:
    subj = r.choice(_FILLER_SUBJ)
    obj = f"the {r.choice(_FILLER_ADJ)} {r.choice(_FILLER_NOUN)}"
    if r.random() < 0.3:
        return f"{subj} {r.choice(_FILLER_VERB)} {obj} linked to {name} {r.choice(_FILLER_TAIL)}."
    return f"{subj} {r.choice(_FILLER_VERB)} {obj} {r.choice(_FILLER_TAIL)}."


def _word(r, syllables: int) -> str:
    return "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables)).capitalize()


def _twin_name(r, name: str) -> str:
    """Change one vowel in the last word: a near-duplicate name one edit away."""
    words = name.split()
    i = len(words) - 1 if words[-1] not in _COMPANY_SUFFIX + _UNIVERSITY_SUFFIX else 0
    w = words[i]
    spots = [j for j, c in enumerate(w) if c.lower() in "aeiou"]
    j = r.choice(spots) if spots else len(w) - 1
    repl = r.choice([v for v in "aeiou" if v != w[j].lower()])
    words[i] = w[:j] + (repl.upper() if j == 0 else repl) + w[j + 1:]
    return " ".join(words)


class _Names:
    """Unique-name registry shared by all splits' worlds."""

    def __init__(self, r):
        self.r, self.taken = r, set()
        self.first = sorted({_word(r, r.choice([1, 2])) for _ in range(400)})
        self.last = sorted({_word(r, r.choice([2, 2, 3])) for _ in range(900)})

    def _claim(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.taken:
                self.taken.add(name)
                return name
        raise RuntimeError("name space exhausted: reduce --world-size")

    def new(self, kind: str) -> str:
        r = self.r
        if kind == "person":
            return self._claim(lambda: f"{r.choice(self.first)} {r.choice(self.last)}")
        if kind == "company":
            return self._claim(lambda: f"{_word(r, r.choice([2, 3]))} {r.choice(_COMPANY_SUFFIX)}")
        if kind == "city":
            return self._claim(lambda: _word(r, r.choice([2, 3])))
        return self._claim(lambda: f"{_word(r, 2)} {r.choice(_UNIVERSITY_SUFFIX)}")

    def twin(self, name: str) -> str | None:
        for _ in range(20):
            t = _twin_name(self.r, name)
            if t not in self.taken:
                self.taken.add(t)
                return t
        return None


def build_worlds(seed: int, world_size: int = 2000, twin_rate: float = 0.3, doc_words: int = 300,
                 splits: tuple[str, ...] = SPLITS) -> dict[str, World]:
    """One world per split, `world_size` documents each, no entity name shared between them."""
    if world_size < 40:
        raise ValueError(f"world_size must be at least 40 documents, got {world_size}")
    if not 0 <= twin_rate <= 1:
        raise ValueError(f"twin_rate must be in [0, 1], got {twin_rate}")
    names = _Names(rng(seed, "names"))
    return {s: _build_world(s, mix_seed(seed, s), world_size, twin_rate, doc_words, names) for s in splits}


def mix_seed(seed: int, split: str) -> int:
    return mix(seed, "world", split)


def _build_world(split: str, seed: int, size: int, twin_rate: float, doc_words: int, names: _Names) -> World:
    r = rng(seed, "entities")
    tag = SPLIT_TAG.get(split, split[:2])
    counts = {k: max(4, int(size * _KIND_SHARE[k])) for k in KINDS}
    entities: list[Entity] = []
    for kind in KINDS:
        n_orig = max(2, round(counts[kind] / (1 + twin_rate))) if kind in ("person", "company") else counts[kind]
        made = 0
        while made < counts[kind]:
            e = Entity(f"{tag}{len(entities):05d}", kind, names.new(kind))
            entities.append(e)
            made += 1
            if kind in ("person", "company") and made < counts[kind] and made <= n_orig and r.random() < twin_rate:
                twin = names.twin(e.name)
                if twin:
                    entities.append(Entity(f"{tag}{len(entities):05d}", kind, twin, twin_of=e.doc_id))
                    made += 1
    by_kind = {k: [e.doc_id for e in entities if e.kind == k] for k in KINDS}
    for e in entities:
        for f, target_kind in RELATIONS[e.kind].items():
            choices = [d for d in by_kind[target_kind] if d != e.doc_id]
            e.rels[f] = r.choice(choices)
        for f, (lo, hi) in NUMERIC[e.kind].items():
            e.attrs[f] = r.randint(lo, hi)
        e.attrs[DESCRIPTOR[e.kind]] = r.choice(_VOCAB[DESCRIPTOR[e.kind]])
    return World(split, seed, entities, doc_words)
