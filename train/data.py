"""Training data: the pre-tokenized hindsight `DatasetDict` (input_ids, labels, is_aux, kind, ...) and its collator."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk

from kvsteward.synth.traces.dataset import CARD_JSON
from kvsteward.synth.traces.hindsight import unread_cursors
from kvsteward.synth.traces.packed import COLUMNS as PACKED
from kvsteward.synth.traces.packed import NEVER
from kvsteward.synth.traces.toolcall import cursor_id
from kvsteward.train.loss import IGNORE

REQUIRED = ("input_ids", "labels", "is_aux")
# `--adapter-scope` — all: the adapter runs on every token of a row (main rows distilled toward the base model);
# aux: only on the tokens the serving aux thread computes itself (`aux_thread_tokens`), over the base model's K/V.
ADAPTER_SCOPES = ("all", "aux")


class DataError(ValueError):
    """The training dataset is missing, malformed, or empty after filtering."""


def load_splits(path: str | Path) -> DatasetDict:
    """Load a `DatasetDict` saved with `save_to_disk` and check the columns the trainer needs."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"dataset folder {path} does not exist (make it with `steward synth hindsight`)")
    ds = load_from_disk(str(path))
    if isinstance(ds, Dataset):
        raise DataError(f"{path} holds a single Dataset; expected a DatasetDict with a 'train' split")
    if "train" not in ds:
        raise DataError(f"{path} has splits {sorted(ds)}; a 'train' split is required")
    for name, split in ds.items():
        missing = [c for c in REQUIRED if c not in split.column_names]
        if missing:
            raise DataError(f"split {name!r} of {path} lacks columns {missing} (has {split.column_names})")
    return ds


def select_envs(splits: DatasetDict, envs: str) -> DatasetDict:
    """Every split cut to the rows of the comma-separated environments `envs` (`--envs`): a leave-one-environment-out
    run trains and chooses its settings without ever seeing the held-out one. Refuses names the dataset lacks."""
    want = {e.strip() for e in envs.split(",") if e.strip()}
    train = splits["train"]
    if "env" not in train.column_names:
        raise DataError("--envs needs the `env` column: rebuild the dataset with this version of `steward synth "
                        "hindsight`")
    have = set(train["env"])
    if missing := sorted(want - have):
        raise DataError(f"--envs {envs!r}: the train split has no rows of {missing} (it holds {sorted(have)})")
    return DatasetDict({name: split.filter(lambda e: e in want, input_columns="env", desc=f"--envs ({name})")
                        for name, split in splits.items()})


def dataset_trigger(path: str | Path, rows: Dataset | None = None) -> str:
    """The deletion trigger layout a dataset's rows use: from its card (`steward synth hindsight --trigger`), else
    read off the first deletion row's trigger message (`rows`: a notes trigger's second line is the task), else `ids`
    (toy datasets, and those built before the option)."""
    card = Path(path).expanduser() / CARD_JSON
    config = json.loads(card.read_text()).get("config", {}) if card.is_file() else {}
    if "trigger" in config:
        return config["trigger"]
    if rows is not None and "kind" in rows.column_names and "messages" in rows.column_names:
        for kind, messages in zip(rows["kind"], rows["messages"], strict=True):
            msgs = json.loads(messages) if kind == "delete" else []
            if msgs and msgs[-1].get("role") == "user":  # the scores trigger ends its row (no target turn)
                return "scores"
            if len(msgs) >= 2:  # (a test dataset of bare token ids keeps no messages)
                lines = str(msgs[-2].get("content", "")).split("\n")
                return "notes" if len(lines) > 1 and lines[1].startswith("Task: ") else "ids"
    return "ids"


def check_vocab(ds: Dataset, vocab_size: int) -> None:
    """Token ids must index the model's embedding: a dataset tokenized for another model fails here, not deep in C."""
    top = max((max(ids) for ids in ds["input_ids"] if ids), default=-1)
    if top >= vocab_size:
        raise DataError(f"dataset has token id {top} but the model's vocabulary has {vocab_size} entries: "
                        "was it tokenized for another model?")


def fit_length(ds: Dataset, max_len: int) -> tuple[Dataset, Counter, int]:
    """Fit rows to `max_len` tokens the way `steward synth hindsight` does.

    Aux rows that are too long are dropped: cutting the front would lose cursors the JSON target refers to, cutting
    the end would lose the target. Main rows keep their last `max_len` tokens (left truncation): the KL term still
    applies to the remaining assistant tokens, with teacher and student seeing the same shortened context; a main row
    left without any labelled token is dropped. Returns (rows, dropped rows per kind, number of truncated main rows).
    """
    if max_len < 2:
        raise DataError(f"max_len must be ≥ 2, got {max_len}")
    lengths = [len(x) for x in ds["input_ids"]]
    kinds = ds["kind"] if "kind" in ds.column_names else ["aux" if a else "main" for a in ds["is_aux"]]
    aux = ds["is_aux"]
    long_main = {i for i, n in enumerate(lengths) if n > max_len and not aux[i]}
    keep = [i for i, n in enumerate(lengths) if n >= 2 and (n <= max_len or i in long_main)]
    kept = ds.select(keep)

    def cut(row: dict) -> dict:
        if len(row["input_ids"]) > max_len:
            row["input_ids"], row["labels"] = row["input_ids"][-max_len:], row["labels"][-max_len:]
        return row

    if long_main:
        kept = kept.map(cut)
        labelled = [i for i, labels in enumerate(kept["labels"]) if any(t != IGNORE for t in labels)]
        kept = kept.select(labelled)
    kept_ids = set(keep) if not long_main else {keep[i] for i in labelled}
    dropped = Counter(kinds[i] for i in range(len(ds)) if i not in kept_ids)
    if len(kept) == 0:
        raise DataError(f"no row of {len(ds)} fits max_len={max_len} (lengths {min(lengths)}..{max(lengths)}); "
                        "raise --max-len")
    if not any(kept["is_aux"]):
        raise DataError(f"no auxiliary (is_aux) row fits max_len={max_len}: nothing to learn; raise --max-len")
    return kept, dropped, len(long_main & kept_ids)


def row_unread_cursors(row: dict) -> set[int]:
    """The open cursors of a `delete` row that the agent has not read yet (the tool messages at the end of its
    context): what the serving decoder never lists (`keep_unread`)."""
    context = json.loads(row["messages"])[:-2]  # without the trigger and the target
    # pre-masking removed messages, so a context position is not a cursor id: read the id from the `[cursor N]` tag
    return {cursor_id(context[i].get("content", "")) for i in unread_cursors(context)}


def delete_row_difficulty(row: dict) -> str:
    """How a `delete` row's target relates to the rule "delete every open cursor already read":

    - `trivial`: every open cursor is unread (the tool messages at the end of the context, which the next step
      reads): the target is empty, and the serving decoder (`keep_unread`) never even runs here;
    - `easy`: the target is exactly the read open cursors;
    - `hard`: some read cursor is still needed (a fact page a recap restates, a search list after a detour): what a
      manager must learn beyond the rule.
    Other rows: "" (not a deletion row).
    """
    if row.get("kind") != "delete":
        return ""
    unread = row_unread_cursors(row)
    read = sorted(c for c in row["open_cursors"] if c not in unread)
    if not read:
        return "trivial"
    return "easy" if sorted(json.loads(row["target"])["del_cursors"]) == read else "hard"


def weigh_delete_rows(ds: Dataset, hard_weight: int = 1, skip_trivial: bool = False) -> tuple[Dataset, Counter]:
    """The training split with each `hard` deletion row repeated `hard_weight` times and, with `skip_trivial`, the
    `trivial` ones left out (`delete_row_difficulty`); other rows as they are. Returns it and the difficulty counts
    of the input. The Trainer's sampler shuffles, so repeats are spread over the run."""
    if hard_weight < 1:
        raise DataError(f"hard_weight must be >= 1, got {hard_weight}")
    needs = ["kind", "messages", "open_cursors", "target"]
    if not set(needs) <= set(ds.column_names):
        if hard_weight > 1 or skip_trivial:
            raise DataError(f"--hard-weight / --skip-trivial need the hindsight columns {needs}; the dataset has "
                            f"{ds.column_names}")
        return ds, Counter()
    kinds = [delete_row_difficulty(r) for r in ds.select_columns(needs)]
    counts = Counter(k for k in kinds if k)
    if hard_weight == 1 and not skip_trivial:
        return ds, counts
    keep = [i for i, k in enumerate(kinds) for _ in range(hard_weight if k == "hard" else 1)
            if not (skip_trivial and k == "trivial")]
    return ds.select(keep), counts


def tree_mask(segment: torch.Tensor, time: torch.Tensor, expire: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool attention mask of packed rows (True = may attend); the rules are in `synth/traces/packed.py`.

    Query q sees key k iff k ≤ q, k is not padding, k is on the trunk or on q's own branch, and q's time is before
    k's expiry. Padding queries see themselves only (no all-masked softmax row).
    """
    t = segment.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment.device).tril()
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]
    same_branch = (seg_k == 0) | (seg_k == seg_q)
    alive = time[:, :, None] < expire[:, None, :]
    mask = causal & same_branch & alive & valid[:, None, :] & valid[:, :, None]
    mask |= torch.eye(t, dtype=torch.bool, device=segment.device) & ~valid[:, :, None]
    return mask[:, None]


def aux_thread_tokens(rows: list[dict], width: int) -> torch.Tensor:
    """(B, width) bool: the tokens the serving aux thread computes itself, on a fork of the main context — a packed
    row's branches (segment > 0), an aux row's tokens from `fork_at` on (trigger, opener, target); none on a main row.
    Everything else is the main context, which the server computes with the base model (`--adapter-scope aux`)."""
    out = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.get("segment"):
            out[i, :len(r["segment"])] = torch.as_tensor(r["segment"]) > 0
        elif r["is_aux"]:
            out[i, int(r.get("fork_at") or 0):len(r["input_ids"])] = True
    return out


def check_fork_points(ds: Dataset) -> None:
    """`--adapter-scope aux` needs to know where each aux row's fork starts: refuse aux rows without `fork_at`."""
    cols = ds.column_names
    has_fork = "fork_at" in cols
    packed = ds["segment"] if "segment" in cols else [None] * len(ds)
    forks = ds["fork_at"] if has_fork else [0] * len(ds)
    bad = sum(1 for aux, seg, f in zip(ds["is_aux"], packed, forks, strict=True) if aux and not seg and not f)
    if bad:
        raise DataError(f"{bad} aux rows have no fork point (column `fork_at` {'is 0' if has_fork else 'missing'}): "
                        "rebuild the dataset with this version of `steward synth hindsight`, or train with "
                        "--adapter-scope all")


def first_message_rows(ds: Dataset, tokenizer) -> Dataset:
    """`--aux-context first`: every deletion row's context cut to the conversation's first message (in synthesized
    traces the system prompt: the agent's role and tools; the task itself is the notes trigger's `Task:` line), with
    what the chat template puts before it; the trigger, opener and target follow it unchanged, `fork_at` moves to the
    cut, positions renumber (as after pre-masking). Main rows are kept as they are, and so are plan rows: predicting
    future readers needs the session, and the served planner runs on the full fork.

    Why: with the notes trigger every label follows from the trigger's text alone
    (`test_property_the_notes_trigger_alone_decides_every_label`), and under `--adapter-scope aux` the context is
    only a no-grad forward the aux thread attends to. Cut to its first message, a row's length no longer grows with the
    session, so the late boundaries (many open cursors, the recap's fact pages) fit `--max-len` instead of being
    dropped. The cut saves less time than its length suggests: on CPU the aux thread's own tokens, with gradients
    through every adapted layer, cost most of a step. The adapter records the cut (`kvsteward.json`
    `aux_context`), and the server runs its aux thread on the first message alone too
    (`serve.manager.thread.aux_steps`): the served computation is the trained one. Packed rows are refused: their
    branches are defined by the trunk they sit on.
    """
    if "messages" not in ds.column_names:
        raise DataError(f"--aux-context first needs the hindsight column 'messages'; the dataset has "
                        f"{ds.column_names}")
    if "segment" in ds.column_names and any(ds["segment"]):
        raise DataError("--aux-context first cuts per-boundary rows; this dataset holds packed rows (`--pack`)")
    check_fork_points(ds)
    from kvsteward.synth.chat import message_token_ids

    def cut(row: dict, i: int) -> dict:
        if not row["is_aux"] or row.get("kind") == "plan":  # the planner is served on the full fork: trained on it
            return row
        f = int(row["fork_at"])
        first = message_token_ids(tokenizer, json.loads(row["messages"])[:1])[0]
        n = len(first)
        if not 0 < n <= f or list(row["input_ids"][:n]) != first:
            raise DataError(f"aux row {i}: its first {n} tokens are not its first message as this tokenizer writes "
                            "it: was the dataset tokenized for another model?")
        for k in ("input_ids", "labels"):
            row[k] = row[k][:n] + row[k][f:]
        row["fork_at"] = n
        if "n_tokens" in row:
            row["n_tokens"] = len(row["input_ids"])
        return row

    return ds.map(cut, with_indices=True, desc="aux context → first message")


def validation_rows(splits, n: int, max_len: int, adapter_scope: str, seed: int = 0) -> Dataset:
    """The held-out rows scored during training (`--eval-rows`): up to `n` aux rows of the `validation` split (whole
    traces the training split never holds), fitted to `max_len` as the training rows are, in a seeded random order
    (the split lists rows trace by trace; the first `n` would cover a handful of traces). Aux rows only: the score is
    the CE of the manager's decisions, not the distillation term."""
    val = splits["validation"] if "validation" in splits else None
    if val is None or not len(val):
        raise DataError("--eval-rows needs a non-empty 'validation' split (`steward synth hindsight` writes one from "
                        "the traces' validation split)")
    # Aux rows over max_len are dropped, as `fit_length` drops them from training.
    fits = [i for i, (ids, aux) in enumerate(zip(val["input_ids"], val["is_aux"], strict=True))
            if aux and 2 <= len(ids) <= max_len]
    if not fits:
        raise DataError(f"the 'validation' split has no aux row of at most max_len={max_len} tokens to score")
    val = val.select(fits)
    if adapter_scope == "aux":
        check_fork_points(val)
    return val.shuffle(seed=seed).select(range(min(n, len(val))))


@dataclass
class Collator:
    """Right-pads `input_ids` (pad id), `labels` (−100) and `attention_mask` (0); keeps `is_aux` as a bool tensor.

    `aux_tokens` marks the tokens whose labels are CE targets: every labelled token of an aux row, the branch
    tokens of a packed row (its trunk labels are the KL mask, as a main row's). `aux_thread` marks the tokens the
    serving aux thread computes on its fork (`aux_thread_tokens`), `lengths` the unpadded row lengths. A batch with
    a packed row gets a 4-D `attention_mask` (`tree_mask`) and `position_ids`; other rows in it get plain causal
    masks.

    Other columns (kind, messages, ...) are dropped here, which is why the Trainer runs with
    `remove_unused_columns=False`: its own column filter would remove `is_aux` before this sees it.
    """

    pad_id: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            if len(r["labels"]) != n:
                raise DataError(f"row {i}: {n} input_ids but {len(r['labels'])} labels")
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(r["labels"], dtype=torch.long)
            mask[i, :n] = 1
        is_aux = torch.tensor([bool(r["is_aux"]) for r in rows], dtype=torch.bool)
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask, "is_aux": is_aux,
               "aux_tokens": (labels != IGNORE) & is_aux[:, None], "lengths": mask.sum(dim=1),
               "aux_thread": aux_thread_tokens(rows, width)}
        if any(r.get("segment") for r in rows):
            out.update(self._packed(rows, width, mask.bool(), labels, is_aux))
        return out

    @staticmethod
    def _packed(rows: list[dict], width: int, valid: torch.Tensor, labels: torch.Tensor,
                is_aux: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = {k: torch.zeros((len(rows), width), dtype=torch.long) for k in PACKED}
        cols["expire"].fill_(NEVER)
        cols["position_ids"][:] = torch.arange(width)  # unpacked rows and padding: plain positions
        for i, r in enumerate(rows):
            if not r.get("segment"):
                continue
            n = len(r["input_ids"])
            for k in PACKED:
                if len(r[k]) != n:
                    raise DataError(f"row {i}: {n} input_ids but {len(r[k])} {k}")
                cols[k][i, :n] = torch.as_tensor(r[k], dtype=torch.long)
        packed = torch.tensor([bool(r.get("segment")) for r in rows])
        aux = (labels != IGNORE) & torch.where(packed[:, None], cols["segment"] > 0, is_aux[:, None])
        return {"attention_mask": tree_mask(cols["segment"], cols["time"], cols["expire"], valid),
                "position_ids": cols["position_ids"], "aux_tokens": aux}
