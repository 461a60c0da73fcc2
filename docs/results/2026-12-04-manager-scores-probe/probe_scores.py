"""The frozen base model's reading of the `scores` trigger with a local view (issue 45.1 / 45.2): is a response's
fate linearly readable at its slot when the trigger shows the task and the response's own header, and does it add
anything to the structure classifier?

    python probe_scores.py features TRACES OUT.npz SPEC...   # SPEC = env:split:limit[:skip]
    python probe_scores.py fit TRACES TRAIN.npz EVAL.npz[,EVAL2.npz] RESULT.json

features: for every decision of `synth.traces.decisions.decisions_from_trace(trace, 2)` (uncompressed: nothing
deleted before), the session's first message then the `scores` trigger over the open cursors at that boundary, one
forward of SmolLM2 (no adapter); at each read cursor's slot the hidden states of layers 4..28 and the final norm, and
the base model's own P(no) there (the zero-shot arm). fit: every arm on the same decisions (see README.md).
"""

import json
import sys
import time
from collections import defaultdict

import numpy as np
import torch

LAYERS = [4, 8, 12, 16, 20, 24, 28]
D = 576


def features(traces_path: str, out: str, specs: list[str]) -> None:
    from kvsteward.serve.engine import Engine
    from kvsteward.serve.manager.scores import needless, trigger_ids
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.traces.decisions import decisions_from_trace
    from kvsteward.synth.traces.trace import read_traces

    torch.set_num_threads(1)
    traces = read_traces(traces_path)
    chosen = []
    for spec in specs:  # env:split:limit[:skip]
        env, split, limit, *skip = spec.split(":")
        first = int(skip[0]) if skip else 0
        chosen += [t for t in traces if t.env == env and t.split == split][first:first + int(limit)]
    engine = Engine.load("smollm2")
    tok = engine.tokenizer
    captured: dict[int, torch.Tensor] = {}
    for k in LAYERS:
        engine.model.model.layers[k].register_forward_hook(
            lambda m, a, o, k=k: captured.__setitem__(k, (o[0] if isinstance(o, tuple) else o)[0].float().clone()))
    engine.model.model.norm.register_forward_hook(lambda m, a, o: captured.__setitem__(99, o[0].float().clone()))
    feats, labels, zero, meta = [], [], [], []
    heads = {}
    t0 = time.time()
    for n, trace in enumerate(chosen, 1):
        by_boundary = defaultdict(list)
        for d in decisions_from_trace(trace, 2):
            by_boundary[d.boundary].append(d)
        for b, ds in by_boundary.items():
            msgs = trace.messages[:b]
            open_c = sorted(c for c in trace.cursors() if c < b)
            ids, slots = trigger_ids(tok, msgs, open_c)
            first = tuple(message_token_ids(tok, msgs[:1])[0])
            if first not in heads:  # the system prompt is prefilled once per environment, then copied
                heads[first] = engine.session("full", chunk=16384)
                heads[first].append(list(first), kind="system", logits=None)
            s = heads[first].fork()
            captured.clear()
            logits = s.append(ids, kind="user", logits="all")
            p_no = needless(logits, slots, tok)
            for d in ds:
                j = open_c.index(d.cursor)
                feats.append(np.concatenate([captured[k][slots[j]].numpy() for k in LAYERS + [99]]).astype(np.float16))
                labels.append(bool(d.label))
                zero.append(p_no[j])
                meta.append((trace.task_id, trace.env, b, d.cursor, d.cue, trace.split))
        if n % 10 == 0:
            print(f"{n}/{len(chosen)} {time.time() - t0:.0f}s decisions={len(labels)}", flush=True)
    np.savez_compressed(out, x=np.stack(feats), y=np.array(labels), zero=np.array(zero),
                        meta=np.array(meta, dtype=object), layers=np.array(LAYERS + [99]))
    print("done", len(labels), f"{time.time() - t0:.0f}s", flush=True)


def fit(traces_path: str, train_npz: str, eval_npz: str, result: str) -> None:
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.preprocessing import StandardScaler

    from kvsteward.synth.traces.baselines import choose, fit_all, metrics, sweep
    from kvsteward.synth.traces.decisions import decisions_from_trace
    from kvsteward.synth.traces.trace import read_traces

    traces = {t.task_id: t for t in read_traces(traces_path)}
    tr = np.load(train_npz, allow_pickle=True)
    parts = [np.load(f, allow_pickle=True) for f in eval_npz.split(",")]  # feature files extracted side by side
    ev = {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y", "zero", "meta")}
    layers = list(tr["layers"])
    xtr, ytr, mtr = tr["x"].astype(np.float32), tr["y"].astype(bool), tr["meta"]
    xev, yev, mev, zev = ev["x"].astype(np.float32), ev["y"].astype(bool), ev["meta"], ev["zero"]
    train_envs = sorted({m[1] for m in mtr})

    def cols(names):
        return np.concatenate([np.arange(layers.index(n) * D, (layers.index(n) + 1) * D) for n in names])

    def where(envs, split):
        return np.array([m[1] in envs and m[5] == split for m in mev])

    val = where(set(train_envs), "validation")
    sets = {f"{e}_test": where({e}, "test") for e in sorted({m[1] for m in mev})}
    sets["train_envs_validation"] = val

    index = {}
    for tid in {m[0] for m in np.concatenate([mtr, mev])}:
        for d in decisions_from_trace(traces[tid], 2):
            index[(tid, d.boundary, d.cursor)] = d
    dtr = [index[(m[0], m[2], m[3])] for m in mtr]
    dev = [index[(m[0], m[2], m[3])] for m in mev]
    base = fit_all(dtr)

    def pick(scores_val, labels_val):
        rows = sweep(scores_val, labels_val, sorted(set(scores_val.tolist())) + [2.0])
        return choose(rows)["threshold"], (choose(rows, 0.02) or {"threshold": 2.0})["threshold"]

    # the probe: layer set and C chosen on the train environments' validation F1
    best = None
    for names in ([4], [8], [12], [16], [20], [24], [28], [99], [8, 16, 24], [4, 8, 12, 16, 20, 24, 28, 99]):
        c = cols(names)
        sc = StandardScaler().fit(xtr[:, c])
        for C in (0.001, 0.01, 0.1):
            lr = LogisticRegression(C=C, max_iter=3000).fit(sc.transform(xtr[:, c]), ytr)
            s = lr.predict_proba(sc.transform(xev[:, c]))[:, 1]
            f1 = choose(sweep(s[val], yev[val], sorted(set(s[val].tolist())) + [2.0]))["f1"]
            print(f"probe L{names} C={C}: validation F1 {f1:.3f}", flush=True)
            if best is None or f1 > best[0]:
                best = (f1, names, C, s)
    _, names, C, probe = best
    # out-of-fold probe scores on train (folds by trace) for the stack
    c = cols(names)
    groups = np.array([m[0] for m in mtr])
    oof = np.zeros(len(ytr))
    for a, b in GroupKFold(n_splits=5).split(xtr, ytr, groups):
        sc = StandardScaler().fit(xtr[a][:, c])
        oof[b] = LogisticRegression(C=C, max_iter=3000).fit(sc.transform(xtr[a][:, c]), ytr[a]).predict_proba(
            sc.transform(xtr[b][:, c]))[:, 1]
    struct_tr = np.array([d.structure for d in dtr], float)
    struct_ev = np.array([d.structure for d in dev], float)
    gbm = dict(max_iter=200, learning_rate=0.05, max_leaf_nodes=15, random_state=0)
    stack = HistGradientBoostingClassifier(**gbm).fit(np.column_stack([struct_tr, oof]), ytr).predict_proba(
        np.column_stack([struct_ev, probe]))[:, 1]
    zero_tr = tr["zero"]
    stack0 = HistGradientBoostingClassifier(**gbm).fit(np.column_stack([struct_tr, zero_tr]), ytr).predict_proba(
        np.column_stack([struct_ev, zev]))[:, 1]

    arms = {"probe (slot hidden state)": probe, "base model P(no), zero-shot": zev,
            "stack: structure + probe": stack, "stack: structure + P(no)": stack0}
    chosen = {k: pick(v[val], yev[val]) for k, v in arms.items()}
    out = {"probe": {"layers": [int(n) for n in names], "C": C, "validation_f1": best[0]}, "train_envs": train_envs,
           "n_train_decisions": int(len(ytr)), "sets": {}}
    for name, m in sets.items():
        row = {}
        ds = [d for d, k in zip(dev, m, strict=True) if k]
        for bn, b in base.items():
            row[bn] = metrics(yev[m], b.predict(ds, "f1"))
            row[bn + " @safe"] = metrics(yev[m], b.predict(ds, "safe"))
        for an, s in arms.items():
            thr, safe = chosen[an]
            row[an] = metrics(yev[m], s[m] >= thr)
            row[an + " @safe"] = metrics(yev[m], s[m] >= safe)
        out["sets"][name] = {k: {kk: (round(v[kk], 3) if isinstance(v[kk], float) else v[kk])
                                 for kk in ("f1", "harmful_rate", "deleted", "n_decisions")} for k, v in row.items()}
        print(name, json.dumps(out["sets"][name]), flush=True)
    json.dump(out, open(result, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "features":
        features(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        fit(*sys.argv[2:6])
