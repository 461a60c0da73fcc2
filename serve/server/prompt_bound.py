"""A sound lower bound on a text's token count from its UTF-8 size alone: a prompt whose bytes already prove it is
over `max_prompt_tokens` is refused without tokenizing it (tokenizing megabytes takes seconds of CPU).

Every token of a lossless tokenizer stands for a piece of the input; no piece is longer than `bytes_per_token`, so a
text of b bytes has at least ceil(b / bytes_per_token) tokens. The bound is computed once from the tokenizer's own
description (`tokenizer.json`): the longest vocabulary entry in input bytes (a byte-level BPE writes one input byte
as one character; other vocabularies are counted in UTF-8 bytes, which can only overestimate, e.g. '▁' for a space),
times how much the normalizer can shrink the input. A tokenizer that can swallow input without a token for it
(whitespace-splitting pre-tokenizers, an unknown token standing for a whole word, strip / lowercase / BERT
normalizers) has no such bound: `None`, and such prompts are always tokenized.
"""

from __future__ import annotations

import json

# Unicode normalization shrinks UTF-8 input at most 8x: decomposition never deletes a character (a 4-byte character
# can become 1 byte, e.g. NFKC 𝐀 -> A), and composition merges at most 4 decomposed characters (a canonical
# decomposition is at most 4 long) into one character of >= 2 bytes (no composite is ASCII): 4 * 4 / 2.
UNICODE_SHRINK = 8.0
UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def _shrink(normalizer: dict | None) -> float | None:
    """The most input bytes one byte of normalized text can stand for (None: unbounded or unknown)."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind in UNICODE_NORMALIZERS:
        return UNICODE_SHRINK
    if kind == "Prepend":
        return 1.0
    if kind == "Replace":  # a pattern -> content rewrite shrinks by len(pattern) / len(content) at most
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if pattern is None or not content:  # a regex, or a deletion: unbounded
            return None
        return max(1.0, len(pattern.encode()) / len(content.encode()))
    if kind == "Sequence":
        total = 1.0
        for part in normalizer.get("normalizers") or []:
            s = _shrink(part)
            if s is None:
                return None
            total *= s
        return total
    return None


def _lossless_pre_tokenizer(pre: dict | None) -> bool:
    """True when the pre-tokenizer keeps every input character in some piece (none is removed)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_lossless_pre_tokenizer(p) for p in pre.get("pretokenizers") or [])
    if kind not in LOSSLESS_PRE_TOKENIZERS:
        return False
    return str(pre.get("behavior", "")).lower() != "removed"


def _byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(_byte_level(p) for p in pre.get("pretokenizers") or [])


def bytes_per_token(tokenizer) -> float | None:
    """The most input bytes one token can stand for, or None when the tokenizer gives no sound bound (see above)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _lossless_pre_tokenizer(pre):
        return None
    byte_level = _byte_level(pre)
    # an unknown token may stand for any run of characters, unless no input can reach it
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(s) if byte_level else len(s.encode()) for s in vocab), default=1)
    added = max((len(a["content"].encode()) for a in spec.get("added_tokens") or []), default=1)
    return float(max(longest, added, 1)) * shrink


def min_tokens(text: str, per_token: float | None) -> int:
    """A lower bound on the tokens of `text` (0 without a bound)."""
    if per_token is None:
        return 0
    n = len(text.encode("utf-8", "surrogatepass"))
    return int(-(-n // per_token))
