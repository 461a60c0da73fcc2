"""Pilot analysis: logistic-regression probe on the features vs the cheap baselines, same decisions."""

import json
import sys
from collections import defaultdict

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from kvsteward.synth.baselines import choose, fit_all, metrics, sweep
from kvsteward.synth.decisions import decisions_from_trace
from kvsteward.synth.trace import read_traces

tr = np.load("train.npz", allow_pickle=True)
ev = np.load("eval.npz", allow_pickle=True)
layers = list(tr["layers"])
D = 576
traces = {t.task_id: t for t in read_traces("T11/traces.jsonl")}


def cols(names):
    idx = [layers.index(n) for n in names]
    return np.concatenate([np.arange(i * D, (i + 1) * D) for i in idx])


def group(meta, envs, split):
    return np.array([m[1] in envs and traces[m[0]].split == split for m in meta])


xtr, ytr, mtr = tr["x"].astype(np.float32), tr["y"].astype(bool), tr["meta"]
xev, yev, mev = ev["x"].astype(np.float32), ev["y"].astype(bool), ev["meta"]
val = group(mev, {"research", "ops"}, "validation")
sets = {
    "support_test": group(mev, {"support"}, "test"),
    "research_test": group(mev, {"research"}, "test"),
    "ops_test": group(mev, {"ops"}, "test"),
    "support_val": group(mev, {"support"}, "validation"),
}

# baselines on the same decisions
train_dec = [
    d
    for t in traces.values()
    if t.env in ("research", "ops") and t.split == "train"
    for d in decisions_from_trace(t, 2)
]
base = fit_all(train_dec)
dec_index = {}
for tid in {m[0] for m in mev}:
    for d in decisions_from_trace(traces[tid], 2):
        dec_index[(tid, d.boundary, d.cursor)] = d
evdec = [dec_index[(m[0], m[2], m[3])] for m in mev]

res = {}
best = None
for names in (
    [4],
    [8],
    [12],
    [16],
    [20],
    [24],
    [28],
    [99],
    [8, 16],
    [12, 20],
    [8, 16, 24],
    [4, 8, 12, 16, 20, 24, 28, 99],
):
    c = cols(names)
    sc = StandardScaler().fit(xtr[:, c])
    for C in (0.001, 0.01, 0.1):
        lr = LogisticRegression(C=C, max_iter=3000).fit(sc.transform(xtr[:, c]), ytr)
        s = lr.predict_proba(sc.transform(xev[:, c]))[:, 1]
        rows = sweep(s[val], yev[val], sorted(set(s[val].tolist())) + [2.0])
        r = choose(rows)
        safe = choose(rows, 0.02)
        key = f"L{names} C={C}"
        res[key] = (r["f1"], r["threshold"], safe and safe["threshold"], s)
        print(key, "val f1", round(r["f1"], 3), "harm", round(r["harmful_rate"], 3), flush=True)
        if best is None or r["f1"] > res[best][0]:
            best = key
print("best on validation:", best)
f1v, thr, thr_safe, s = res[best]
out = {"best": best}
for name, m in list(sets.items()) + [("val", val)]:
    row = {"probe": metrics(yev[m], s[m] >= thr)}
    if thr_safe is not None:
        row["probe_safe"] = metrics(yev[m], s[m] >= thr_safe)
    ds = [d for d, k in zip(evdec, m, strict=True) if k]
    for bn, b in base.items():
        row[bn] = metrics(yev[m], b.predict(ds, "f1"))
    out[name] = {
        k: {
            kk: (round(v[kk], 3) if isinstance(v[kk], float) else v[kk])
            for kk in ("f1", "harmful_rate", "deleted", "n_decisions")
        }
        for k, v in row.items()
    }
    print(name, json.dumps(out[name]))
    # per cue for probe vs delete_all_read
    cue = defaultdict(lambda: [0, 0, 0])
    for i in np.where(m)[0]:
        k = mev[i][4]
        cue[k][0] += 1
        cue[k][1] += int(yev[i])
        cue[k][2] += int(s[i] >= thr and not yev[i])
    print("  per cue (n, expired, probe harmful):", dict(cue))
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "probe_result.json", "w"), indent=1)
