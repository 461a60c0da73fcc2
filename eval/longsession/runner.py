"""The long-session benchmark runner: play the same sessions through every arm, score the probes, keep the ledger.

Per session and arm: append each context message (one step each), then play the probes in order. A probe appends
its question, opens the assistant answer with the answer prefix, and
- fact: greedy-decodes on a fork (forced-prefix match) and teacher-forces the gold value on the main thread (gold
  NLL), so later probes see the same text whatever an arm generated;
- recall / code: greedy-decodes on a fork and scores the text; the main thread gets the generated answer.
The ledger is read when the answer opens: residency of the tokens the probe needs, their mean rotary gap to the
query position, resident slots and KV bytes.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from kvsteward.eval import scoring
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.policies import ARMS
from kvsteward.serve.engine.session import Session as EngineSession
from kvsteward.synth.chat import generation_prompt, message_token_ids
from kvsteward.synth.longsession.planner import PLANNERS, blueprint_of, oracle_reads
from kvsteward.synth.longsession.schema import Probe, Session

DEFAULT_ARMS = ("h2o", "retention-only", "positions-only", "pace")
BLUEPRINT_GRANULARITIES = ("facts", "messages")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RunConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    budget: int = 512
    chunk: int = 512
    limit: int = 2048
    reference: str = "h2o"
    max_fact_tokens: int = 16
    max_recall_tokens: int = 96
    max_code_tokens: int = 160
    code: bool = True
    code_timeout: float = 10.0
    # the oracle plan's granularity: "facts" (each needed fact's tokens: the session's layout) or "messages" (the
    # whole message holding each needed fact: the definition step's user message, with its readers)
    blueprint: str = "facts"
    # who made the plan the foresight arms follow: "oracle" (the generator's record) or a planner of
    # `synth.longsession.planner` (its plans are passed to `run` as `plans`)
    planner: str = "oracle"
    # the model's weights and K/V: "float32", or "bfloat16" (AVX512-BF16 / tensor-core matmuls; reference keys for
    # re-rotation stay fp32). The CLI loads the engine in it; the journal keeps the two apart
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.blueprint not in BLUEPRINT_GRANULARITIES:
            raise ValueError(f"blueprint granularity must be one of {BLUEPRINT_GRANULARITIES}, got {self.blueprint!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.planner != "oracle" and self.blueprint != "messages":
            raise ValueError(f"the {self.planner} planner names whole messages, not fact tokens: use "
                             "--blueprint messages with it")


@dataclass
class ProbeRow:
    session: str
    distance: int
    arm: str
    probe: str
    kind: str
    score: float  # forced match (fact), recall fraction (recall), pass (code)
    nll: float = float("nan")
    residency: float = float("nan")
    rotary_gap: float = float("nan")
    resident: int = 0
    kv_bytes: int = 0
    ref_bytes: int = 0  # fp32 reference keys of the resident slots (re-rotation starts from them)
    max_position: int = 0
    refreshes: int = 0  # refreshes so far in the session (pace-refresh arms), and the tokens they re-encoded
    refresh_tokens: int = 0
    extra: dict = field(default_factory=dict)


def plan_of(sess: Session, granularity: str = "facts") -> list[dict]:
    """The session's oracle blueprint at `granularity`: its layout's fact spans, or the whole message holding each
    needed fact (the oracle's reads as a planner would give them: one entry per message, readers united)."""
    if granularity == "facts":
        return sess.layout.blueprint
    return blueprint_of(sess, oracle_reads(sess))


def _open_session(engine: Engine, arm: str, cfg: RunConfig, sess: Session,
                  blueprint: list[dict] | None = None) -> EngineSession:
    policy, bounded = ARMS[arm]
    budget = None if policy == "full" else cfg.budget
    return engine.session(arm, budget=budget, chunk=cfg.chunk, limit=cfg.limit if bounded else None,
                          blueprint=plan_of(sess, cfg.blueprint) if blueprint is None else blueprint)


def _ledger(s: EngineSession, needed: list[tuple[int, int]]) -> dict:
    wanted = torch.tensor(sorted({i for a, b in needed for i in range(a, b)}), dtype=torch.long)
    logical, positions = s.resident_logical(), s.resident_positions()
    hit = torch.isin(logical, wanted)
    point = resident_point(s)
    del point["tokens"]
    return {"residency": scoring.residency(set(wanted.tolist()), set(logical[hit].tolist())),
            "rotary_gap": scoring.rotary_gap(s.next_pos, positions[hit].tolist()), **point,
            "refreshes": s.refreshes, "refresh_tokens": s.refresh_tokens}


def resident_point(s: EngineSession) -> dict:
    """Where the session's KV stands now: tokens appended so far, resident slots, resident KV bytes, their reference
    keys' bytes, the largest position."""
    positions = s.resident_positions()
    return {"tokens": s.n_logical, "resident": s.resident, "kv_bytes": s.table.kv_bytes(),
            "ref_bytes": s.table.ref_bytes(), "max_position": int(positions.max()) if positions.numel() else 0}


def play(engine: Engine, sess: Session, arm: str, cfg: RunConfig,
         on_message: Callable[[EngineSession], None] | None = None,
         blueprint: list[dict] | None = None,
         on_probe: Callable[[EngineSession, Probe], None] | None = None) -> tuple[list[ProbeRow], int]:
    """One session through one arm; returns a row per probe and the session's peak resident slots.
    `on_message` is called after every context message (progress bars); `blueprint` replaces the oracle plan
    (a planner's); `on_probe` is called at each probe's answer opening, before it is scored (diagnostics that
    read forks of the state)."""
    tok = engine.tokenizer
    messages = [m.model_dump() for m in sess.messages]
    s = _open_session(engine, arm, cfg, sess, blueprint)
    for msg, ids in zip(messages, message_token_ids(tok, messages), strict=True):
        s.append(ids, kind=msg["role"], logits=None)
        if on_message:
            on_message(s)
    end_ids = tok.encode("<|im_end|>\n", add_special_tokens=False) if "<|im_end|>" in tok.get_vocab() else []
    rows = []
    for probe in sess.probes:
        pm = [m.model_dump() for m in probe.messages]
        history = messages + pm
        for ids in message_token_ids(tok, history)[len(messages):]:
            s.append(ids, kind="user", logits=None)
        opener = tok.encode(generation_prompt(tok, history) + probe.answer_prefix, add_special_tokens=False)
        s.append(opener, kind="assistant")
        if on_probe:
            on_probe(s, probe)
        row = ProbeRow(sess.id, sess.distance, arm, probe.id, probe.kind, 0.0,
                       **_ledger(s, sess.layout.needed_spans[probe.id]))
        answer_ids = _score_probe(engine, s, probe, row, cfg)
        s.append(answer_ids + end_ids, kind="assistant", continue_message=True, logits=None)
        messages = history + [{"role": "assistant", "content": probe.answer_prefix + tok.decode(answer_ids)}]
        rows.append(row)
    return rows, s.peak_resident


def _score_probe(engine: Engine, s: EngineSession, probe, row: ProbeRow, cfg: RunConfig) -> list[int]:
    """Score one probe; return the answer tokens the main thread continues with."""
    tok = engine.tokenizer
    stop = engine.stop_ids
    if probe.kind == "fact":
        gold = tok.encode(probe.gold, add_special_tokens=False)
        generated = s.fork().generate(max(cfg.max_fact_tokens, len(gold) + 2), stop_ids=stop)
        row.score = float(scoring.forced_prefix_match(generated, gold, tok))
        row.nll = scoring.appended_gold_nll(s, gold)
        row.extra["generated"] = tok.decode(generated, skip_special_tokens=True)
        return []  # the gold value is already appended
    limit = cfg.max_recall_tokens if probe.kind == "recall" else cfg.max_code_tokens
    if probe.kind == "code" and not cfg.code:
        row.score = float("nan")
        return []
    generated = s.fork().generate(limit, stop_ids=stop)
    text = tok.decode(generated, skip_special_tokens=True)
    if probe.kind == "recall":
        row.score = scoring.recall_score(text, probe.required)
    else:
        result = scoring.code_checks(probe.answer_prefix + text, probe.tests, timeout=cfg.code_timeout)
        row.score = float(result.ok)
        row.extra["checks"] = [result.passed, result.total]
    row.extra["generated"] = text
    return [t for t in generated if t not in stop]


def _by_fact(facts: list[ProbeRow]) -> dict[str, dict]:
    """Per fact kind (`fact:quantum`, ...): forced-prefix accuracy, answered / played, and the wrong answers (the
    greedy text up to its closing quote) with how often each came: which facts an arm misses, and how."""
    out: dict[str, dict] = {}
    for probe in sorted({r.probe for r in facts}):
        rs = [r for r in facts if r.probe == probe]
        wrong: dict[str, int] = defaultdict(int)
        for r in rs:
            if not r.score:
                wrong[str(r.extra.get("generated", "")).split('"', 1)[0].strip()[:24]] += 1
        out[probe] = {"forced_acc": scoring.mean([r.score for r in rs]), "answered": int(sum(r.score for r in rs)),
                      "n": len(rs), "misses": dict(sorted(wrong.items(), key=lambda kv: (-kv[1], kv[0])))}
    return out


def summarize(rows: list[ProbeRow], walls: dict[str, float], peaks: dict[str, int], cfg: RunConfig,
              series: dict[str, dict] | None = None) -> dict:
    """The benchmark JSON: per arm and distance, plus paired comparisons against the reference arm. `series` (arm →
    {"session", "points"}) is each arm's resident KV after every context message of one session (`resident_series`
    of the arm: the flat-vs-growing plot)."""
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[r.arm][r.distance].append(r)
    arms = {}
    for arm in cfg.arms:
        cells = {}
        for d, rs in sorted(by[arm].items()):
            facts = [r for r in rs if r.kind == "fact"]
            cells[str(d)] = {"forced_acc": scoring.mean([r.score for r in facts]),
                             "gold_nll": scoring.mean([r.nll for r in facts]),
                             "recall": scoring.mean([r.score for r in rs if r.kind == "recall"]),
                             "code_acc": scoring.mean([r.score for r in rs if r.kind == "code"]),
                             "residency": scoring.mean([r.residency for r in facts]),
                             "rotary_gap": scoring.mean([r.rotary_gap for r in facts]), "n": len(facts),
                             "by_fact": _by_fact(facts)}
        last = {}  # per session, its last probe's running totals
        for r in sorted((r for rs in by[arm].values() for r in rs), key=lambda r: r.refresh_tokens):
            last[r.session] = r
        arms[arm] = {"by_distance": cells, "peak_resident_slots": peaks.get(arm, 0), "wall_s": walls.get(arm, 0.0),
                     "refreshes": sum(r.refreshes for r in last.values()),
                     "refresh_tokens": sum(r.refresh_tokens for r in last.values())}
        if series and arm in series:
            arms[arm]["resident_series"] = series[arm]
    paired = {}
    if cfg.reference in cfg.arms:
        ref = {(r.session, r.probe): r.score for r in rows if r.arm == cfg.reference and r.kind == "fact"}
        for arm in cfg.arms:
            if arm != cfg.reference:
                mine = {(r.session, r.probe): r.score for r in rows if r.arm == arm and r.kind == "fact"}
                both = mine.keys() & ref.keys()  # a partial (journal) sweep pairs only what both arms finished
                paired[arm] = scoring.paired_compare({k: mine[k] for k in both}, {k: ref[k] for k in both})
    def record(r: ProbeRow) -> dict:
        return {"arm": r.arm, "distance": r.distance, "session": r.session, "probe": r.probe, "kind": r.kind,
                "score": r.score, "nll": r.nll, "residency": r.residency, "rotary_gap": r.rotary_gap,
                "resident": r.resident, "kv_bytes": r.kv_bytes, "max_position": r.max_position, **r.extra}

    # `probes` (fact probes, with `forced`) feeds the report's rotary-gap plot; the rest are kept for inspection.
    probes = [record(r) | {"forced": r.score} for r in rows if r.kind == "fact"]
    other = [record(r) for r in rows if r.kind != "fact"]
    return {"arms": arms, "paired": paired, "reference": cfg.reference, "probes": probes, "other_probes": other,
            "config": {k: v for k, v in cfg.__dict__.items()}}


JOURNAL = "journal.jsonl"


def shard_journal(index: int, count: int) -> str:
    """The journal file of shard `index` of `count` (shards of one sweep write separate files in the same folder,
    so concurrent processes never interleave writes; every run reads all of them)."""
    return f"journal.shard-{index}-of-{count}.jsonl"


def shard(sessions: list[Session], index: int, count: int) -> list[Session]:
    """Sessions `index`, `index + count`, ... (every session is in exactly one shard)."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard must be I/N with 0 <= I < N, got {index}/{count}")
    return sessions[index::count]


def read_journals(journal: Path, cfg: RunConfig) -> dict[tuple[str, str], dict]:
    """Finished pairs from `journal` and, when it is a sweep journal (`journal*.jsonl`), from the other journals of
    its folder (`journal.jsonl` and the shard journals)."""
    paths = {journal}
    if journal.name.startswith("journal") and journal.parent.exists():
        paths |= set(journal.parent.glob("journal*.jsonl"))
    done: dict[tuple[str, str], dict] = {}
    for path in sorted(paths):
        done |= read_journal(path, cfg)
    return done


def _journal_key(cfg: RunConfig) -> dict:
    """What a journal line must agree on to be reused (a changed budget or limit is a different experiment)."""
    key = {k: v for k, v in cfg.__dict__.items() if k not in ("arms", "reference")}
    if key["blueprint"] == "facts":  # the default, as journals written before the option read
        del key["blueprint"]
    if key["planner"] == "oracle":  # likewise
        del key["planner"]
    if key["dtype"] == "float32":  # likewise
        del key["dtype"]
    return key


def read_journal(path: Path, cfg: RunConfig) -> dict[tuple[str, str], dict]:
    """(session id, arm) → {"rows", "wall_s", "peak"} for every finished pair recorded under the same config.

    Lines written with another config are refused (clear error), a torn last line (a kill mid-write) is ignored."""
    done: dict[tuple[str, str], dict] = {}
    if not path.exists():
        return done
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break  # torn write of the last pair: it is simply played again
            raise ValueError(f"{path}: line {n + 1} is not JSON; move the journal away to start over") from None
        if rec["config"] != _journal_key(cfg):
            raise ValueError(f"{path} was written with config {rec['config']}, this run uses {_journal_key(cfg)}; "
                             "use another --out or delete the journal")
        done[(rec["session"], rec["arm"])] = {"rows": [ProbeRow(**r) for r in rec["rows"]],
                                              "wall_s": rec["wall_s"], "peak": rec["peak"],
                                              "series": rec.get("series")}
    return done


def _append_journal(path: Path, cfg: RunConfig, sess: Session, arm: str, rows: list[ProbeRow], wall: float,
                    peak: int, series: list[dict] | None = None) -> None:
    rec = {"session": sess.id, "arm": arm, "config": _journal_key(cfg), "wall_s": wall, "peak": peak,
           "rows": [asdict(r) for r in rows], "series": series}
    with path.open("a") as f:  # one line per finished (session, arm): a crash loses at most the pair in flight
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class PairBar(Protocol):
    """Progress of a sweep: `start` a (session, arm) pair over its context messages, `advance` one message, `finish`
    a pair (played, or found in the journal)."""

    def start(self, label: str, messages: int) -> None: ...
    def advance(self) -> None: ...
    def finish(self) -> None: ...


def run(engine: Engine, sessions: list[Session], cfg: RunConfig,
        progress: Callable[[str], None] | None = None, journal: Path | None = None,
        play_missing: bool = True, bar: PairBar | None = None, plans: dict[str, list[dict]] | None = None) -> dict:
    """Every arm on every session. With `journal`, finished (session, arm) pairs are appended to it as they end
    and pairs already in it are not played again (resume after a crash or a kill; `play_missing=False` only
    summarizes what the journal holds — a partial sweep). Finished pairs are read from every `journal*.jsonl` next
    to `journal` (shards of the same sweep), new ones are written to `journal` only. `plans` (session id →
    blueprint) is the planner's plan for each session; required unless `cfg.planner` is the oracle."""
    if cfg.planner != "oracle" and play_missing and (plans is None or any(s.id not in plans for s in sessions)):
        raise ValueError(f"planner {cfg.planner!r}: every session to play needs its plan in `plans`")
    rows: list[ProbeRow] = []
    walls: dict[str, float] = defaultdict(float)
    peaks: dict[str, int] = defaultdict(int)
    series: dict[str, dict] = {}  # arm → resident KV along the first session that has it
    done = read_journals(journal, cfg) if journal else {}
    for i, sess in enumerate(sessions):
        for arm in cfg.arms:
            if (sess.id, arm) in done:
                got, wall, peak = done[(sess.id, arm)]["rows"], done[(sess.id, arm)]["wall_s"], \
                    done[(sess.id, arm)]["peak"]
                points = done[(sess.id, arm)]["series"]
            elif not play_missing:
                continue
            else:
                t0 = time.perf_counter()
                if bar:
                    bar.start(f"session {i + 1}/{len(sessions)} D={sess.distance} {arm}", len(sess.messages))
                points = []

                def on_message(s: EngineSession, points: list[dict] = points, t0: float = t0) -> None:
                    points.append(resident_point(s) | {"wall_s": round(time.perf_counter() - t0, 2)})
                    if bar:
                        bar.advance()

                got, peak = play(engine, sess, arm, cfg, on_message=on_message,
                                 blueprint=plans[sess.id] if cfg.planner != "oracle" else None)
                wall = time.perf_counter() - t0
                if journal:
                    _append_journal(journal, cfg, sess, arm, got, wall, peak, points)
                if progress:
                    acc = scoring.mean([r.score for r in got if r.kind == "fact"])
                    progress(f"session {i + 1}/{len(sessions)} (D={sess.distance}) {arm}: forced_acc={acc:.2f} "
                             f"residency={scoring.mean([r.residency for r in got if r.kind == 'fact']):.2f}")
            if bar:
                bar.finish()
            if points and arm not in series:
                series[arm] = {"session": sess.id, "points": points}
            walls[arm] += wall
            peaks[arm] = max(peaks[arm], peak)
            rows += got
    if not rows:
        raise ValueError("no finished (session, arm) pair to summarize")
    return summarize(rows, walls, peaks, cfg, series)
