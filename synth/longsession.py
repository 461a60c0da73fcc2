"""Long coding sessions for the residency-vs-retrievability benchmark (PACE's distance layout).

A session is a system message, filler turns, the three definition steps, more filler turns, then probes:

    [system] [filler ... ] [def 1] [def 2] [def 3] [filler ... (D tokens)] | probes

The context (everything before the probes) is `length` tokens long, and the definitions end `distance` tokens before
the first probe; filler before the definitions pads the start. For one seed the definitions and the filler stream are
the same at every distance; only where the definitions sit changes. Lengths are measured with the tokenizer's chat
template exactly as the engine will see the session (`kvsteward.synth.chat.message_token_ids`).

    python -m kvsteward.synth.longsession --sessions 5 --length 16384 --distances 1024,8192,15000 --out s.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Iterator

from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.longsession_defs import DEFAULT_FACTS, Spec, definitions, make_spec, probes
from kvsteward.synth.longsession_schema import Message, Probe, Region, Session, ensure_layout, write_jsonl
from kvsteward.synth.stdlib_filler import Chunk, filler_stream

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


def _filler_turn(seed: int, chunk: Chunk) -> list[Message]:
    # The wrapper depends on the chunk, not on its place, so a chunk reads the same at every distance.
    rng = random.Random(f"longsession-wrap:{seed}:{chunk.path}:{chunk.first_line}")
    where = {"path": chunk.path, "a": chunk.first_line, "b": chunk.first_line + len(chunk.lines) - 1}
    user = rng.choice(_PREFACES).format(**where) + f"\n\n```python\n{chunk.text}\n```"
    return [Message(role="user", content=user), Message(role="assistant", content=rng.choice(_ACKS).format(**where))]


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


def _fit(lengths: _Lengths, seed: int, chunk: Chunk, budget: int) -> int:
    """Most whole lines of `chunk` whose turn costs at most `budget` tokens (0 if none)."""
    lo, hi = 0, len(chunk.lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lengths.cost(_filler_turn(seed, chunk.head(mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fill(lengths: _Lengths, seed: int, chunks: Iterator[Chunk], budget: int,
          carry: Chunk | None) -> tuple[list[Message], int, Chunk | None]:
    """Filler turns costing at most `budget` tokens; the last chunk is cut at a line to fit. Returns the turns,
    their cost and the unread rest of a cut chunk (it opens the next region)."""
    turns: list[Message] = []
    used = 0
    while budget - used >= MIN_TURN_TOKENS:
        chunk, carry = (carry or next(chunks)), None
        turn = _filler_turn(seed, chunk)
        cost = lengths.cost(turn)
        if used + cost > budget:
            k = _fit(lengths, seed, chunk, budget - used)
            if k == 0:
                return turns, used, chunk
            turn = _filler_turn(seed, chunk.head(k))
            cost = lengths.cost(turn)
            carry = chunk.tail(k) if k < len(chunk.lines) else None
            turns += turn
            return turns, used + cost, carry
        turns += turn
        used += cost
    return turns, used, carry


def _probe_records(spec: Spec, facts: tuple[str, ...]) -> list[Probe]:
    return [Probe(id=p.id, kind=p.kind, messages=[Message(role="user", content=p.question)],
                  answer_prefix=p.answer_prefix, gold=p.gold, required=p.required, tests=p.tests, needs=p.needs)
            for p in probes(spec, facts)]


def _facts(spec: Spec) -> dict[str, str]:
    out = {"item_class": spec.item, "account_class": spec.account, "status_enum": spec.status_enum,
           "error_class": spec.error, "error_code": spec.error_code, "fee_rate": spec.fee_rate,
           "min_fee": spec.min_fee, "fee_cap": spec.fee_cap, "quantum": spec.quantum, "rounding": spec.rounding}
    out.update({f"status_{role}": name for role, name in spec.statuses.items()})
    out.update({f"item_field_{k}": v for k, v in spec.item_fields.items()})
    out.update({f"account_field_{k}": v for k, v in spec.account_fields.items()})
    return out


def generate_session(tokenizer, seed: int, length: int, distance: int, facts: tuple[str, ...] = DEFAULT_FACTS,
                     chunk_tokens: int = 2000, _chunks: _Replay | None = None) -> Session:
    """One session: definitions from `seed`, `distance` tokens of filler after them, `length` tokens in all."""
    if length <= 0 or distance < 0:
        raise ValueError(f"length must be positive and distance non-negative, got length={length}, "
                         f"distance={distance}")
    spec = make_spec(seed)
    system = system_message(spec)
    lengths = _Lengths(tokenizer, system)
    defs = definitions(spec)
    def_msgs = [m for d in defs for m in (Message(role="user", content=d.user),
                                          Message(role="assistant", content=d.ack))]
    free = length - lengths.system_cost() - lengths.cost(def_msgs)
    if distance > free:
        raise ValueError(f"distance {distance} does not fit in a {length}-token session: the system message and "
                         f"definitions take {length - free} tokens, leaving at most {free} for filler")
    chunks = iter(_chunks or _Replay(filler_stream(tokenizer, seed, spec.secrets(), chunk_tokens)))
    pre, _, carry = _fill(lengths, seed, chunks, free - distance, None)
    post, _, _ = _fill(lengths, seed, chunks, distance, carry)
    messages = [system, *pre, *def_msgs, *post]
    first_def = 1 + len(pre)
    steps = [[first_def + 2 * i, first_def + 2 * i + 1] for i in range(len(defs))]
    regions = [Region(key=k, message=first_def + 2 * i, start=a, end=b)
               for i, d in enumerate(defs) for k, (a, b) in d.regions.items()]
    session = Session(id=f"ls{seed}-L{length}-D{distance}", seed=seed, length=length, distance=distance,
                      messages=messages, definition_steps=steps, regions=regions, facts=_facts(spec),
                      probes=_probe_records(spec, facts))
    return ensure_layout(session, tokenizer)


def generate_sessions(tokenizer, n: int, length: int, distances: list[int], seed: int,
                      facts: tuple[str, ...] = DEFAULT_FACTS, chunk_tokens: int = 2000,
                      progress: bool = False) -> list[Session]:
    """`n` seeds × `distances`: one session per (seed, distance), session-major; a seed's definitions and filler
    stream are shared by all its distances."""
    if n <= 0 or not distances:
        raise ValueError(f"need n > 0 and at least one distance, got n={n}, distances={distances}")
    jobs = [(i, d) for i in range(n) for d in distances]
    replays: dict[int, _Replay] = {}
    out = []
    from rich.console import Console
    from rich.progress import track

    # stderr: stdout carries the CLI's --json result
    for i, d in (track(jobs, description="generating sessions", console=Console(stderr=True)) if progress else jobs):
        s = session_seed(seed, i)
        if s not in replays:
            replays = {s: _Replay(filler_stream(tokenizer, s, make_spec(s).secrets(), chunk_tokens))}
        out.append(generate_session(tokenizer, s, length, d, facts, chunk_tokens, replays[s]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write long-session benchmark sessions as JSONL.")
    ap.add_argument("--model", default="smollm2", help="tokenizer to measure lengths with (name or folder)")
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--distances", default="1024,8192,15000")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from kvsteward.models import load_tokenizer

    tok = load_tokenizer(args.model)
    t0 = time.perf_counter()
    sessions = generate_sessions(tok, args.sessions, args.length, [int(x) for x in args.distances.split(",")],
                                 args.seed, progress=True)
    write_jsonl(sessions, args.out)
    for s in sessions:
        print(f"{s.id}: {s.layout.n_tokens} tokens, distance {s.layout.distance_tokens}, {len(s.messages)} messages")
    print(f"{len(sessions)} sessions in {time.perf_counter() - t0:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
