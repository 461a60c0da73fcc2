"""A small stochastic grammar for agent text: many phrasings per act, and notes that carry no label.

A generator that writes one sentence per act lets a text classifier read the hindsight label off the note after each
tool response (the templated research generator: `steward synth audit` scores a bag-of-words classifier F1 ~1.0
there). Environments write their agent text through these helpers instead:

- `say(r, templates, **slots)`: one phrasing of an act, drawn from a list (templates use `str.format` slots);
- `note(r, informative, style)`: what the agent writes after reading a response, drawn *independently of whether
  the response is needed later*: the informative sentence the act calls for (often itself one of several
  phrasings), a neutral acknowledgement ("ok, noted"), or a relevance claim drawn at random ("this may matter
  later", "nothing useful here"), which is as often wrong as right;
- `NoteStyle`: the rates of the three, per trace (`NoteStyle.draw`), so traces differ in how much their agent says.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

NEUTRAL = (
    "Noted.", "OK, noted.", "Got it.", "Okay.", "Alright.", "Continuing.", "Next.", "Moving on.", "Let me keep going.",
    "Fine.", "Right.", "Understood.", "Okay, next step.", "Let me continue.", "Good.", "Checked.", "Seen.",
    "One more call.", "Proceeding.", "Makes sense.",
)
# Relevance claims: drawn at random, never from the truth, so they mislead as often as they help.
CLAIMS = (
    "This may matter later.", "I'll keep this in mind.", "Worth remembering.", "Not important.",
    "Nothing useful here.", "Probably irrelevant.", "Could be useful.", "Keep this handy.", "That settles this part.",
    "I won't need this again.", "Might come back to this.", "Not much here.",
)


@dataclass(frozen=True)
class NoteStyle:
    """Rates of the note kinds after a response: informative, neutral, a random claim (the rest of the mass goes
    to informative). Drawn once per trace."""

    neutral: float = 0.4
    claim: float = 0.15

    @staticmethod
    def draw(r: random.Random) -> NoteStyle:
        neutral = r.choice((0.2, 0.35, 0.5, 0.65))
        return NoteStyle(neutral=neutral, claim=r.choice((0.0, 0.1, 0.2)))


def say(r: random.Random, templates: Sequence[str], **slots: object) -> str:
    """One phrasing of an act: a template drawn from `templates`, filled with `slots`."""
    return r.choice(list(templates)).format(**slots)


def note(r: random.Random, informative: str, style: NoteStyle) -> str:
    """The agent's note after reading a response: `informative`, a neutral acknowledgement or a random relevance
    claim, by `style`'s rates — never by whether the response is needed later."""
    x = r.random()
    if x < style.neutral:
        return r.choice(NEUTRAL)
    if x < style.neutral + style.claim:
        return r.choice(CLAIMS)
    return informative


def join(*parts: str) -> str:
    """Sentences joined by one space, empty parts left out."""
    return " ".join(p.strip() for p in parts if p and p.strip())
