"""Pilot: hidden states of the base model at each cursor id of the ids trigger, on uncompressed replays.

python probe_features.py TRACES OUT.npz SPEC...   SPEC = env:split:limit
"""

import sys
import time

import numpy as np
import torch

from kvsteward.eval.manager import Tally, replay
from kvsteward.serve.engine import Engine
from kvsteward.serve.manager.decode import AuxDecision
from kvsteward.synth.chat import generation_prompt, message_texts
from kvsteward.synth.hindsight import delete_trigger, expired, unread_cursors
from kvsteward.synth.trace import read_traces

LAYERS = [4, 8, 12, 16, 20, 24, 28]

torch.set_num_threads(1)
traces_path, out = sys.argv[1], sys.argv[2]
specs = [s.split(":") for s in sys.argv[3:]]
traces = read_traces(traces_path)
chosen = []
for env, split, limit in specs:
    chosen += [t for t in traces if t.env == env and t.split == split][: int(limit)]
engine = Engine.load("smollm2")
tok = engine.tokenizer
layers = engine.model.model.layers
captured: dict[int, torch.Tensor] = {}
for k in LAYERS:
    layers[k].register_forward_hook(
        lambda m, a, o, k=k: captured.__setitem__(k, (o[0] if isinstance(o, tuple) else o)[0].float().clone())
    )
norm = engine.model.model.norm
norm.register_forward_hook(lambda m, a, o: captured.__setitem__(99, o[0].float().clone()))

feats, labels, meta = [], [], []


def id_token_ends(text: str, ids: list[int]) -> list[int]:
    """Token index (within the tokenized text) of the last token of each id in the 'Open cursors:' line."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    line = text.index("Open cursors: ") + len("Open cursors: ")
    spans, pos = [], line
    for c in sorted(ids):
        s = text.index(str(c), pos)
        spans.append((c, s + len(str(c))))
        pos = s + len(str(c))
    out = {}
    for c, end in spans:
        j = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end)
        out[c] = j
    return enc["input_ids"], out


def make_decide(trace):
    def decide(s, msgs, open_c):
        unread = set(unread_cursors(msgs))
        read = [c for c in open_c if c not in unread]
        if not read:
            return AuxDecision([], "", 0)
        i = len(msgs)
        gone = set(expired(trace, i))
        text = delete_trigger(open_c, msgs, "ids")
        history = msgs + [{"role": "user", "content": text}]
        trig = message_texts(tok, history)[-1] + generation_prompt(tok, history)
        ids, where = id_token_ends(trig, open_c)
        fork = s.fork(shared=True)
        fork.config.use_adapter = False
        captured.clear()
        fork.append(ids, kind="user", logits="last")
        for rank, c in enumerate(sorted(read, reverse=True)):
            j = where[c]
            feats.append(np.concatenate([captured[k][j].numpy() for k in LAYERS + [99]]).astype(np.float16))
            labels.append(c in gone)
            meta.append((trace.task_id, trace.env, i, c, trace.cues.get(c, ""), rank, len(read)))
        return AuxDecision([], "", 0)

    return decide


t0 = time.time()
for n, tr in enumerate(chosen, 1):
    replay(engine, tr, 2, make_decide(tr), Tally())
    if n % 10 == 0:
        print(f"{n}/{len(chosen)} {time.time() - t0:.0f}s decisions={len(labels)}", flush=True)
np.savez_compressed(
    out, x=np.stack(feats), y=np.array(labels), meta=np.array(meta, dtype=object), layers=np.array(LAYERS + [99])
)
print("done", len(labels), time.time() - t0)
