"""Cheap non-model deletion baselines: what a surface rule gets from the hindsight labels (`synth.traces.audit`), and
the
evaluation's non-model arms.

Every baseline gives each `Decision` a score (higher = delete) and deletes a cursor when its score reaches a
threshold. `fit` chooses the threshold (and any parameter) on the train decisions at two operating points:
- `f1`: the best F1 on train;
- `safe`: the best F1 among the settings with at most `SAFE_HARMFUL` harmful deletions on train (a harmful deletion
  is a deleted cursor a later step reads: a false positive); `None` when no setting meets it.

- `delete_all_read`: score 1 for every read open cursor; no setting.
- `keep_last_k`: score = recency rank (0 = the most recent read cursor); K in 0..12: keep the K most recent, delete
  the older ones (AKV's rolling rule).
- `text_classifier`: logistic regression on word 1-2-grams of the task, the note and the producing call, plus the
  two positions; C by trace-grouped CV, the threshold on the out-of-fold scores.
- `lexical_overlap`: score = minus the idf-weighted rare words (names, ids, numbers) the body shares with the task;
  keep the cursor above a threshold.
- `structure`: gradient-boosted trees over the decision's structural features (`synth.traces.structure`: identifiers the
  response introduced and whether later agent messages follow them, overlaps with the task and the other open
  responses, positions); no words, so it can carry over to an environment it was not fitted on. The threshold on
  trace-grouped out-of-fold scores.
- `stack`: the same trees over the structural features plus one model feature, a per-response adapter's P(no) for
  the response (`Decision.model_score`, filled by `eval.manager.stack`): does the model's reading add anything to
  structure? Not in `BASELINES` (it needs a model forward per decision); `load_baselines` reads it back.

`fit_on_traces` is the one fit the evaluation's rule arms and a served rule use (uncompressed decisions of the
train traces); the shortcut audit fits on the dataset's rows. `save_baselines` writes a folder (`baselines.json` +
one joblib file per fitted model) that `load_baselines` reads back with identical scores;
`Baseline.decide_at(messages, open_cursors)` is the evaluation replay's decision.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvsteward.eval.scoring import wilson_interval
from kvsteward.synth.traces.decisions import Decision, decisions_at, decisions_from_trace
from kvsteward.synth.traces.planner import _salient
from kvsteward.synth.traces.structure import FEATURES as STRUCTURE_FEATURES

POINTS = ("f1", "safe")
SAFE_HARMFUL = 0.02
INDEX_FILE = "baselines.json"
MAX_K = 12
C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
CV_FOLDS = 5


# --- counting ------------------------------------------------------------------------------------------------------
def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def metrics(labels: Sequence[bool], deleted: Sequence[bool]) -> dict[str, Any]:
    """Pooled deletion metrics of one arm over decisions (None where undefined: no deletion, no positive).
    harmful = deleted but still needed (a false positive), so harmful_rate = 1 - precision, with its Wilson CI;
    accuracy (decisions decided as labelled) is what stays meaningful on a group with no expired cursor."""
    y, p = np.asarray(labels, bool), np.asarray(deleted, bool)
    tp, fp, fn = int((y & p).sum()), int((~y & p).sum()), int((y & ~p).sum())
    return {"f1": _ratio(2 * tp, 2 * tp + fp + fn), "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn),
            "harmful_rate": _ratio(fp, tp + fp), "harmful_rate_ci95": list(wilson_interval(fp, tp + fp)),
            "deleted": tp + fp, "harmful": fp, "n_decisions": len(y), "expired": tp + fn,
            "accuracy": _ratio(len(y) - fp - fn, len(y))}


def sweep(scores: np.ndarray, labels: np.ndarray, thresholds: Sequence[float]) -> list[dict[str, float]]:
    """(threshold, tp, fp, fn, f1, harmful rate) of "delete iff score >= threshold" for each threshold."""
    pos, neg = np.sort(scores[labels]), np.sort(scores[~labels])
    out = []
    for t in thresholds:
        tp = len(pos) - int(np.searchsorted(pos, t, "left"))
        fp = len(neg) - int(np.searchsorted(neg, t, "left"))
        fn = len(pos) - tp
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        out.append({"threshold": float(t), "tp": tp, "fp": fp, "fn": fn, "f1": f1,
                    "harmful_rate": fp / (tp + fp) if tp + fp else 0.0})
    return out


def choose(rows: list[dict[str, float]], max_harmful: float | None = None) -> dict[str, float] | None:
    """The row with the best F1 (ties: the higher threshold, i.e. fewer deletions), among those within
    `max_harmful` harmful deletions when given; None when none is."""
    ok = [r for r in rows if max_harmful is None or r["harmful_rate"] <= max_harmful]
    return max(ok, key=lambda r: (round(r["f1"], 12), r["threshold"])) if ok else None


# --- the interface -------------------------------------------------------------------------------------------------
class Baseline:
    """A fitted scoring rule; subclasses define `scores` and, if they learn anything, `_fit_model` and the state."""

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.points: dict[str, dict[str, Any] | None] = {}  # operating point → {"threshold", "setting", "train"}

    # subclasses --------------------------------------------------------------------------------------------------
    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        raise NotImplementedError

    def _fit_model(self, decisions: Sequence[Decision], labels: np.ndarray) -> np.ndarray:
        """Fit whatever the rule learns; return the train scores the thresholds are chosen on."""
        return self.scores(decisions)

    def _thresholds(self, train_scores: np.ndarray) -> list[float]:
        return sorted({float(s) for s in train_scores}) + [math.inf]

    def _setting(self, threshold: float) -> dict[str, Any]:
        """The operating point in the rule's own terms (the threshold is infinite for "delete nothing")."""
        return {"threshold": threshold} if math.isfinite(threshold) else {"delete_nothing": True}

    def state(self) -> dict[str, Any]:
        """What `save` writes to JSON besides the operating points."""
        return {}

    def _load_state(self, state: dict[str, Any], folder: Path) -> None:
        """Restore what `state` and `_save_files` wrote."""

    def _save_files(self, folder: Path) -> list[str]:
        return []

    # shared ------------------------------------------------------------------------------------------------------
    def fit(self, decisions: Sequence[Decision]) -> Baseline:
        """Fit on labelled train decisions and choose both operating points there."""
        labels = np.array([bool(d.label) for d in decisions], bool)
        if not len(labels) or any(d.label is None for d in decisions):
            raise ValueError(f"{self.name}: fitting needs labelled decisions (got {len(labels)})")
        train = np.asarray(self._fit_model(decisions, labels), float)
        rows = sweep(train, labels, self._thresholds(train))
        for point, cap in (("f1", None), ("safe", SAFE_HARMFUL)):
            r = choose(rows, cap)
            self.points[point] = None if r is None else self._point(r)
        return self

    def _point(self, row: dict[str, float]) -> dict[str, Any]:
        """An operating point as saved: the threshold (None: delete nothing, JSON has no infinity), the setting in
        the rule's own terms, and its train numbers."""
        t = row["threshold"]
        return {"threshold": t if math.isfinite(t) else None, "setting": self._setting(t),
                "train": {"f1": row["f1"], "harmful_rate": row["harmful_rate"], "deleted": row["tp"] + row["fp"]}}

    def threshold(self, point: str = "f1") -> float:
        if point not in POINTS:
            raise ValueError(f"operating point must be one of {POINTS}, got {point!r}")
        if not self.points:
            raise RuntimeError(f"{self.name} is not fitted")
        chosen = self.points[point]  # None: no setting met the safe point's cap; threshold None: delete nothing
        return math.inf if chosen is None or chosen["threshold"] is None else float(chosen["threshold"])

    def predict(self, decisions: Sequence[Decision], point: str = "f1") -> np.ndarray:
        """Per decision: delete it (bool)."""
        return self.scores(decisions) >= self.threshold(point) if len(decisions) else np.zeros(0, bool)

    def delete(self, decisions: Sequence[Decision], point: str = "f1") -> set[int]:
        """The cursors to delete among the decisions of one boundary."""
        return {d.cursor for d, x in zip(decisions, self.predict(decisions, point), strict=True) if x}

    def decide_at(self, messages: list[dict], open_cursors: Iterable[int], point: str = "f1") -> set[int]:
        """The deletion at the end of `messages` (indexed as the cursor ids): `eval.manager.evaluate.replay`'s
        decision."""
        return self.delete(decisions_at(messages, open_cursors, len(messages)), point)

    def save(self, folder: Path) -> dict[str, Any]:
        """Write this baseline's files under `folder`; return its index entry."""
        return {"points": self.points, "state": self.state(), "files": self._save_files(folder)}

    @classmethod
    def load(cls, entry: dict[str, Any], folder: Path) -> Baseline:
        b = cls()
        b.points = entry["points"]
        b._load_state(entry.get("state", {}), folder)
        return b


class DeleteAllRead(Baseline):
    """Delete every read open cursor: the rule hindsight labels reduce to when nothing is re-read."""

    name = "delete_all_read"

    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        return np.ones(len(decisions))

    def _thresholds(self, train_scores: np.ndarray) -> list[float]:
        return [1.0]

    def _setting(self, threshold: float) -> dict[str, Any]:
        return {}


class KeepLastK(Baseline):
    """Keep the K most recent read cursors and delete the older ones (AKV's rolling window), K chosen on train."""

    name = "keep_last_k"

    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        return np.array([d.recency for d in decisions], float)

    def _thresholds(self, train_scores: np.ndarray) -> list[float]:
        return [float(k) for k in range(MAX_K + 1)]

    def _setting(self, threshold: float) -> dict[str, Any]:
        return {"K": int(threshold)}


class LexicalOverlap(Baseline):
    """Keep a cursor whose body shares enough rare words (names, ids, numbers; idf-weighted) with the task: a
    "still relevant to the question" rule that reads content but not the agent's progress."""

    name = "lexical_overlap"

    def __init__(self) -> None:
        super().__init__()
        self.idf: dict[str, float] = {}
        self.n_docs = 0

    def _fit_model(self, decisions: Sequence[Decision], labels: np.ndarray) -> np.ndarray:
        bodies = {(d.trace_id, d.cursor): _salient(d.body) for d in decisions}  # each response counted once
        df: dict[str, int] = {}
        for words in bodies.values():
            for w in words:
                df[w] = df.get(w, 0) + 1
        self.n_docs = len(bodies)
        self.idf = {w: self._idf(n) for w, n in df.items()}
        return self.scores(decisions)

    def _idf(self, df: int) -> float:
        return math.log((1 + self.n_docs) / (1 + df)) + 1  # sklearn's smooth idf: unseen words weigh the most

    def overlap(self, d: Decision) -> float:
        unseen = self._idf(0)
        return sum(self.idf.get(w, unseen) for w in _salient(d.body) & _salient(d.task))

    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        return -np.array([self.overlap(d) for d in decisions], float)

    def _setting(self, threshold: float) -> dict[str, Any]:
        return {"keep_if_overlap_above": 0.0 - threshold} if math.isfinite(threshold) else {"delete_nothing": True}

    def state(self) -> dict[str, Any]:
        return {"idf": self.idf, "n_docs": self.n_docs}

    def _load_state(self, state: dict[str, Any], folder: Path) -> None:
        self.idf, self.n_docs = dict(state["idf"]), int(state["n_docs"])


TEXT_FIELDS = ("task", "note", "call")
POSITION_FIELDS = ("steps_since", "recency")


def decision_frame(decisions: Sequence[Decision]):
    """The classifier's input table: the trigger-style text fields and the position features (clipped for the
    one-hot, log-scaled for the linear term)."""
    import pandas as pd

    rows = {f: [getattr(d, f) for d in decisions] for f in TEXT_FIELDS}
    for f in POSITION_FIELDS:
        vals = np.array([getattr(d, f) for d in decisions], float)
        rows[f"{f}_bin"] = np.minimum(vals, 15).astype(int).astype(str)
        rows[f"{f}_log"] = np.log1p(vals)
    return pd.DataFrame(rows)


def _featurizer():
    """Each text field in its own n-gram space (namespaced), plus the positions one-hot and log-scaled.

    Binary n-gram presence, not tf-idf: held-out traces have their own entity names (each split has its own world),
    which are out of vocabulary there; with a length-normalized tf-idf the remaining generic words would then weigh
    more than in training and shift every score (on `templated`: validation F1 0.86, or 0.93 with in-fold
    vocabularies, vs 0.98)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    text = [(f, CountVectorizer(ngram_range=(1, 2), binary=True, min_df=2, token_pattern=r"(?u)\b\w+\b"), f)
            for f in TEXT_FIELDS]
    return ColumnTransformer(text + [
        ("positions", OneHotEncoder(handle_unknown="ignore"), [f"{f}_bin" for f in POSITION_FIELDS]),
        ("scaled", StandardScaler(), [f"{f}_log" for f in POSITION_FIELDS])])


class TextClassifier(Baseline):
    """Logistic regression over word 1-2-grams of what the `notes` trigger shows beside a cursor id (`Task:` + the
    task, the cursor's note, its producing call) and its two positions. C is chosen by F1 of out-of-fold scores
    (folds grouped by trace, so no trace is on both sides), the thresholds on those same out-of-fold scores."""

    name = "text_classifier"
    model_file = "text_classifier.joblib"

    def __init__(self) -> None:
        super().__init__()
        self.model = None  # sklearn Pipeline (featurizer, LogisticRegression), or None: a constant score
        self.constant = 0.0
        self.C: float | None = None
        self.cv_f1: dict[str, float] = {}

    def _fit_model(self, decisions: Sequence[Decision], labels: np.ndarray) -> np.ndarray:
        from sklearn.pipeline import make_pipeline

        groups = [d.trace_id for d in decisions]
        n_folds = min(CV_FOLDS, len(set(groups)))
        if labels.all() or not labels.any() or n_folds < 2:  # one class, or too few traces to cross-validate
            self.model, self.constant = None, float(labels.mean())
            return self.scores(decisions)
        frame = decision_frame(decisions)
        folds = self._folds(frame, labels, groups, n_folds)
        best: tuple[float, float, np.ndarray] | None = None
        for c in C_GRID:
            oof = self._out_of_fold(folds, labels, c)
            f1 = choose(sweep(oof, labels, sorted(set(oof.tolist())) + [math.inf]))["f1"]
            self.cv_f1[repr(c)] = f1
            if best is None or f1 > best[0] + 1e-12:
                best = (f1, c, oof)
        _, self.C, oof = best
        self.model = make_pipeline(_featurizer(), self._lr(self.C)).fit(frame, labels)
        return oof

    @staticmethod
    def _folds(frame, labels: np.ndarray, groups: list[str], n_folds: int) -> list[tuple]:
        """(train rows, held-out rows, their features) per fold, grouped by trace; the featurizer is fitted on the
        fold's train rows only, so held-out entity names are out of vocabulary as on a real held-out split."""
        from sklearn.model_selection import GroupKFold

        out = []
        for tr, te in GroupKFold(n_splits=n_folds).split(frame, labels, groups):
            feats = _featurizer()
            out.append((tr, te, feats.fit_transform(frame.iloc[tr]), feats.transform(frame.iloc[te])))
        return out

    @staticmethod
    def _lr(c: float):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=c, max_iter=2000, solver="liblinear", random_state=0)  # liblinear shuffles

    def _out_of_fold(self, folds: list[tuple], labels: np.ndarray, c: float) -> np.ndarray:
        oof = np.zeros(len(labels))
        for tr, te, x_tr, x_te in folds:
            if labels[tr].all() or not labels[tr].any():
                oof[te] = labels[tr].mean()
                continue
            oof[te] = self._lr(c).fit(x_tr, labels[tr]).predict_proba(x_te)[:, 1]
        return oof

    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        if self.model is None:
            return np.full(len(decisions), self.constant)
        if not len(decisions):
            return np.zeros(0)
        return self.model.predict_proba(decision_frame(decisions))[:, 1]

    def _setting(self, threshold: float) -> dict[str, Any]:
        return {"C": self.C, **super()._setting(threshold)}

    def state(self) -> dict[str, Any]:
        return {"C": self.C, "constant": self.constant, "cv_f1": self.cv_f1, "has_model": self.model is not None}

    def _save_files(self, folder: Path) -> list[str]:
        import joblib

        if self.model is None:
            (folder / self.model_file).unlink(missing_ok=True)  # a constant score: no stale model left to load
            return []
        joblib.dump(self.model, folder / self.model_file)
        return [self.model_file]

    def _load_state(self, state: dict[str, Any], folder: Path) -> None:
        import joblib

        self.C, self.constant, self.cv_f1 = state.get("C"), float(state.get("constant", 0.0)), state.get("cv_f1", {})
        self.model = joblib.load(folder / self.model_file) if state.get("has_model") else None


class StructureClassifier(Baseline):
    """Gradient-boosted trees (scikit-learn's HistGradientBoostingClassifier) over each decision's structural
    features (`synth.traces.structure`: identifiers introduced / followed / pending, overlaps with the task and the
    other
    open responses, positions) — no words, so nothing ties it to one environment's vocabulary. Its settings are
    fixed (200 trees of 15 leaves, learning rate 0.05); the thresholds are chosen on out-of-fold scores (folds
    grouped by trace), as the text classifier's."""

    name = "structure"
    model_file = "structure.joblib"
    params: ClassVar[dict[str, Any]] = {"max_iter": 200, "learning_rate": 0.05, "max_leaf_nodes": 15,
                                        "random_state": 0}

    def __init__(self) -> None:
        super().__init__()
        self.model = None  # a fitted HistGradientBoostingClassifier, or None: a constant score
        self.constant = 0.0

    @classmethod
    def _gbm(cls):
        from sklearn.ensemble import HistGradientBoostingClassifier

        return HistGradientBoostingClassifier(**cls.params)

    @staticmethod
    def _matrix(decisions: Sequence[Decision]) -> np.ndarray:
        x = np.array([d.structure for d in decisions], float)
        if x.ndim != 2 or x.shape[1] != len(STRUCTURE_FEATURES):
            raise ValueError(f"structure: decisions carry {x.shape[-1] if x.ndim == 2 else 0} structural features, "
                             f"expected {len(STRUCTURE_FEATURES)} (built by synth.traces.decisions.decisions_at)")
        return x

    def _fit_model(self, decisions: Sequence[Decision], labels: np.ndarray) -> np.ndarray:
        from sklearn.model_selection import GroupKFold

        groups = [d.trace_id for d in decisions]
        n_folds = min(CV_FOLDS, len(set(groups)))
        if labels.all() or not labels.any() or n_folds < 2:
            self.model, self.constant = None, float(labels.mean())
            return self.scores(decisions)
        x = self._matrix(decisions)
        oof = np.zeros(len(labels))
        for tr, te in GroupKFold(n_splits=n_folds).split(x, labels, groups):
            if labels[tr].all() or not labels[tr].any():
                oof[te] = labels[tr].mean()
                continue
            oof[te] = self._gbm().fit(x[tr], labels[tr]).predict_proba(x[te])[:, 1]
        self.model = self._gbm().fit(x, labels)
        return oof

    def scores(self, decisions: Sequence[Decision]) -> np.ndarray:
        if self.model is None:
            return np.full(len(decisions), self.constant)
        if not len(decisions):
            return np.zeros(0)
        return self.model.predict_proba(self._matrix(decisions))[:, 1]

    def state(self) -> dict[str, Any]:
        return {"params": self.params, "features": list(STRUCTURE_FEATURES), "constant": self.constant,
                "has_model": self.model is not None}

    def _save_files(self, folder: Path) -> list[str]:
        import joblib

        if self.model is None:
            (folder / self.model_file).unlink(missing_ok=True)
            return []
        joblib.dump(self.model, folder / self.model_file)
        return [self.model_file]

    def _load_state(self, state: dict[str, Any], folder: Path) -> None:
        import joblib

        if state.get("features", list(STRUCTURE_FEATURES)) != list(STRUCTURE_FEATURES):
            raise ValueError(f"{folder}: the structure baseline was fitted on other features "
                             f"({state.get('features')}); refit it (`steward synth audit`)")
        self.constant = float(state.get("constant", 0.0))
        self.model = joblib.load(folder / self.model_file) if state.get("has_model") else None


class StackClassifier(StructureClassifier):
    """The structure classifier's trees with the per-response adapter's P(no) as one more feature (a stacked head):
    same settings, thresholds on trace-grouped out-of-fold scores, so it and `structure` differ only by that column.
    Every decision it scores must carry `model_score` (`eval.manager.stack.scored_decisions`)."""

    name = "stack"
    model_file = "stack.joblib"
    MODEL_FEATURE = "adapter_p_no"

    @classmethod
    def features(cls) -> list[str]:
        return [*STRUCTURE_FEATURES, cls.MODEL_FEATURE]

    @staticmethod
    def _matrix(decisions: Sequence[Decision]) -> np.ndarray:
        missing = sum(d.model_score is None for d in decisions)
        if missing:
            raise ValueError(f"stack: {missing} of {len(decisions)} decisions carry no model score (score them with "
                             "the per-response adapter: eval.manager.stack.scored_decisions)")
        x = StructureClassifier._matrix(decisions)
        return np.column_stack([x, np.array([d.model_score for d in decisions], float)])

    def state(self) -> dict[str, Any]:
        return super().state() | {"features": self.features()}

    def _load_state(self, state: dict[str, Any], folder: Path) -> None:
        import joblib

        if state.get("features") != self.features():
            raise ValueError(f"{folder}: the stack head was fitted on other features ({state.get('features')})")
        self.constant = float(state.get("constant", 0.0))
        self.model = joblib.load(folder / self.model_file) if state.get("has_model") else None


BASELINES: dict[str, type[Baseline]] = {b.name: b for b in (DeleteAllRead, KeepLastK, TextClassifier,
                                                             LexicalOverlap, StructureClassifier)}
# what a baselines folder may hold: the cheap rules and the stacked head (fitted where a model scored the decisions)
RULE_CLASSES: dict[str, type[Baseline]] = BASELINES | {StackClassifier.name: StackClassifier}


def fit_all(train: Sequence[Decision], names: Iterable[str] = BASELINES) -> dict[str, Baseline]:
    """Every baseline (or those named) fitted on the train decisions."""
    return {n: BASELINES[n]().fit(train) for n in names}


def fit_on_traces(traces: Sequence, every: int, names: Iterable[str] = BASELINES) -> dict[str, Baseline]:
    """The one fit of the rule arms (`steward eval manager`, `steward eval choose`, the served rule): every decision
    of the train traces at their `every`-th boundaries with nothing deleted before (`decisions_from_trace`).
    Why not the dataset's pre-masked rows: a replay decides on the session as its own earlier deletions left it,
    which random pre-masking does not reproduce, and on an unseen agent family the row fit fell to chance (AUC 0.49)
    where this one kept its signal (0.61). The shortcut audit (`synth.traces.audit`) still fits on the rows: it asks
    what the dataset itself gives away."""
    decisions = [d for t in traces for d in decisions_from_trace(t, every)]
    if not decisions:
        raise ValueError(f"no read tool response at any {every}-th boundary of the {len(traces)} fit traces")
    return fit_all(decisions, names)


def save_baselines(baselines: dict[str, Baseline], folder: str | Path) -> Path:
    """`folder/baselines.json` (operating points, settings, small state) plus each baseline's model files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = {"version": 1, "safe_harmful": SAFE_HARMFUL,
             "baselines": {n: {"class": b.name, **b.save(folder)} for n, b in baselines.items()}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return folder / INDEX_FILE


def load_baselines(folder: str | Path) -> dict[str, Baseline]:
    """The fitted baselines `save_baselines` wrote to `folder`."""
    folder = Path(folder)
    if not (folder / INDEX_FILE).is_file():
        raise FileNotFoundError(f"no fitted baselines at {folder} (expected {INDEX_FILE}: `steward synth audit`)")
    index = json.loads((folder / INDEX_FILE).read_text())
    out = {}
    for n, entry in index["baselines"].items():
        if entry["class"] not in RULE_CLASSES:
            raise ValueError(f"{folder / INDEX_FILE}: unknown baseline {entry['class']!r}")
        out[n] = RULE_CLASSES[entry["class"]].load(entry, folder)
    return out
