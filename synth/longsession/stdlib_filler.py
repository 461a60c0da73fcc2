"""Filler for long sessions: ~2,000-token chunks of the local Python standard library's own source.

Real code, never the stdlib's tests (`test/`, `tests/`, `idle_test/`, `test_*.py`, `*_tests.py`, ...), never
third-party packages. A chunk is a run of whole lines from one file. Chunks that mention any of a session's secrets,
any `decimal` rounding-mode name, a Markdown fence or a special token are skipped, so the session's facts appear
only in its definitions. The order of files and chunks depends only on the seed, so the same seed yields the same
filler stream at every distance.
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data"}
# Rounding-mode names would compete with the session's own fee rule; `_pydecimal.py` is full of them.
_ROUNDING_NAME = re.compile(r"ROUND_(HALF_UP|HALF_DOWN|HALF_EVEN|UP|DOWN|CEILING|FLOOR|05UP)", re.IGNORECASE)


def is_test_path(rel: str) -> bool:
    """True for anything under a test folder or named like a test module."""
    parts = Path(rel).parts
    name = parts[-1]
    return (any(p in _EXCLUDED_DIRS or p.startswith("test_") for p in parts[:-1])
            or name.startswith("test_") or name == "test.py" or re.search(r"_tests?\.py$", name) is not None)


@lru_cache(maxsize=4)
def stdlib_files(root: str | None = None) -> tuple[str, ...]:
    """Relative paths of the stdlib's non-test `.py` files, sorted (the seed shuffles them)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if name.endswith(".py") and not is_test_path(rel):
                out.append(rel)
    if not out:
        raise FileNotFoundError(f"no Python sources found under the stdlib folder {root}")
    return tuple(sorted(out))


@dataclass(frozen=True)
class Chunk:
    path: str  # relative to the stdlib root
    first_line: int  # 1-based
    lines: tuple[str, ...]  # without trailing newlines

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def head(self, n: int) -> Chunk:
        return Chunk(self.path, self.first_line, self.lines[:n])

    def tail(self, n: int) -> Chunk:
        return Chunk(self.path, self.first_line + n, self.lines[n:])


def _line_token_counts(tokenizer, lines: list[str]) -> list[int]:
    enc = tokenizer([line + "\n" for line in lines], add_special_tokens=False)["input_ids"]
    return [len(ids) for ids in enc]


def _chunks_of_file(tokenizer, rel: str, text: str, chunk_tokens: int, max_chunks: int) -> Iterator[Chunk]:
    lines = text.rstrip().splitlines()
    if not lines:
        return
    counts = _line_token_counts(tokenizer, lines)
    start, total = 0, 0
    emitted = 0
    for i, n in enumerate(counts):
        total += n
        if total >= chunk_tokens:
            yield Chunk(rel, start + 1, tuple(lines[start:i + 1]))
            emitted += 1
            if emitted == max_chunks:
                return
            start, total = i + 1, 0
    if total >= chunk_tokens // 4:  # a short tail is still a reasonable turn; a stub is not
        yield Chunk(rel, start + 1, tuple(lines[start:]))


def _clean(chunk: Chunk, banned: list[str]) -> bool:
    low = chunk.text.casefold()
    return (not any(b in low for b in banned) and "```" not in chunk.text
            and _ROUNDING_NAME.search(chunk.text) is None and chunk.text.strip() != "")


def filler_stream(tokenizer, seed: int, secrets: list[str], chunk_tokens: int = 2000, max_chunks_per_file: int = 3,
                  root: str | None = None) -> Iterator[Chunk]:
    """Chunks in seed order, none containing a secret (case-insensitive) or a special token. Never repeats."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = list(stdlib_files(root))
    random.Random(f"longsession-filler:{seed}").shuffle(files)
    banned = [s.casefold() for s in secrets if s] + [t.casefold() for t in tokenizer.all_special_tokens]
    for rel in files:
        try:
            text = (Path(root) / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for chunk in _chunks_of_file(tokenizer, rel, text, chunk_tokens, max_chunks_per_file):
            if _clean(chunk, banned):
                yield chunk
    raise RuntimeError(f"the stdlib under {root} ran out of filler chunks: ask for a shorter session")
