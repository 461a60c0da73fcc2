"""Stable seeds: Python's `hash()` of a string changes per process, so every derived seed goes through blake2b."""

from __future__ import annotations

import hashlib
import random


def mix(*parts: object) -> int:
    """A 63-bit integer that depends only on `parts` (stable across processes and platforms)."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def rng(*parts: object) -> random.Random:
    return random.Random(mix(*parts))
