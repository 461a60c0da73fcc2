"""Planners for the long-session benchmark: which context messages each probe reads, made without the oracle.

PACE's planner sends the engine a blueprint: earlier message spans and the future steps that will read them. Here
a planner sees what PACE's planner sees — the session's context messages and the probes' text (each probe's
messages and answer prefix: the plan of future steps) — and names, per probe, the context messages it reads. It
never sees the session's `regions`, `needs` or `facts` (the generator's record, which the oracle plan is made of).
The plan is made once, before the session is played (a static plan, like PACE's LLM planner).

- `oracle`: the generator's record (`needs` → the messages holding those regions): what every oracle run uses.
- `previous`: the ReAct structural prior — a probe reads the context message right before the probes.
- `lexical`: no model. TF-IDF retrieval over the context messages (scikit-learn): a probe reads every message at
  least `ratio` × as similar to its text as the most similar one. `LEXICAL_RATIO` (0.7) is the best edge F1 on
  seed 7's sessions (8K and 32K), chosen before any accuracy run.
- `llm`: a model (local, greedy, or any OpenAI-compatible endpoint: `synth.traces.planner`'s completers) is shown every
  context message clipped to `message_chars` and the probe's text, and replies with message numbers.

`blueprint_of` turns reads into the engine's blueprint at message granularity (the same form as the oracle's
`--blueprint messages`), and `score` gives edge recall and precision against the oracle's reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvsteward.synth.longsession.schema import Probe, Session
from kvsteward.synth.traces.planner import Complete, Tally, _clip, parse_cursor_ids

# probe id -> context message indices it reads
Reads = dict[str, list[int]]
PLANNERS = ("oracle", "previous", "lexical", "llm")
LEXICAL_RATIO = 0.7

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
# Question words and chat filler: present in every probe, never what a probe is about.
_STOP = frozenset("""
the and for with that this what which who whom whose when where why how does did our your you are was were have has
had just reply line code write before after now next then from into only one all each every give gave given
value values keep kept use used using make made sure please quick check exactly inside also same them they their
its it's let here there about again can could should would will shall any some more most other than very
""".split())


def probe_text(probe: Probe) -> str:
    """What a planner may read of a probe: its messages and the answer prefix (the future step's own text)."""
    return "\n".join(m.content for m in probe.messages) + "\n" + probe.answer_prefix


def context_messages(sess: Session) -> list[int]:
    """Messages a plan can name: every context message but the system prompt (which no eviction touches)."""
    return [i for i, m in enumerate(sess.messages) if m.role != "system"]


def oracle_reads(sess: Session) -> Reads:
    """The generator's record: a probe reads the messages holding the regions it needs."""
    where = {r.key: r.message for r in sess.regions}
    return {p.id: sorted({where[k] for k in p.needs}) for p in sess.probes if p.needs}


def previous_reads(sess: Session) -> Reads:
    last = context_messages(sess)[-1:]
    return {p.id: list(last) for p in sess.probes}


def lexical_reads(sess: Session, ratio: float = LEXICAL_RATIO) -> Reads:
    """TF-IDF retrieval (scikit-learn): a probe reads every context message whose cosine similarity to the probe's
    text is at least `ratio` × the most similar message's. Identifiers of ≥ 3 characters, sublinear term frequency
    (a 2,000-token source file does not outvote a short definition by length), IDF over the session's context."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    if not 0 < ratio <= 1:
        raise ValueError(f"lexical planner ratio must be in (0, 1], got {ratio}")
    cands = context_messages(sess)
    if not cands:
        return {}
    vec = TfidfVectorizer(token_pattern=_IDENT.pattern, stop_words=sorted(_STOP), sublinear_tf=True)
    try:
        docs = vec.fit_transform([sess.messages[i].content for i in cands])
    except ValueError:  # no identifier in any message: nothing to match
        return {}
    out: Reads = {}
    for p in sess.probes:
        sims = cosine_similarity(vec.transform([probe_text(p)]), docs)[0]
        best = float(sims.max())
        if best > 0:
            out[p.id] = [i for i, s in zip(cands, sims, strict=True) if s >= ratio * best]
    return out


@dataclass
class LLMSessionPlanner:
    """Asks a model, once per probe, which context messages the probe needs."""

    complete: Complete
    name: str = "llm"
    message_chars: int = 200

    def prompt(self, sess: Session, probe: Probe) -> tuple[list[dict[str, str]], list[int]]:
        cands = context_messages(sess)
        listing = "\n".join(f"[message {i}] {_clip(sess.messages[i].content, self.message_chars)}" for i in cands)
        user = (f"Conversation so far:\n{listing}\n\nA later question:\n{_clip(probe_text(probe), 400)}\n\n"
                "Which earlier messages does the answer need? Reply with the message numbers only, separated by "
                "commas.")
        system = "You read a long conversation and name the earlier messages that a later question needs."
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], cands

    def reads(self, sess: Session, on_probe: Callable[[], None] | None = None) -> tuple[Reads, int]:
        """(reads, parse failures = replies naming no valid message)."""
        out: Reads = {}
        failures = 0
        for p in sess.probes:
            msgs, cands = self.prompt(sess, p)
            got = parse_cursor_ids(self.complete(msgs, "The answer needs message"), cands)
            if got:
                out[p.id] = got
            else:
                failures += 1
            if on_probe:
                on_probe()
        return out, failures


def blueprint_of(sess: Session, reads: Reads) -> list[dict]:
    """The engine blueprint of `reads`: each read message's whole token span, its readers the probe steps (question
    and answer) of every probe that reads it. Requires the session's layout."""
    if sess.layout is None:
        raise ValueError(f"session {sess.id!r} has no token layout (read it with a tokenizer)")
    offsets = sess.layout.message_offsets
    probes = {p.id: p for p in sess.probes}
    readers: dict[int, set[int]] = {}
    for pid, msgs in reads.items():
        if pid not in probes:
            raise ValueError(f"session {sess.id!r}: the plan names unknown probe {pid!r}")
        p = probes[pid]
        for m in msgs:
            if not 0 <= m < len(sess.messages):
                raise ValueError(f"session {sess.id!r}: the plan names message {m}, outside the context")
            readers.setdefault(m, set()).update(range(p.step, p.step + len(p.messages) + 1))
    return [{"span": [offsets[m], offsets[m + 1]], "readers": sorted(r)} for m, r in sorted(readers.items())]


def edges(reads: Reads) -> set[tuple[str, int]]:
    return {(pid, m) for pid, ms in reads.items() for m in ms}


def score(sessions: list[Session], predicted: list[Reads]) -> dict[str, float | int]:
    """Edge recall / precision of (probe, message) pairs against the oracle's, over all probes and over the fact
    probes alone (the ones forced-prefix accuracy counts), and the planned tokens per session."""
    every, facts = Tally(), Tally()
    planned = 0
    for sess, reads in zip(sessions, predicted, strict=True):
        kind = {p.id: p.kind for p in sess.probes}
        pred, gold = edges(reads), edges(oracle_reads(sess))
        every.add(pred, gold)
        facts.add({e for e in pred if kind[e[0]] == "fact"}, {e for e in gold if kind[e[0]] == "fact"})
        planned += sum(e - s for s, e in (b["span"] for b in blueprint_of(sess, reads)))
    return {"edge_recall": every.recall, "edge_precision": every.precision,
            "fact_edge_recall": facts.recall, "fact_edge_precision": facts.precision,
            "oracle_edges": every.tp + every.fn, "predicted_edges": every.tp + every.fp,
            "planned_tokens_mean": planned / max(len(sessions), 1)}


def plan_sessions(sessions: list[Session], planner: str, llm: LLMSessionPlanner | None = None,
                  ratio: float = LEXICAL_RATIO,
                  on_session: Callable[[], None] | None = None) -> tuple[list[Reads], int]:
    """Every session's reads by `planner` (`llm` needs `llm`); returns (reads, LLM parse failures)."""
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; known: {', '.join(PLANNERS)}")
    if planner == "llm" and llm is None:
        raise ValueError("the llm planner needs a model (LLMSessionPlanner)")
    out, failures = [], 0
    for sess in sessions:
        if planner == "oracle":
            reads = oracle_reads(sess)
        elif planner == "previous":
            reads = previous_reads(sess)
        elif planner == "lexical":
            reads = lexical_reads(sess, ratio)
        else:
            reads, f = llm.reads(sess)
            failures += f
        out.append(reads)
        if on_session:
            on_session()
    return out, failures
