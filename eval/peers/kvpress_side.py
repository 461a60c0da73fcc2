"""kvpress's presses on RULER prompts, through kvpress's own pipeline: run in kvpress's virtualenv
(`make kvpress-venv`: kvpress 0.5.5 pins transformers < 5.3, the project runs 5.23), as
`.venv-kvpress/bin/python eval/peers/kvpress_side.py IN.json OUT.json`.

Standalone on purpose: it imports nothing from kvsteward (a different transformers). IN.json: {"model": folder,
"tasks": [{"id", "context", "question", "answer_prefix"}], "presses": [names], "ratios": [floats],
"max_new_tokens": n}. OUT.json: {"ids": {task id: {"context_ids", "question_ids"}} (the exact tokens the pipeline
built, which the engine side replays), "rows": [{"task", "press", "ratio", "answer", "kept", "wall_s"}],
"versions": {...}}. `none` is the uncompressed cache (press=None). Progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time


def make_press(name: str, ratio: float):
    import kvpress

    presses = {
        "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "tova": lambda r: kvpress.TOVAPress(compression_ratio=r),
        "streaming": lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
        "observed": lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
        "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    }
    if name not in presses:
        raise ValueError(f"unknown press {name!r} ({', '.join(presses)})")
    return presses[name](ratio)


def main(src: str, dst: str) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import DynamicCache, pipeline

    transformers.utils.logging.disable_progress_bar()  # one weight-loading bar per pipeline otherwise

    cfg = json.loads(open(src).read())
    torch.set_num_threads(int(cfg.get("threads", 1)))
    pipes: dict[str, object] = {}

    def pipe(attn: str):
        # ObservedAttention reads the attention weights, which only the eager implementation returns
        if attn not in pipes:
            pipes[attn] = pipeline("kv-press-text-generation", model=cfg["model"], device="cpu",
                                   model_kwargs={"attn_implementation": attn, "dtype": torch.float32})
        return pipes[attn]

    out: dict = {"ids": {}, "rows": [], "versions": {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                                                     else "0.5.5", "transformers": transformers.__version__,
                                                     "torch": torch.__version__}}
    for t in cfg["tasks"]:
        p = pipe("sdpa")
        pre = p.preprocess(t["context"], questions=[t["question"]], answer_prefix=t["answer_prefix"],
                           max_context_length=10**9)
        out["ids"][t["id"]] = {"context_ids": pre["context_ids"][0].tolist(),
                               "question_ids": pre["questions_ids"][0][0].tolist()}
        for name in cfg["presses"]:
            for ratio in (cfg["ratios"] if name != "none" else [0.0]):
                press = None if name == "none" else make_press(name, ratio)
                cache = DynamicCache()
                t0 = time.perf_counter()
                answer = pipe("eager" if name == "observed" else "sdpa")(
                    t["context"], question=t["question"], answer_prefix=t["answer_prefix"], press=press,
                    max_new_tokens=cfg["max_new_tokens"], cache=cache)["answer"]
                wall = time.perf_counter() - t0
                out["rows"].append({"task": t["id"], "press": name, "ratio": ratio, "answer": answer,
                                    "kept": int(cache.get_seq_length()), "wall_s": wall})
                print(f"kvpress {t['id']} {name} {ratio}: {wall:.1f} s, kept {cache.get_seq_length()}: {answer!r}",
                      file=sys.stderr, flush=True)
                with open(dst, "w") as f:  # what ran so far survives an interruption
                    json.dump(out, f)
    with open(dst, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
