"""What the learned memory manager learned: the auxiliary thread run exactly as at serving time, on held-out traces.

For each test trace the main thread replays the trace message by message on the engine (`full` policy: only the
manager removes anything). At every K-th turn boundary (after a tool response, before the next step) the aux thread
forks the main session, appends `Memory management mode`, and decodes `{"del_cursors": [...]}` constrained to the
open cursor ids; the deletion is applied to the main session as a `drop` before the next step. Scored against the
hindsight labels: precision / recall / F1 of deletions, harmful deletions (a deleted cursor that a later step reads),
parse failures (constrained decoding: a decode that hit the token budget before closing counts as one). The same
replay without any deletion is the uncompressed reference for peak resident tokens, KV reads (resident tokens summed
over the decoded assistant tokens) and the final answer: the gold final message is forced up to the first place the
answer value appears in it (usually the restated fact, e.g. "... graduated from "), so the model must copy the value
from a tool response still in its context; scored by greedy text match and by the answer's teacher-forced NLL.
With a plan-trained adapter the same fork in `Planning mode` emits `{"plan": [...]}`: edge recall / precision vs the
trace's future readers.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kvsteward.eval.scoring import appended_gold_nll, mean, text_prefix_match, wilson_interval
from kvsteward.serve.engine import Engine
from kvsteward.serve.manager.decode import AuxDecision
from kvsteward.serve.manager.thread import run_aux
from kvsteward.synth.chat import generation_prompt, message_texts, message_token_ids
from kvsteward.synth.traces.hindsight import PLAN_TRIGGER, boundaries, expired, future_readers, unread_cursors
from kvsteward.synth.traces.trace import Trace

ANSWER_PREFIX = "Final answer: "
HARM_KINDS = ("next_step", "final_answer", "later_step")


def harm_kind(trace: Trace, cursor: int, boundary: int) -> str:
    """Why deleting `cursor` at `boundary` is harmful: which step reads it next (it must read it at or after b)."""
    nxt = min(s for s in trace.readers()[cursor] if s >= boundary)
    if nxt == boundary:  # (also when that step is the final answer: the step right there reads it)
        return "next_step"
    return "final_answer" if nxt == len(trace.messages) - 1 else "later_step"


@dataclass
class Tally:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    harmful: int = 0
    # harmful deletions by the cursor's next reader: the step right after the boundary, the final answer, or another
    # later step (`harm_kind`): where a manager's mistakes come from
    harmful_by_reader: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HARM_KINDS, 0))
    deleted: int = 0
    decisions: int = 0  # read open cursors at the boundaries: what any arm may delete (unread ones are kept)
    # per cue of the trace's generator (`Trace.cues`; "" when none): {"n", "deleted", "tp", "fp", "fn"} over the
    # decisions on cursors of that cue — where a manager's mistakes come from
    by_cue: dict[str, dict[str, int]] = field(default_factory=dict)
    calls: int = 0
    parse_fail: int = 0
    plan_tp: int = 0
    plan_fp: int = 0
    plan_fn: int = 0
    plan_calls: int = 0
    plan_parse_fail: int = 0
    peak: list[int] = field(default_factory=list)
    kv_reads: list[int] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    answer_nll: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        """Count `other`'s traces in too (counts add, per-trace lists extend)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend(theirs)
            elif isinstance(mine, dict):
                for k, v in theirs.items():
                    if isinstance(v, dict):
                        inner = mine.setdefault(k, {})
                        for kk, vv in v.items():
                            inner[kk] = inner.get(kk, 0) + vv
                    else:
                        mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, mine + theirs)


def _kv_reads(resident_before: int, n_decoded: int) -> int:
    # each decoded token reads every resident slot, and the cache grows by one per token
    return n_decoded * resident_before + n_decoded * (n_decoded - 1) // 2


def answer_prefix(final_message: str, gold: str) -> tuple[str, str]:
    """(prefix, answer): the final message up to the first occurrence of the answer value (`Final answer:` if it
    never occurs), and the answer as it follows there. The space before the value belongs to the answer: BPE merges it
    with the value's first word (` Harvard`), so a prefix ending in a space would leave the model a token boundary it
    never sees in text and understate its accuracy."""
    at = final_message.find(gold)
    if at <= 0:
        return ANSWER_PREFIX.rstrip(), " " + gold
    cut = len(final_message[:at].rstrip(" "))
    return final_message[:cut], final_message[cut:at] + gold


def _final_answer(engine: Engine, s, messages: list[dict], final_message: str, gold: str,
                  max_tokens: int) -> tuple[bool, float, int]:
    """(greedy answer matches, gold answer NLL, KV reads of the greedy decode) after the forced prefix."""
    tok = engine.tokenizer
    prefix, answer = answer_prefix(final_message, gold)
    opener = tok.encode(generation_prompt(tok, messages) + prefix, add_special_tokens=False)
    s.append(opener, kind="assistant")
    before = s.resident
    gen = s.fork().generate(max_tokens, stop_ids=engine.stop_ids)
    nll = appended_gold_nll(s, tok.encode(answer, add_special_tokens=False))
    return text_prefix_match(tok.decode(gen, skip_special_tokens=True), gold), nll, _kv_reads(before, len(gen))


def _count_cues(tally: Tally, trace: Trace, decided: list[int], want: set[int], got: set[int]) -> None:
    for c in decided:
        row = tally.by_cue.setdefault(trace.cues.get(c, ""), dict.fromkeys(("n", "deleted", "tp", "fp", "fn"), 0))
        row["n"] += 1
        row["deleted"] += c in got
        row["tp"] += c in got and c in want
        row["fp"] += c in got and c not in want
        row["fn"] += c not in got and c in want


def replay(engine: Engine, trace: Trace, every: int, decide: Callable | None, tally: Tally,
           plan: Callable | None = None, max_answer_tokens: int = 16, session: dict | None = None) -> None:
    """Replay one trace through the main thread, with the manager's deletions (decide) or none (decide=None).
    `session`: `Engine.session` arguments of the main thread (default: the plain `full` session; an arm that reads
    attention scores asks for one that collects them). A trace without an `answer` has no final-answer score."""
    tok = engine.tokenizer
    msgs = trace.messages[:-1]  # the final answer is scored, not replayed
    pieces = message_token_ids(tok, msgs)
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    cuts = set(boundaries(trace, every))
    s = engine.session(chunk=512, **(session or {"policy": "full"}))
    deleted: set[int] = set()
    reads = 0
    for i in range(len(msgs) + 1):  # boundary i is decided before message i (i = len(msgs): before the answer)
        if i in cuts and decide is not None:
            deleted |= _boundary(s, trace, msgs, i, starts, deleted, decide, plan, tally)
        if i == len(msgs):
            break
        msg, ids = msgs[i], pieces[i]
        if msg["role"] == "assistant":
            reads += _kv_reads(s.resident, len(ids))
        s.append(ids, kind=msg["role"], logits="last" if i == len(msgs) - 1 else None)
    final_reads = 0
    if trace.answer and trace.messages[-1].get("role") == "assistant":
        ok, nll, final_reads = _final_answer(engine, s, msgs, trace.messages[-1]["content"], trace.answer,
                                             max_answer_tokens)
        tally.correct.append(ok)
        tally.answer_nll.append(nll)
    tally.peak.append(s.peak_resident)
    tally.kv_reads.append(reads + final_reads)


def _boundary(s, trace: Trace, msgs: list[dict], i: int, starts: list[int], deleted: set[int], decide: Callable,
              plan: Callable | None, tally: Tally) -> set[int]:
    """One aux decision at boundary i, scored against the hindsight labels and applied to the main session as a
    drop; returns the cursors it deleted."""
    open_c = [c for c in trace.cursors() if c < i and c not in deleted]
    d: AuxDecision = decide(s, msgs[:i], open_c)
    want = set(expired(trace, i)) & set(open_c)
    got = set(d.del_cursors)
    unread = set(unread_cursors(msgs[:i]))
    decided = [c for c in open_c if c not in unread]
    tally.decisions += len(decided)
    _count_cues(tally, trace, decided, want, got)
    tally.calls += 1
    tally.parse_fail += int(d.truncated)
    tally.tp += len(got & want)
    tally.fp += len(got - want)
    tally.fn += len(want - got)
    tally.deleted += len(got)
    last_use = trace.last_use()
    harmful = [c for c in got if last_use[c] >= i]
    tally.harmful += len(harmful)
    for c in harmful:
        tally.harmful_by_reader[harm_kind(trace, c, i)] += 1
    if got:
        s.drop([j for c in sorted(got) for j in range(starts[c], starts[c + 1])])
    if plan is not None:
        _score_plan(plan(s, msgs[:i], open_c), trace, i, open_c, tally)
    return got


def _score_plan(text: str | None, trace: Trace, boundary: int, open_c: list[int], tally: Tally) -> None:
    truth = {(c, r) for c, rs in future_readers(trace, boundary).items() if c in open_c for r in rs}
    tally.plan_calls += 1
    try:
        got = {(int(e["cursor"]), int(r)) for e in json.loads(text)["plan"] for r in e["readers"]}
    except (TypeError, ValueError, KeyError):
        tally.plan_parse_fail += 1
        got = set()
    tally.plan_tp += len(got & truth)
    tally.plan_fp += len(got - truth)
    tally.plan_fn += len(truth - got)


def _planner(engine: Engine, use_adapter: bool, max_tokens: int) -> Callable:
    tok = engine.tokenizer

    def plan(main, messages: list[dict], open_c: list[int]) -> str:
        fork = main.fork(shared=True)  # as the server's aux thread forks
        fork.config.use_adapter = use_adapter
        history = messages + [{"role": "user", "content": PLAN_TRIGGER}]
        text = message_texts(tok, history)[-1] + generation_prompt(tok, history)
        fork.append(tok.encode(text, add_special_tokens=False), kind="user")
        return tok.decode(fork.generate(max_tokens, stop_ids=engine.stop_ids), skip_special_tokens=True)

    return plan


def _ratio(a: int, b: int) -> float:
    return a / b if b else float("nan")


def cue_summary(row: dict[str, int]) -> dict:
    """F1 / harmful rate of the decisions on one cue's cursors (`Tally.by_cue`)."""
    tp, fp, fn = row["tp"], row["fp"], row["fn"]
    return {"n_decisions": row["n"], "expired": tp + fn, "deleted": row["deleted"], "harmful": fp,
            "f1": _ratio(2 * tp, 2 * tp + fp + fn), "harmful_rate": _ratio(fp, tp + fp),
            "recall": _ratio(tp, tp + fn)}


def summarize(t: Tally, ref: Tally) -> dict:
    p, r = _ratio(t.tp, t.tp + t.fp), _ratio(t.tp, t.tp + t.fn)
    f1 = 2 * p * r / (p + r) if p + r > 0 else 0.0
    out = {"f1": f1, "precision": p, "recall": r, "harmful_rate": _ratio(t.harmful, t.deleted),
           # how far the rate could be from the truth on this many deletions (95 %): a few traces mislead
           "harmful_rate_ci95": list(wilson_interval(t.harmful, t.deleted)),
           "parse_fail_rate": _ratio(t.parse_fail, t.calls),
           "peak_tokens_reduction": 1 - sum(t.peak) / sum(ref.peak),
           "kv_reads_reduction": 1 - sum(t.kv_reads) / sum(ref.kv_reads),
           "answer_acc": _ratio(sum(t.correct), len(t.correct)),
           "answer_acc_delta": _ratio(sum(t.correct) - sum(ref.correct), len(t.correct)),
           "answer_nll": mean(t.answer_nll) if t.answer_nll else float("nan"),
           "answer_nll_delta": mean(t.answer_nll) - mean(ref.answer_nll) if t.answer_nll else float("nan"),
           "aux_calls": t.calls, "n_decisions": t.decisions,
           "deleted": t.deleted, "harmful": t.harmful, "harmful_by_reader": dict(t.harmful_by_reader),
           "by_cue": {cue: cue_summary(row) for cue, row in sorted(t.by_cue.items())}}
    if t.plan_calls:
        out.update({"plan_edge_recall": _ratio(t.plan_tp, t.plan_tp + t.plan_fn),
                    "plan_edge_precision": _ratio(t.plan_tp, t.plan_tp + t.plan_fp),
                    "plan_parse_fail_rate": _ratio(t.plan_parse_fail, t.plan_calls)})
    return out


# arm name → the arm: a model arm is (use the adapter, close bias, min confidence), the aux decode it replays (min
# confidence None: the greedy list); a non-model arm (`eval.manager.arms.RuleArm`, `AttentionArm`) has `key`, `session`
# and
# `decide(session, messages, open_cursors)`
Arms = dict[str, object]


def arm_key(use_adapter: bool, close_bias: float, min_confidence: float | None = None) -> str:
    """A model arm's name in a journal: what it computes, not what a command calls it (`adapter` in `steward eval
    manager` and `bias 1` in `steward eval calibrate` are the same arm at bias 1)."""
    key = f"{'adapter' if use_adapter else 'base'} at close bias {float(close_bias)!r}"
    return key if min_confidence is None else f"{key}, min confidence {float(min_confidence)!r}"


def spec_key(spec) -> str:
    return arm_key(*spec) if isinstance(spec, tuple) else spec.key


def play_trace(engine: Engine, trace: Trace, every: int, arms: Arms, plan: bool = False, max_aux_tokens: int = 48,
               keep_unread: bool = True, reference: bool = True) -> dict[str, Tally]:
    """One trace replayed uncompressed (`"uncompressed"`, unless `reference` is False) and once per arm: each its
    own tally."""
    tok = engine.tokenizer
    tallies = {arm: Tally() for arm in arms}
    if reference:
        tallies["uncompressed"] = Tally()
        replay(engine, trace, every, None, tallies["uncompressed"])
    for arm, spec in arms.items():
        if not isinstance(spec, tuple):  # a non-model arm: no aux thread, no planner
            replay(engine, trace, every, spec.decide, tallies[arm], session=spec.session)
            continue
        use, bias, conf = spec

        def decide(s, msgs, open_c, use=use, bias=bias, conf=conf):
            return run_aux(s, tok, msgs, open_c, max_tokens=max_aux_tokens, use_adapter=use, close_bias=bias,
                           keep_unread=keep_unread, min_confidence=conf)

        replay(engine, trace, every, decide, tallies[arm], _planner(engine, use, 96) if plan else None)
    return tallies


def play(engine: Engine, traces: list[Trace], every: int, arms: Arms, plan: bool = False,
         max_aux_tokens: int = 48, progress: Callable[[str], None] | None = None,
         keep_unread: bool = True, workers: int = 1, engine_factory: Callable[[], Engine] | None = None,
         journal: str | Path | None = None, journal_key: dict | None = None) -> dict[str, Tally]:
    """Replay every trace once uncompressed and once per arm; an arm is (use the adapter, close bias, min
    confidence). The tallies by arm, plus `"uncompressed"`: the reference every arm is scored against (played once
    per trace, whatever the number of arms).

    `workers` > 1 plays traces in that many processes, each with its own engine from `engine_factory` (picklable;
    it builds what `engine` is); traces are independent and their decodes deterministic, so the result is the serial
    one (merged in trace order). `journal`: a JSONL file of finished replays, by trace and arm — a rerun with the same
    settings (`journal_key` names what else must match, e.g. the model and adapter) plays only what it lacks: a
    killed evaluation resumes where it stopped, and a sweep that adds close biases or confidence thresholds plays
    only the new ones (the reference and the old arms are read back)."""
    keys = {arm: spec_key(spec) for arm, spec in arms.items()}
    settings = {"every": every, "plan": plan, "max_aux_tokens": max_aux_tokens, "keep_unread": keep_unread,
                "aux_context": engine.aux_context, **(journal_key or {})}
    done = open_journal(journal, settings) if journal else {}
    digests = {t.task_id: trace_digest(t) for t in traces}
    have: dict[str, dict[str, Tally]] = {}
    work = []  # (trace, the arms it lacks, whether it lacks the reference)
    for t in traces:
        digest, tallies = done.get(t.task_id, (digests[t.task_id], {}))
        if digest != digests[t.task_id]:
            raise JournalError(f"journal {journal} holds another trace named {t.task_id} (other messages): "
                               "use another journal file for these traces")
        have[t.task_id] = dict(tallies)
        lacks = {arm: spec for arm, spec in arms.items() if keys[arm] not in tallies}
        if lacks or "uncompressed" not in tallies:
            work.append((t, lacks, "uncompressed" not in tallies))
    needed = {"uncompressed", *keys.values()}

    def complete() -> list[dict[str, Tally]]:
        return [h for h in have.values() if needed <= h.keys()]

    def finished(trace: Trace, tallies: dict[str, Tally]) -> None:
        played = {keys.get(arm, arm): t for arm, t in tallies.items()}  # arm names → journal keys
        have[trace.task_id].update(played)
        if journal:
            append_journal(journal, trace.task_id, digests[trace.task_id], played)
        if progress:  # running totals over the traces finished so far (in any order with workers)
            done_now = complete()
            progress(f"trace {len(done_now)}/{len(traces)} ({trace.task_id}): " + ", ".join(
                f"{a} deleted {sum(h[keys[a]].deleted for h in done_now)} "
                f"(harmful {sum(h[keys[a]].harmful for h in done_now)})" for a in arms))

    if done and progress:
        progress(f"journal {journal}: {len(traces) - len(work)} of {len(traces)} traces already played"
                 + (f", {sum(1 for w in work if not w[2])} more in part" if work else ""))
    common = (every, plan, max_aux_tokens, keep_unread)
    if workers > 1 and len(work) > 1:
        _play_in_processes(work, common, workers, engine_factory, finished)
    else:
        for trace, lacks, reference in work:
            finished(trace, play_trace(engine, trace, every, lacks, plan, max_aux_tokens, keep_unread, reference))
    total = {"uncompressed": Tally(), **{arm: Tally() for arm in arms}}
    for trace in traces:  # in trace order: the lists (peak, answers) come out as a serial run's
        h = have[trace.task_id]
        total["uncompressed"].add(h["uncompressed"])
        for arm in arms:
            total[arm].add(h[keys[arm]])
    return total


def _play_in_processes(work: list[tuple[Trace, Arms, bool]], common: tuple, workers: int,
                       engine_factory: Callable[[], Engine] | None,
                       finished: Callable[[Trace, dict[str, Tally]], None]) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    if engine_factory is None:
        raise ValueError("workers > 1 needs an engine_factory: each process loads its own engine")
    threads = max(1, torch.get_num_threads() // workers)
    # spawn, not fork: a forked child of a process whose OpenMP pool has run can hang
    with ProcessPoolExecutor(min(workers, len(work)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(engine_factory, threads)) as pool:
        futures = {pool.submit(_worker_play, trace, lacks, reference, common): trace
                   for trace, lacks, reference in work}
        for f in as_completed(futures):
            finished(futures[f], f.result())


_worker_engine: Engine | None = None


def _worker_init(engine_factory: Callable[[], Engine], threads: int) -> None:
    import threading

    import torch

    global _worker_engine
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(threads)
    _worker_engine = engine_factory()


def _exit_with_parent(parent: int) -> None:
    # A killed (not interrupted) parent leaves its workers running: each would play its trace to the end for nobody.
    # Reparented, a worker sees another parent id and exits.
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _worker_play(trace: Trace, arms: Arms, reference: bool, common: tuple) -> dict[str, Tally]:
    every, plan, max_aux_tokens, keep_unread = common
    return play_trace(_worker_engine, trace, every, arms, plan, max_aux_tokens, keep_unread, reference)


class JournalError(ValueError):
    """A journal that cannot be resumed from (named in the message)."""


def trace_digest(trace: Trace) -> str:
    """What a journal line was played on: task ids alone could name another trace set's traces."""
    return hashlib.sha256(json.dumps([trace.messages, trace.reads], sort_keys=True).encode()).hexdigest()[:16]


def open_journal(path: str | Path, settings: dict) -> dict[str, tuple[str, dict[str, Tally]]]:
    """The replays a journal holds (task id → (trace digest, tallies by `arm_key`)); a new journal gets a header with
    `settings`. A journal written under other settings is refused (naming what differs); a last line cut short by a
    crash is dropped."""
    path = Path(path)
    settings = json.loads(json.dumps(settings))  # as it reads back (tuples → lists)
    text = path.read_text() if path.exists() else ""
    if not text.endswith("\n"):  # a line cut short by a crash: drop it, so the next line starts on its own
        text = text[:text.rfind("\n") + 1]
    if not text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"journal": "kvsteward manager replay", "settings": settings}) + "\n")
        return {}
    if path.stat().st_size != len(text.encode()):
        with path.open("r+") as f:
            f.truncate(len(text.encode()))
    lines = text.splitlines()
    try:
        header = json.loads(lines[0])["settings"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise JournalError(f"{path} is not a manager-replay journal (no settings header)") from e
    differ = sorted(k for k in header.keys() | settings.keys() if header.get(k) != settings.get(k))
    if differ:
        raise JournalError(f"journal {path} was written with other settings ({', '.join(differ)}: "
                           f"{[header.get(k) for k in differ]} there, {[settings.get(k) for k in differ]} now); "
                           "use another journal file")
    out: dict[str, tuple[str, dict[str, Tally]]] = {}
    for row in map(json.loads, lines[1:]):  # a trace's arms may come in several lines (runs that added arms)
        out.setdefault(row["trace"], (row["digest"], {}))[1].update(
            {arm: Tally(**t) for arm, t in row["tallies"].items()})
    return out


def append_journal(path: str | Path, task_id: str, digest: str, tallies: dict[str, Tally]) -> None:
    """One finished trace (`digest`: its `trace_digest`), flushed to disk before the next starts."""
    row = {"trace": task_id, "digest": digest, "tallies": {a: asdict(t) for a, t in tallies.items()}}
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def reference(ref: Tally) -> dict:
    """The uncompressed replay's totals, as the result reports them."""
    return {"answer_acc": _ratio(sum(ref.correct), len(ref.correct)),
            "answer_nll": mean(ref.answer_nll) if ref.answer_nll else float("nan"),
            "peak_tokens": sum(ref.peak), "kv_reads": sum(ref.kv_reads)}


def load_engine(model: str, adapter: str | None = None, aux_context: str | None = None) -> Engine:
    """The engine `steward eval` plays on (`Engine.load`, the adapter's recorded context unless `aux_context`):
    picklable as `functools.partial(load_engine, ...)`, what each process of `play(workers=N)` calls."""
    engine = Engine.load(model, adapter=adapter)
    if aux_context is not None:
        engine.aux_context = aux_context
    return engine


def evaluate(engine: Engine, traces: list[Trace], every: int = 4, arms: tuple[str, ...] = ("base", "adapter"),
             plan: bool = False, max_aux_tokens: int = 48, progress: Callable[[str], None] | None = None,
             close_bias: float | dict[str, float] = 0.0, keep_unread: bool = True,
             min_confidence: float | None | dict[str, float | None] = None, rules: Arms | None = None,
             **parallel) -> dict:
    """Base model vs adapter as the memory manager (and the non-model arms in `rules`, name → `eval.manager.arms` arm,
    on the
    same decisions), against the uncompressed replay of the same traces.
    `close_bias`, `keep_unread`, `min_confidence`: the serving knobs of `AuxConfig` (nats toward closing the deletion
    list; never delete a tool response not read yet; delete only ids listed with this probability, None: the greedy
    list), for both arms; `close_bias` and `min_confidence` may also map each arm to its own.
    `parallel`: `workers`, `engine_factory`, `journal`, `journal_key` of `play`."""
    bias = close_bias if isinstance(close_bias, dict) else dict.fromkeys(arms, close_bias)
    conf = min_confidence if isinstance(min_confidence, dict) else dict.fromkeys(arms, min_confidence)
    specs: Arms = {arm: (arm == "adapter", bias[arm], conf[arm]) for arm in arms} | (rules or {})
    tallies = play(engine, traces, every, specs, plan, max_aux_tokens, progress, keep_unread, **parallel)
    ref = tallies["uncompressed"]
    return {**{arm: summarize(tallies[arm], ref) for arm in specs}, "uncompressed": reference(ref),
            "n_traces": len(traces), "every": every, "close_bias": close_bias, "min_confidence": min_confidence,
            "keep_unread": keep_unread, "aux_context": engine.aux_context}
