"""Long sessions for the residency-vs-retrievability benchmark (PACE's distance layout), in two domains:
`settlement` (a coding session: fee rules in Python, the Python stdlib's source as filler) and `ops` (an on-call
session: a service's YAML config and runbook, the Python documentation's prose as filler; `longsession_ops`).

A session is a system message, filler turns, the three definition steps, more filler turns, then probes:

    [system] [filler ... ] [def 1] [def 2] [def 3] [filler ... (D tokens)] | probes

The context (everything before the probes) is `length` tokens long, and the definitions end `distance` tokens before
the first probe; filler before the definitions pads the start. For one seed the definitions and the filler stream are
the same at every distance; only where the definitions sit changes. Lengths are measured with the tokenizer's chat
template exactly as the engine will see the session (`kvsteward.synth.chat.message_token_ids`).

    python -m kvsteward.synth.longsession.generate --sessions 5 --length 16384 --distances 1024,8192,15000 --out s.jsonl
    python -m kvsteward.synth.longsession.generate --domain ops --sessions 5 --length 8192 --distances 1024,7000 --out \
        o.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.longsession.defs import DEFAULT_FACTS, Spec, definitions, make_spec, probes
from kvsteward.synth.longsession.ops import (
    OPS_DEFAULT_FACTS,
    make_ops_spec,
    ops_definitions,
    ops_facts,
    ops_probes,
    ops_system_message_text,
)
from kvsteward.synth.longsession.prose_filler import prose_stream
from kvsteward.synth.longsession.schema import Message, Probe, Region, Session, ensure_layout, write_jsonl
from kvsteward.synth.longsession.stdlib_filler import Chunk, filler_stream

MIN_TURN_TOKENS = 64  # below this a filler turn is mostly wrapper; leave the slack unfilled instead
_PREFACES = ("Here is more code from the repository, `{path}` (lines {a}-{b}):",
             "Next file for context, `{path}` (lines {a}-{b}):",
             "Please read this part of `{path}` too (lines {a}-{b}):",
             "More context from `{path}`, lines {a}-{b}:")
_ACKS = ("Got it, I've read through that part of `{path}`.", "Thanks, noted. Ready for the next part.",
         "OK, I've gone through those lines.", "Read it. Send the next piece when ready.")


def session_seed(seed: int, index: int) -> int:
    """Seed of the index-th session of a run (stable, and distinct across nearby run seeds)."""
    return int.from_bytes(hashlib.sha256(f"longsession:{seed}:{index}".encode()).digest()[:4], "big") >> 1


def system_message(spec: Spec) -> Message:
    return Message(role="system", content=(
        f"You are a careful coding assistant working in the {spec.project} repository. The user shares "
        "specifications and source files over a long session; follow the specifications exactly."))


_OPS_PREFACES = ("Here is a page from the reference notes we keep next to the runbooks, `{path}`:",
                 "More background reading for the rotation, `{path}`:",
                 "Please skim this part of the notes too, `{path}`:",
                 "Next page of the notes, `{path}`:")
_OPS_ACKS = ("Read it. Send the next page when ready.", "Thanks, I've gone through that page.",
             "OK, noted. Ready for more.", "Got it, I've read that part of `{path}`.")


@dataclass(frozen=True)
class Domain:
    """What a session domain supplies: its facts, definitions, probes, system message and filler."""

    name: str
    id_prefix: str  # session ids are f"{id_prefix}{seed}-L{length}-D{distance}"
    make_spec: Callable[[int], object]
    system: Callable[[object], Message]
    definitions: Callable[[object], list]
    probes: Callable[..., list]
    facts: Callable[[object], dict[str, str]]
    default_facts: tuple[str, ...]
    filler: Callable[..., Iterator[Chunk]]  # (tokenizer, seed, secrets, chunk_tokens)
    prefaces: tuple[str, ...]
    acks: tuple[str, ...]
    fence: str | None  # the filler chunk is shown in a ```fence block, or as plain text


def _settlement_facts(spec: Spec) -> dict[str, str]:
    out = {"item_class": spec.item, "account_class": spec.account, "status_enum": spec.status_enum,
           "error_class": spec.error, "error_code": spec.error_code, "fee_rate": spec.fee_rate,
           "min_fee": spec.min_fee, "fee_cap": spec.fee_cap, "quantum": spec.quantum, "rounding": spec.rounding}
    out.update({f"status_{role}": name for role, name in spec.statuses.items()})
    out.update({f"item_field_{k}": v for k, v in spec.item_fields.items()})
    out.update({f"account_field_{k}": v for k, v in spec.account_fields.items()})
    return out


DOMAINS: dict[str, Domain] = {
    "settlement": Domain("settlement", "ls", make_spec, system_message, definitions, probes, _settlement_facts,
                         DEFAULT_FACTS, filler_stream, _PREFACES, _ACKS, "python"),
    "ops": Domain("ops", "lsops", make_ops_spec, lambda s: Message(role="system", content=ops_system_message_text(s)),
                  ops_definitions, ops_probes, ops_facts, OPS_DEFAULT_FACTS, prose_stream, _OPS_PREFACES, _OPS_ACKS,
                  None),
}


def get_domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise ValueError(f"unknown session domain {name!r}; known: {sorted(DOMAINS)}")
    return DOMAINS[name]


def _filler_turn(seed: int, chunk: Chunk, domain: Domain = DOMAINS["settlement"]) -> list[Message]:
    # The wrapper depends on the chunk, not on its place, so a chunk reads the same at every distance.
    rng = random.Random(f"longsession-wrap:{seed}:{chunk.path}:{chunk.first_line}")
    where = {"path": chunk.path, "a": chunk.first_line, "b": chunk.first_line + len(chunk.lines) - 1}
    body = f"```{domain.fence}\n{chunk.text}\n```" if domain.fence else chunk.text
    user = rng.choice(domain.prefaces).format(**where) + f"\n\n{body}"
    ack = rng.choice(domain.acks).format(**where)
    return [Message(role="user", content=user), Message(role="assistant", content=ack)]


class _Lengths:
    """Token cost of messages placed after the system message (pieces of a prefix-stable template)."""

    def __init__(self, tokenizer, system: Message):
        self.tokenizer, self.system = tokenizer, system.model_dump()

    def system_cost(self) -> int:
        return len(message_token_ids(self.tokenizer, [self.system])[0])

    def cost(self, messages: list[Message]) -> int:
        ids = message_token_ids(self.tokenizer, [self.system, *(m.model_dump() for m in messages)])
        return sum(len(x) for x in ids[1:])


class _Replay:
    """A chunk stream that can be read from the start again (one per seed, shared by all distances)."""

    def __init__(self, stream: Iterator[Chunk]):
        self.stream, self.seen = stream, []

    def __iter__(self) -> Iterator[Chunk]:
        i = 0
        while True:
            if i == len(self.seen):
                self.seen.append(next(self.stream))
            yield self.seen[i]
            i += 1


def _fit(lengths: _Lengths, turn: Callable[[Chunk], list[Message]], chunk: Chunk, budget: int) -> int:
    """Most whole lines of `chunk` whose turn costs at most `budget` tokens (0 if none)."""
    lo, hi = 0, len(chunk.lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lengths.cost(turn(chunk.head(mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fill(lengths: _Lengths, turn_of: Callable[[Chunk], list[Message]], chunks: Iterator[Chunk], budget: int,
          carry: Chunk | None) -> tuple[list[Message], int, Chunk | None]:
    """Filler turns costing at most `budget` tokens; the last chunk is cut at a line to fit. Returns the turns,
    their cost and the unread rest of a cut chunk (it opens the next region)."""
    turns: list[Message] = []
    used = 0
    while budget - used >= MIN_TURN_TOKENS:
        chunk, carry = (carry or next(chunks)), None
        turn = turn_of(chunk)
        cost = lengths.cost(turn)
        if used + cost > budget:
            k = _fit(lengths, turn_of, chunk, budget - used)
            if k == 0:
                return turns, used, chunk
            turn = turn_of(chunk.head(k))
            cost = lengths.cost(turn)
            carry = chunk.tail(k) if k < len(chunk.lines) else None
            turns += turn
            return turns, used + cost, carry
        turns += turn
        used += cost
    return turns, used, carry


def _probe_records(drafts: list) -> list[Probe]:
    return [Probe(id=p.id, kind=p.kind, messages=[Message(role="user", content=p.question)],
                  answer_prefix=p.answer_prefix, gold=p.gold, required=p.required, tests=p.tests, needs=p.needs)
            for p in drafts]


def generate_session(tokenizer, seed: int, length: int, distance: int, facts: tuple[str, ...] | None = None,
                     chunk_tokens: int = 2000, _chunks: _Replay | None = None, domain: str = "settlement") -> Session:
    """One session: definitions from `seed`, `distance` tokens of filler after them, `length` tokens in all;
    `facts` the fact probes asked (None: the domain's default)."""
    if length <= 0 or distance < 0:
        raise ValueError(f"length must be positive and distance non-negative, got length={length}, "
                         f"distance={distance}")
    dom = get_domain(domain)
    spec = dom.make_spec(seed)
    system = dom.system(spec)
    lengths = _Lengths(tokenizer, system)
    defs = dom.definitions(spec)
    def_msgs = [m for d in defs for m in (Message(role="user", content=d.user),
                                          Message(role="assistant", content=d.ack))]
    free = length - lengths.system_cost() - lengths.cost(def_msgs)
    if distance > free:
        raise ValueError(f"distance {distance} does not fit in a {length}-token session: the system message and "
                         f"definitions take {length - free} tokens, leaving at most {free} for filler")
    chunks = iter(_chunks or _Replay(dom.filler(tokenizer, seed, spec.secrets(), chunk_tokens)))
    turn = partial(_filler_turn, seed, domain=dom)
    pre, _, carry = _fill(lengths, turn, chunks, free - distance, None)
    post, _, _ = _fill(lengths, turn, chunks, distance, carry)
    messages = [system, *pre, *def_msgs, *post]
    first_def = 1 + len(pre)
    steps = [[first_def + 2 * i, first_def + 2 * i + 1] for i in range(len(defs))]
    regions = [Region(key=k, message=first_def + 2 * i, start=a, end=b)
               for i, d in enumerate(defs) for k, (a, b) in d.regions.items()]
    drafts = dom.probes(spec, dom.default_facts if facts is None else facts)
    session = Session(id=f"{dom.id_prefix}{seed}-L{length}-D{distance}", seed=seed, length=length, distance=distance,
                      messages=messages, definition_steps=steps, regions=regions, facts=dom.facts(spec),
                      probes=_probe_records(drafts))
    return ensure_layout(session, tokenizer)


def generate_sessions(tokenizer, n: int, length: int, distances: list[int], seed: int,
                      facts: tuple[str, ...] | None = None, chunk_tokens: int = 2000,
                      progress: bool = False, domain: str = "settlement") -> list[Session]:
    """`n` seeds × `distances`: one session per (seed, distance), session-major; a seed's definitions and filler
    stream are shared by all its distances."""
    if n <= 0 or not distances:
        raise ValueError(f"need n > 0 and at least one distance, got n={n}, distances={distances}")
    dom = get_domain(domain)
    jobs = [(i, d) for i in range(n) for d in distances]
    replays: dict[int, _Replay] = {}
    out = []
    from rich.console import Console
    from rich.progress import track

    # stderr: stdout carries the CLI's --json result
    for i, d in (track(jobs, description="generating sessions", console=Console(stderr=True)) if progress else jobs):
        s = session_seed(seed, i)
        if s not in replays:
            replays = {s: _Replay(dom.filler(tokenizer, s, dom.make_spec(s).secrets(), chunk_tokens))}
        out.append(generate_session(tokenizer, s, length, d, facts, chunk_tokens, replays[s], domain=domain))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write long-session benchmark sessions as JSONL.")
    ap.add_argument("--model", default="smollm2", help="tokenizer to measure lengths with (name or folder)")
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--distances", default="1024,8192,15000")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--domain", default="settlement", choices=sorted(DOMAINS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from kvsteward.models import load_tokenizer

    tok = load_tokenizer(args.model)
    t0 = time.perf_counter()
    sessions = generate_sessions(tok, args.sessions, args.length, [int(x) for x in args.distances.split(",")],
                                 args.seed, progress=True, domain=args.domain)
    write_jsonl(sessions, args.out)
    for s in sessions:
        print(f"{s.id}: {s.layout.n_tokens} tokens, distance {s.layout.distance_tokens}, {len(s.messages)} messages")
    print(f"{len(sessions)} sessions in {time.perf_counter() - t0:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
