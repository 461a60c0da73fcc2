"""Learning curve of the chosen probe (layers 8,16,24, C=0.01): train traces 20/40/70/140, threshold on validation."""

import json

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from kvsteward.synth.baselines import choose, metrics, sweep
from kvsteward.synth.trace import read_traces

tr = np.load("train.npz", allow_pickle=True)
ev = np.load("eval.npz", allow_pickle=True)
layers = list(tr["layers"])
D = 576
c = np.concatenate([np.arange(layers.index(n) * D, (layers.index(n) + 1) * D) for n in (8, 16, 24)])
traces = {t.task_id: t for t in read_traces("T11/traces.jsonl")}
xtr, ytr, mtr = tr["x"][:, c].astype(np.float32), tr["y"].astype(bool), tr["meta"]
xev, yev, mev = ev["x"][:, c].astype(np.float32), ev["y"].astype(bool), ev["meta"]


def g(envs, split):
    return np.array([m[1] in envs and traces[m[0]].split == split for m in mev])


val, sup, res = g({"research", "ops"}, "validation"), g({"support"}, "test"), g({"research", "ops"}, "test")
ids = sorted({m[0] for m in mtr}, key=lambda t: (traces[t].env, t))
by_env = {e: [t for t in ids if traces[t].env == e] for e in ("research", "ops")}
out = {}
for n in (10, 20, 35, 70):
    keep = set(by_env["research"][:n] + by_env["ops"][:n])
    m = np.array([x[0] in keep for x in mtr])
    sc = StandardScaler().fit(xtr[m])
    lr = LogisticRegression(C=0.01, max_iter=3000).fit(sc.transform(xtr[m]), ytr[m])
    s = lr.predict_proba(sc.transform(xev))[:, 1]
    thr = choose(sweep(s[val], yev[val], sorted(set(s[val].tolist())) + [2.0]))["threshold"]
    out[2 * n] = {
        k: {kk: round(metrics(yev[v], s[v] >= thr)[kk], 3) for kk in ("f1", "harmful_rate")}
        for k, v in (("val", val), ("in_dist_test", res), ("support_test", sup))
    }
    print(2 * n, "train traces", int(m.sum()), "decisions", json.dumps(out[2 * n]), flush=True)
json.dump(out, open("probe_curve.json", "w"), indent=1)
