"""Structural features of a deletion decision: how a tool response sits in the agent's visible progress.

The `structure` baseline (`synth.traces.baselines.StructureClassifier`) scores decisions from these numbers alone. They
name no tool, environment or template word, so the same features exist in every environment:

- where the response is: agent steps since it, its recency rank, how many read responses are open, its relative
  position, its length;
- the identifiers it introduced (tokens like `O-2124`, `KB-7546` or numbers of 3+ digits not visible before it):
  how many, the share a later agent message names (a pointer followed), how many no later agent message names
  (a pointer still pending), whether its first identifier is named after it, how many later messages name one of
  its identifiers and how many agent steps ago the last of them did;
- what it shares with the rest: identifiers and content words (4+ letters) shared with the task, the most and the
  total content words shared with another open response, the content words later agent messages repeat.

Only what a manager sees is read: the non-tool messages before the boundary and the open tool responses (a deleted
response, masked in a dataset row or dropped in a replay, contributes nothing).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from kvsteward.synth.traces.toolcall import cursor_body

FEATURES = ("log_steps_since", "recency", "n_read", "rel_pos", "log_len", "n_new_ids", "frac_new_followed",
            "n_new_pending", "has_new_ids", "n_task_ids", "n_task_words", "max_response_words",
            "sum_response_words", "n_later_agent_words", "last_mention_age", "n_later_mentions", "own_id_later")

_ID = re.compile(r"\b[A-Za-z]{1,4}-\d+\b|\b\d{3,}\b")
_WORD = re.compile(r"[a-z]{4,}")
_STOP = frozenset("that this with from have will your what when which there their about into than then them they "
                  "were been only also more most such some".split())


def identifiers(text: str) -> set[str]:
    return set(_ID.findall(text))


def content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP}


def _visible_text(message: dict, open_set: set[int], index: int) -> str | None:
    """The text a manager sees of message `index` (a tool response only while open, without its tag)."""
    if message.get("role") == "tool":
        return cursor_body(message.get("content") or "") if index in open_set else None
    return message.get("content") or ""


def structure_features(seen: list[dict], open_cursors: Iterable[int], read: list[int], task: str,
                       steps_since: dict[int, int]) -> dict[int, tuple[float, ...]]:
    """The `FEATURES` of each decision at boundary len(seen) (`seen` indexed as the cursor ids; `read` the read open
    cursors, oldest first; `steps_since[c]` agent messages after cursor c)."""
    open_set = set(open_cursors)
    texts = [_visible_text(m, open_set, i) for i, m in enumerate(seen)]
    words = {c: content_words(texts[c] or "") for c in open_set if c < len(seen)}
    task_ids, task_words = identifiers(task), content_words(task)
    out = {}
    for rank, cursor in enumerate(reversed(read)):
        body = texts[cursor] or ""
        ids = identifiers(body)
        new = ids - identifiers(" ".join(t for t in texts[:cursor] if t))
        later = [(seen[i].get("role"), texts[i]) for i in range(cursor + 1, len(seen)) if texts[i]]
        agent_later = [t for role, t in later if role == "assistant"]
        followed = sum(1 for i in new if any(i in t for t in agent_later))
        shared = [len(words[cursor] & w) for c, w in words.items() if c != cursor]
        mention_age, mentions, steps = steps_since[cursor], 0, 0
        for role, text in reversed(later):
            steps += role == "assistant"
            if ids and any(i in text for i in ids):
                mentions += 1
                mention_age = min(mention_age, steps)
        own = min(ids, key=body.find) if ids else None
        out[cursor] = (
            math.log1p(steps_since[cursor]), float(rank), float(len(read)), cursor / max(len(seen), 1),
            math.log1p(len(body.split())), float(len(new)), followed / len(new) if new else 0.0,
            float(len(new) - followed), float(bool(new)), float(len(ids & task_ids)),
            float(len(words[cursor] & task_words)), float(max(shared, default=0)), float(sum(shared)),
            float(len(words[cursor] & content_words(" ".join(agent_later)))), float(mention_age), float(mentions),
            float(own is not None and any(own in t for _, t in later)))
    return out
