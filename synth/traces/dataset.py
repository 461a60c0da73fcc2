"""Traces → pre-tokenized HF `DatasetDict` (train / validation / test by the traces' split) + dataset card.

Rows (one schema for all kinds):
- `main`: the whole trace; labels = assistant tokens (the distillation mask). Longer than `max_tokens`: the oldest
  tokens are cut (left truncation, `truncated=True`).
- `delete`: pre-masked context up to a boundary + `Memory management mode` + `{"del_cursors": [...]}`.
- `plan`: the same context + `Planning mode` + `{"plan": [...]}`.
  Aux rows longer than `max_tokens` are retried with every expired cursor masked (as the manager would have left
  them); still too long → skipped and counted in the card (their targets would refer to cut cursors).
- `packed` (`pack=True`, instead of the three above): the whole trace with every call at every boundary in one
  sequence and one consistent deletion history (`synth.traces.packed`); longer than `max_tokens` → skipped.
Every row also names its trace's environment (`env`) and per-cursor cues (`cues`, JSON): `synth.traces.decisions` reads
them so the shortcut audit (`synth.traces.audit`) reports per environment and per cue.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsteward.synth.chat import message_texts
from kvsteward.synth.rng import rng
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.blueprint import blueprint_from_reads
from kvsteward.synth.traces.packed import COLUMNS as PACKED_COLUMNS
from kvsteward.synth.traces.packed import packed_row
from kvsteward.synth.traces.tokens import PieceTokenizer, answer_ids, offsets, slot_tokens
from kvsteward.synth.traces.trace import Trace

SPLITS = ("train", "validation", "test")
CARD_JSON, CARD_MD = "card.json", "README.md"


@dataclass
class HindsightConfig:
    every: int = 4
    mask_prob: float = 0.5
    max_tokens: int = 4096
    plan: bool = True
    main: bool = True
    seed: int = 0
    model: str = "smollm2"
    pack: bool = False
    trigger: str = "ids"  # the deletion trigger's layout (`synth.traces.hindsight.delete_trigger`)

    def validate(self) -> None:
        hs.check_trigger_style(self.trigger)
        if self.pack and self.trigger == "scores":
            raise ValueError("--pack writes list-decoder targets: the scores trigger has per-boundary rows only")
        if self.every < 1:
            raise ValueError(f"--every must be >= 1, got {self.every}")
        if not 0 <= self.mask_prob <= 1:
            raise ValueError(f"--mask-prob must be in [0, 1], got {self.mask_prob}")
        if self.max_tokens < 64:
            raise ValueError(f"--max-tokens must be >= 64, got {self.max_tokens}")


def features():
    from datasets import Features, Sequence, Value

    return Features({
        "task_id": Value("string"), "split": Value("string"), "kind": Value("string"), "is_aux": Value("bool"),
        "step": Value("int32"), "input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
        "messages": Value("string"), "open_cursors": Sequence(Value("int32")),
        "masked_cursors": Sequence(Value("int32")), "target": Value("string"), "blueprint": Value("string"),
        "label_source": Value("string"), "n_tokens": Value("int32"), "truncated": Value("bool"),
        # aux rows: where the serving fork starts (the trigger message's first token); 0 on main and packed rows
        "fork_at": Value("int32"),
        # the trace's environment ("" when unknown) and its per-cursor cues as JSON ({"7": "recap_fact"}; "{}" when
        # none): what `synth.traces.decisions` reads to report the shortcut audit per environment and per cue
        "env": Value("string"), "cues": Value("string"),
        # packed rows only (empty elsewhere): see synth/traces/packed.py
        **{k: Sequence(Value("int32")) for k in PACKED_COLUMNS},
    })


def _row(trace: Trace, kind: str, step: int, ids: list[int], labels: list[int], messages: list, **extra) -> dict:
    row = {"task_id": trace.task_id, "split": trace.split, "kind": kind, "is_aux": kind != "main", "step": step,
           "input_ids": ids, "labels": labels, "messages": json.dumps(messages, ensure_ascii=False),
           "open_cursors": [], "masked_cursors": [], "target": "", "blueprint": "",
           "label_source": trace.label_source, "n_tokens": len(ids), "truncated": False, "fork_at": 0,
           "env": trace.env, "cues": json.dumps({str(k): v for k, v in sorted(trace.cues.items())}),
           **{k: [] for k in PACKED_COLUMNS}}
    row.update(extra)
    return row


def main_row(trace: Trace, ptok: PieceTokenizer, max_tokens: int) -> dict:
    steps = {i for i, m in enumerate(trace.messages) if m.get("role") == "assistant"}
    ids, labels, _ = ptok.tokenize(trace.messages, steps)
    starts = offsets(ptok.pieces(trace.messages))
    bp = blueprint_from_reads(trace.reads, trace.cursors(), starts)
    truncated = len(ids) > max_tokens
    if truncated:
        ids, labels = ids[-max_tokens:], labels[-max_tokens:]
    return _row(trace, "main", len(trace.messages), ids, labels, trace.messages, truncated=truncated,
                open_cursors=trace.cursors(), blueprint=json.dumps(bp))


def aux_rows(trace: Trace, ptok: PieceTokenizer, cfg: HindsightConfig) -> tuple[list[dict], int]:
    rows, skipped = [], 0
    for b in hs.boundaries(trace, cfg.every):
        r = rng(cfg.seed, trace.task_id, b)
        built = _aux_at(trace, ptok, cfg, hs.aux_context(trace, b, r, cfg.mask_prob))
        if built is None:  # too long: mask every expired cursor, as a manager that kept up would have
            built = _aux_at(trace, ptok, cfg, hs.aux_context(trace, b, r, cfg.mask_prob, mask_all=True))
        if built is None:
            skipped += 1 + cfg.plan
            continue
        rows.extend(built)
    return rows, skipped


def _aux_at(trace: Trace, ptok: PieceTokenizer, cfg: HindsightConfig, ctx: hs.AuxContext) -> list[dict] | None:
    out = []
    for kind, trigger, target in hs.calls(trace, ctx, cfg.plan, cfg.trigger):
        if kind == "delete" and cfg.trigger == "scores":
            row = _score_row(trace, ptok, cfg, ctx, trigger, target)
            if row is None:
                return None
            out.append(row)
            continue
        msgs = hs.with_trigger(ctx, trigger, target)
        ids, labels, starts = ptok.tokenize(msgs, {len(msgs) - 1})
        if len(ids) > cfg.max_tokens:
            return None
        out.append(_row(trace, kind, ctx.boundary, ids, labels, msgs, open_cursors=ctx.open_cursors,
                        masked_cursors=ctx.masked, target=hs.target_text(target), fork_at=starts[-2]))
    return out


def _score_row(trace: Trace, ptok: PieceTokenizer, cfg: HindsightConfig, ctx: hs.AuxContext, trigger: str,
               target: dict) -> dict | None:
    """A `scores` deletion row: the context and the trigger message, no assistant turn; at the token after each open
    cursor's slot the label is the answer (" no" for an expired cursor, " yes" otherwise), so the loss trains the
    next-token logits at the slot, where the serving fork reads them (`serve.manager.scores`)."""
    msgs = ctx.messages + [{"role": "user", "content": trigger}]
    ids, labels, starts = ptok.tokenize(msgs, set())
    if len(ids) > cfg.max_tokens:
        return None
    text = message_texts(ptok.tokenizer, msgs)[-1]
    slots = slot_tokens(ptok.encode(text)[1], hs.score_slot_ends(text, ctx.open_cursors))
    yes, no = answer_ids(ptok.tokenizer, hs.ANSWERS)
    gone = set(target["del_cursors"])
    for c, k in zip(sorted(ctx.open_cursors), slots, strict=True):
        labels[starts[-1] + k + 1] = no if c in gone else yes
    return _row(trace, "delete", ctx.boundary, ids, labels, msgs, open_cursors=ctx.open_cursors,
                masked_cursors=ctx.masked, target=hs.target_text(target), fork_at=starts[-1])


def pack_rows(trace: Trace, ptok: PieceTokenizer, cfg: HindsightConfig) -> tuple[list[dict], int]:
    """([the packed row], 0), or ([], 1) when it is longer than `max_tokens` ([], 0 without any boundary)."""
    p = packed_row(trace, ptok, cfg.every, cfg.mask_prob, cfg.seed, cfg.plan, cfg.trigger)
    if p is None:
        return [], 0
    if len(p["input_ids"]) > cfg.max_tokens:
        return [], 1
    return [_row(trace, "packed", len(trace.messages), p["input_ids"], p["labels"], trace.messages,
                 open_cursors=trace.cursors(), masked_cursors=sorted(p["dropped_at"]), target=json.dumps(p["calls"]),
                 **{k: p[k] for k in PACKED_COLUMNS})], 0


def build_rows(traces: list[Trace], tokenizer, cfg: HindsightConfig,
               progress: Callable[[int], None] | None = None) -> tuple[list[dict], dict[str, int], dict[str, int]]:
    """(rows, skipped aux rows per split, full token count per trace)."""
    cfg.validate()
    ptok = tokenizer if isinstance(tokenizer, PieceTokenizer) else PieceTokenizer(tokenizer)
    rows, skipped, lengths = [], Counter(), {}
    for n, t in enumerate(traces, start=1):
        t.validate()
        lengths[t.task_id] = offsets(ptok.pieces(t.messages))[-1]
        if cfg.main and not cfg.pack:
            rows.append(main_row(t, ptok, cfg.max_tokens))
        aux, sk = pack_rows(t, ptok, cfg) if cfg.pack else aux_rows(t, ptok, cfg)
        rows.extend(aux)
        skipped[t.split] += sk
        if progress:
            progress(n)
    return rows, dict(skipped), lengths


def build_dataset(traces: list[Trace], tokenizer, cfg: HindsightConfig, progress=None):
    """DatasetDict with one split per trace split (empty splits kept, so downstream code can rely on them)."""
    from datasets import Dataset, DatasetDict

    rows, skipped, lengths = build_rows(traces, tokenizer, cfg, progress)
    unknown = {r["split"] for r in rows} - set(SPLITS)
    if unknown:
        raise ValueError(f"traces carry unknown split(s) {sorted(unknown)}; expected {SPLITS}")
    feats = features()
    # from_dict with explicit features: an empty split still gets every column (from_list([]) would have none).
    dd = DatasetDict({s: Dataset.from_dict({k: [r[k] for r in rows if r["split"] == s] for k in feats},
                                           features=feats) for s in SPLITS})
    return dd, skipped, lengths


def card(traces: list[Trace], dd, skipped: dict[str, int], cfg: HindsightConfig, source: str,
         trace_tokens: dict[str, int]) -> dict[str, Any]:
    """Statistics for the dataset card: tokens and cursors per trace, label balance, label sources."""
    pos = neg = empty = n_del = 0
    for oc, tgt in _delete_calls(dd):
        k = len(json.loads(tgt)["del_cursors"])
        pos, neg, n_del, empty = pos + k, neg + len(oc) - k, n_del + 1, empty + (k == 0)
    toks = list(trace_tokens.values()) or [0]
    curs = [len(t.cursors()) for t in traces] or [0]
    return {
        "source_traces": source, "config": asdict(cfg),
        "traces": {s: sum(t.split == s for t in traces) for s in SPLITS},
        "rows": {s: dict(Counter(dd[s]["kind"])) for s in SPLITS},
        "packed_calls": {s: dict(_calls(dd, s)) for s in SPLITS},
        "skipped_too_long": skipped,
        "tokens_per_trace": {"mean": statistics.mean(toks), "median": statistics.median(toks), "min": min(toks),
                             "max": max(toks)},
        "cursors_per_trace": {"mean": statistics.mean(curs), "min": min(curs), "max": max(curs)},
        "messages_per_trace": {"mean": statistics.mean(len(t.messages) for t in traces) if traces else 0},
        "label_balance": {"open_cursors_marked_delete": pos / max(pos + neg, 1), "delete_rows": n_del,
                          "empty_delete_targets": empty / max(n_del, 1)},
        "label_sources": dict(Counter(t.label_source for t in traces)),
        "envs": dict(Counter(t.env for t in traces)),
    }


def _delete_calls(dd):
    """(open cursors, target text) of every deletion call: delete rows and the delete branches of packed rows."""
    for s in SPLITS:
        for kind, oc, tgt in zip(dd[s]["kind"], dd[s]["open_cursors"], dd[s]["target"], strict=True):
            if kind == "delete":
                yield oc, tgt
            elif kind == "packed":
                yield from ((c["open_cursors"], c["target"]) for c in json.loads(tgt) if c["kind"] == "delete")


def _calls(dd, split: str) -> Counter:
    """Auxiliary calls per kind in `split`, counting the branches of packed rows."""
    n = Counter()
    for kind, tgt in zip(dd[split]["kind"], dd[split]["target"], strict=True):
        if kind == "packed":
            n.update(c["kind"] for c in json.loads(tgt))
    return n


def card_markdown(c: dict[str, Any]) -> str:
    src = ", ".join(f"{k}: {v} traces" for k, v in c["label_sources"].items())
    lines = [
        "# kvsteward hindsight dataset", "",
        f"Built from `{c['source_traces']}`. Label sources — {src}. `oracle` labels come from the generator's "
        "provenance (exact); `planner:*` labels come from a dependency-extraction planner (see docs/synth.md for "
        "their measured precision / recall).", "",
        "| split | traces | main | delete | plan | packed (delete / plan calls) | skipped (too long) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SPLITS:
        r, pc = c["rows"][s], c.get("packed_calls", {}).get(s, {})
        lines.append(f"| {s} | {c['traces'][s]} | {r.get('main', 0)} | {r.get('delete', 0)} | {r.get('plan', 0)} | "
                     f"{r.get('packed', 0)} ({pc.get('delete', 0)} / {pc.get('plan', 0)}) | "
                     f"{c['skipped_too_long'].get(s, 0)} |")
    t, k, lb = c["tokens_per_trace"], c["cursors_per_trace"], c["label_balance"]
    lines += ["", f"Tokens per trace: mean {t['mean']:.0f}, median {t['median']:.0f}, min {t['min']}, max {t['max']}.",
              f"Cursors per trace: mean {k['mean']:.1f}, min {k['min']}, max {k['max']}.",
              f"Label balance: {lb['open_cursors_marked_delete']:.1%} of open cursors in delete rows are targets; "
              f"{lb['empty_delete_targets']:.1%} of delete targets are empty.", "",
              "Config: `" + json.dumps(c["config"]) + "`", ""]
    if c.get("audit"):  # `steward synth audit` (also run by `steward synth hindsight`): kept on every rewrite
        from kvsteward.synth.traces.audit import audit_markdown

        lines += [audit_markdown(c["audit"]), ""]
    return "\n".join(lines)


def save(dd, out: str | Path, card_obj: dict[str, Any]) -> Path:
    from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    out = Path(out)
    was_on = is_progress_bar_enabled()
    disable_progress_bars()  # the CLI shows its own progress; datasets' per-split bars would interleave with it
    try:
        # Explicit shard counts: datasets writes no data file for an empty split unless told to, and then cannot
        # load it back. ~500 MB per shard, as datasets' own default.
        dd.save_to_disk(str(out), num_shards={s: 1 + int(dd[s].data.nbytes // 500e6) for s in dd})
    finally:
        if was_on:
            enable_progress_bars()
    (out / CARD_JSON).write_text(json.dumps(card_obj, indent=2))
    (out / CARD_MD).write_text(card_markdown(card_obj))
    return out


def log_to_mlflow(dd, name: str) -> bool:
    """Log each split as an MLflow dataset input when a run is active; no-op otherwise."""
    import mlflow

    from kvsteward.train.tracking import log_dataset  # the same schema handling as the training run's input

    if mlflow.active_run() is None:
        return False
    for split in SPLITS:
        if len(dd[split]):
            log_dataset(dd[split], f"{name}-{split}", context="training" if split == "train" else split)
    return True
