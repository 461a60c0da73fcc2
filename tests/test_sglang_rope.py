"""`kernels/rope.py` under both transformers pins: the project's 5.23 (this process) and sglang's 5.12.1 (the SGLang
server's virtualenv, `.venv-sglang`, in a subprocess). The spec of each RoPE type must be the same float64 inv_freq
under both (and 5.12.1's configs, without `nested_rope_parameter_keys`, must still be read), or the tree cache inside
SGLang would re-rotate by other frequencies than the engine — or fall back to re-prefill."""

from __future__ import annotations

import json
import subprocess

import torch

from kvsteward.kernels.rope import rope_spec
from kvsteward.serve.sglang.launch import sglang_python

CASES = {
    "default": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, None),
    "linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, None),
    "llama3": ("LlamaConfig", {"max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, None),
    "yarn": ("Qwen3Config", {"max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}}, None),
    "partial": ("GPTNeoXConfig", {"rotary_pct": 0.25}, None),
    "nested": ("Gemma3TextConfig", {}, "full_attention"),
}

SCRIPT = """
import json, sys, transformers
from kvsteward.kernels.rope import rope_spec
cases = json.loads(sys.argv[1])
out = {"transformers": transformers.__version__}
for name, (cls, kw, layer) in cases.items():
    s = rope_spec(getattr(transformers, cls)(**kw), layer_type=layer)
    out[name] = [s.inv_freq.tolist(), s.rotary_dim, s.rope_type, s.attention_scaling]
print(json.dumps(out))
"""


def test_rope_spec_is_the_same_under_sglangs_transformers_pin():
    import transformers

    res = subprocess.run([sglang_python(), "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=300, check=True)
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    assert theirs["transformers"] == "5.12.1" and transformers.__version__ == "5.23.0"
    for name, (cls, kw, layer) in CASES.items():
        s = rope_spec(getattr(transformers, cls)(**kw), layer_type=layer)
        inv_freq, rotary_dim, rope_type, scaling = theirs[name]
        assert torch.equal(torch.tensor(inv_freq, dtype=torch.float64), s.inv_freq), name
        assert (rotary_dim, rope_type) == (s.rotary_dim, s.rope_type), name
        assert abs(scaling - s.attention_scaling) < 1e-12, name
