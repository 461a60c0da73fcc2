"""Prose filler for long sessions (the operations domain): ~2,000-token chunks of the local Python's own
documentation text — the reference manual's topics (`pydoc_data.topics`, what `help("assignment")` prints) and the
standard library's docstrings (module, class and function docstrings of each non-test stdlib file, read with `ast`,
nothing imported).

A document is one reference topic or one stdlib file's docstrings (each headed by its qualified name); a chunk is a
run of whole lines of one document. Chunks that mention a session's secret (as a whole word, case-insensitive), a
Markdown fence or a special token are skipped. The document order depends only on the seed.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from kvsteward.synth.longsession.stdlib_filler import Chunk, _chunks_of_file, stdlib_files

MIN_DOC_CHARS = 1500  # a stdlib file with less docstring text than this is not a document


def reference_topics() -> dict[str, str]:
    """The reference manual's topics as plain text, by topic name."""
    from pydoc_data.topics import topics

    return dict(topics)


def docstrings_of(source: str) -> str:
    """The docstrings of a module's source (module first, then classes and functions in source order), each
    headed by its qualified name; '' if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(doc)

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc and not child.name.startswith("_"):
                    parts.append(f"{name}:\n{doc}")
                walk(child, name + ".")

    walk(tree, "")
    return "\n\n".join(parts)


def _documents(seed: int, root: str) -> Iterator[tuple[str, str]]:
    topics = reference_topics()
    names = [f"reference/{t}" for t in sorted(topics)] + list(stdlib_files(root))
    random.Random(f"longsession-prose:{seed}").shuffle(names)
    for name in names:
        if name.startswith("reference/"):
            yield name, topics[name.removeprefix("reference/")]
            continue
        try:
            text = docstrings_of((Path(root) / name).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= MIN_DOC_CHARS:
            yield name, text


def prose_stream(tokenizer, seed: int, secrets: list[str], chunk_tokens: int = 2000, max_chunks_per_doc: int = 3,
                 root: str | None = None) -> Iterator[Chunk]:
    """Chunks in seed order, none containing a secret (whole word, case-insensitive) or a special token."""
    root = root or sysconfig.get_paths()["stdlib"]
    words = [re.escape(s) for s in secrets if s]
    banned = re.compile(r"(?<![\w.-])(" + "|".join(words) + r")(?![\w-])", re.IGNORECASE) if words else None
    special = [t for t in tokenizer.all_special_tokens if t]
    for name, text in _documents(seed, root):
        for chunk in _chunks_of_file(tokenizer, name, text, chunk_tokens, max_chunks_per_doc):
            body = chunk.text
            if (body.strip() and "```" not in body and not any(t in body for t in special)
                    and (banned is None or banned.search(body) is None)):
                yield chunk
    raise RuntimeError(f"the documentation under {root} ran out of prose chunks: ask for a shorter session")
