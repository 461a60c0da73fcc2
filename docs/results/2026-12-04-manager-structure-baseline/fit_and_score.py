"""Every cheap baseline (synth.baselines.fit_all, `structure` included) fitted on train decisions and scored on the
test decisions of each environment: in distribution (fitted on all three environments) and held out (fitted on the
other two). Decisions at every 2nd tool response of uncompressed traces (`decisions_from_trace`).

python fit_and_score.py TRACES OUT.json [TRAIN_TRACES_PER_ENV]
"""

import json
import sys
import time

import numpy as np

from kvsteward.synth.baselines import BASELINES, fit_all, metrics
from kvsteward.synth.decisions import decisions_from_trace
from kvsteward.synth.trace import read_traces

ENVS = ("research", "ops", "support")
KEYS = ("f1", "precision", "recall", "harmful_rate", "harmful_rate_ci95", "deleted", "harmful", "expired",
        "n_decisions")
traces = read_traces(sys.argv[1])
n_train = int(sys.argv[3]) if len(sys.argv) > 3 else 10**9
decisions = {}
for env in ENVS:
    for split in ("train", "test"):
        ts = [t for t in traces if t.env == env and t.split == split]
        ts = ts[:n_train] if split == "train" else ts
        decisions[env, split] = [d for t in ts for d in decisions_from_trace(t, 2)]
        print(env, split, len(ts), "traces", len(decisions[env, split]), "decisions", flush=True)


def score(fitted, test):
    y = [bool(d.label) for d in test]
    out = {}
    for name, b in fitted.items():
        out[name] = {}
        for point in ("f1", "safe"):
            deleted = b.predict(test, point)
            row = {k: metrics(y, deleted)[k] for k in KEYS}
            cues = {}  # per cue: [decisions, expired, deleted, harmful]
            for d, x in zip(test, deleted, strict=True):
                c = cues.setdefault(d.cue, [0, 0, 0, 0])
                c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + bool(d.label), c[2] + bool(x), c[3] + bool(x and not d.label)
            out[name][point] = row | {"by_cue": cues}
    return out


out = {"baselines": list(BASELINES), "train_traces_per_env": min(n_train, len(traces)), "folds": {}}
folds = [("in_distribution", ENVS)] + [(f"held_out_{e}", tuple(x for x in ENVS if x != e)) for e in ENVS]
for name, fit_envs in folds:
    t0 = time.time()
    fitted = fit_all([d for e in fit_envs for d in decisions[e, "train"]])
    test_envs = ENVS if name == "in_distribution" else (name.removeprefix("held_out_"),)
    out["folds"][name] = {"fit_envs": list(fit_envs),
                          "test": {e: score(fitted, decisions[e, "test"]) for e in test_envs},
                          "fit_points": {n: b.points for n, b in fitted.items()}}
    print(f"== {name} (fitted on {', '.join(fit_envs)}, {time.time() - t0:.0f} s)")
    for e, arms in out["folds"][name]["test"].items():
        for arm, pts in arms.items():
            f, s = pts["f1"], pts["safe"]
            fmt = lambda v: "  -  " if v is None else f"{v:.3f}"  # noqa: E731
            print(f"  {e:9s} {arm:16s} f1 {fmt(f['f1'])} harm {fmt(f['harmful_rate'])} del {f['deleted']:4d}"
                  f" | safe f1 {fmt(s['f1'])} harm {fmt(s['harmful_rate'])} del {s['deleted']:4d}", flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
