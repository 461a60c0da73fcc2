"""Decision-level validation: the served decoder on held-out deletion rows (`steward train lora --eval-rows`).

The validation CE (`eval_loss`) is teacher-forced and mixes the format tokens and the ids every manager deletes with
the few tokens that decide; two adapters were measured where the lower CE was the worse manager. This scores
what the server does instead: per row, the context before `fork_at` through the base model, then the adapter on the
trigger, the forced opener and a greedy decode constrained to the open cursors that have been read (`serve.manager`'s
own decoder, `keep_unread`), compared with the row's hindsight target. A false positive on a per-boundary row is a
cursor that a later step reads, i.e. a harmful deletion, so `precision` is 1 − the rows' harmful rate.

The rows' own tokens are used (positions renumbered after pre-masking, as the trainer sees them), not a replay of the
trace: what is scored is exactly what is trained. `steward eval manager` remains the end-to-end measure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from datasets import Dataset

from kvsteward.train.data import DataError, row_unread_cursors
from kvsteward.train.loss import IGNORE

NEEDS = ("input_ids", "labels", "kind", "messages", "open_cursors", "target", "fork_at")  # the columns read here


@dataclass(frozen=True)
class DecisionRow:
    context: list[int]  # tokens before fork_at: the main thread (base model)
    trigger: list[int]  # fork_at up to the first target token: trigger message + generation prompt (adapter)
    deletable: list[int]  # open cursors the decoder may list (read ones)
    target: frozenset[int]
    # `scores` rows (no decode): each open cursor's slot in `trigger` (ascending cursor order), where the per-response
    # decision reads P(no) (`serve.manager.scores`); empty for list-decoder rows
    open_cursors: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()


def decision_rows(ds: Dataset, tokenizer) -> list[DecisionRow]:
    """The per-boundary deletion rows of `ds` as decoder inputs; refuses rows the served decoder cannot replay."""
    from kvsteward.serve.manager.decode import PREFIX

    missing = [c for c in NEEDS if c not in ds.column_names]
    if missing:
        raise DataError(f"decision validation needs the hindsight columns {missing}: rebuild the dataset with this "
                        "version of `steward synth hindsight`")
    opener = tokenizer.encode(PREFIX, add_special_tokens=False)
    out = []
    for i, r in enumerate(ds.select_columns(list(NEEDS) + (["segment"] if "segment" in ds.column_names else []))):
        if r.get("segment"):
            raise DataError("decision validation scores per-boundary rows; packed rows (`--pack`) hold many calls "
                            "each: score them with `steward eval manager`")
        if r["kind"] != "delete":
            continue
        ids, labels, fork = r["input_ids"], r["labels"], int(r["fork_at"] or 0)
        unread = row_unread_cursors(r)
        deletable = [c for c in r["open_cursors"] if c not in unread]
        target = frozenset(json.loads(r["target"])["del_cursors"])
        if json.loads(r["messages"])[-1].get("role") == "user":  # a `scores` row: the trigger ends it, no target turn
            slots = tuple(k - 1 - fork for k, y in enumerate(labels) if y != IGNORE)
            if not fork or len(slots) != len(r["open_cursors"]) or min(slots, default=0) < 0:
                raise DataError(f"validation row {i}: a scores row needs one labelled slot per open cursor after "
                                f"fork_at={fork} (got {len(slots)} for {len(r['open_cursors'])})")
            out.append(DecisionRow(ids[:fork], ids[fork:], deletable, target, tuple(sorted(r["open_cursors"])),
                                   slots))
            continue
        gen = next((k for k, y in enumerate(labels) if y != IGNORE), None)
        if not fork or gen is None or not fork < gen:
            raise DataError(f"validation row {i}: no fork point before its target (fork_at={fork}, first target "
                            f"token {gen})")
        if ids[gen:gen + len(opener)] != opener:
            raise DataError(f"validation row {i}: its target does not start with the serving opener {PREFIX!r} "
                            "(a dataset tokenized for another decoder?)")
        out.append(DecisionRow(ids[:fork], ids[fork:gen], deletable, target))
    return out


def decide(engine, row: DecisionRow, max_tokens: int = 64) -> list[int]:
    """The served aux thread's greedy decision on one row: context on the base model, the rest with the adapter."""
    from kvsteward.serve.manager.decode import constrained_del_cursors

    if not row.deletable:  # the server answers "delete nothing" without a forward here
        return []
    main = engine.session("full")
    main.append(row.context, kind="user", logits=None)
    fork = main.fork(shared=True)
    fork.config.use_adapter = True
    if row.slots:
        from kvsteward.serve.manager.scores import deletions, needless

        logits = fork.append(row.trigger, kind="user", logits="all")
        p_no = dict(zip(row.open_cursors, needless(logits, list(row.slots), engine.tokenizer), strict=True))
        return deletions(p_no, row.deletable)
    fork.append(row.trigger, kind="user", logits="last")
    return constrained_del_cursors(fork, engine.tokenizer, row.deletable, max_tokens).del_cursors


def score(engine, rows: list[DecisionRow]) -> dict[str, float]:
    """Pooled precision / recall / F1 of the decoded deletions against the targets, and how many were deleted.
    With no deletion at all precision is 0 (a manager that never deletes is not a precise one)."""
    tp = fp = fn = 0
    for row in rows:
        got = set(decide(engine, row))
        tp += len(got & row.target)
        fp += len(got - row.target)
        fn += len(row.target - got)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
    return {"f1": f1, "precision": precision, "recall": recall, "deleted": float(tp + fp)}
