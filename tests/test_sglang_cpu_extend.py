"""The CPU boot's extend path for sglang's torch_native attention (`kvsteward_sglang_boot.extend_new_queries`),
run in the server's virtualenv: it is installed on import, it equals sglang's own extend (which attends with a query
as long as the whole row) on mixed batches — no prefix, a one-token extend, long cached prefixes, GQA, bf16 K/V with
fp32 queries — it leaves sliding-window and non-causal layers to sglang, and the switch turns it off."""

from __future__ import annotations

import json
import os
import subprocess

from kvsteward.serve.sglang.launch import sglang_python

SCRIPT = r"""
import json, torch
import sglang.srt.layers.attention.torch_native_backend as m
run = m.TorchNativeAttnBackend._run_sdpa_forward_extend
out = {"patched": hasattr(run, "kvsteward_native")}
if out["patched"]:
    native = run.kvsteward_native
    torch.manual_seed(0)
    calls = []
    class Backend:  # what the sliding-window branch of sglang's own path reads
        def _make_sliding_window_mask(self, **kw):
            calls.append(kw)
            return m.TorchNativeAttnBackend._make_sliding_window_mask(**kw)
    diffs = {}
    for name, heads, kv_heads, kv_dtype, causal, window in [
            ("gqa", 6, 2, torch.float32, True, None), ("mha", 4, 4, torch.float32, True, None),
            ("bf16_kv", 6, 2, torch.bfloat16, True, None), ("non_causal", 4, 4, torch.float32, False, None),
            ("window", 4, 4, torch.float32, True, 16)]:
        d, pool = 16, 3000
        kc, vc = torch.randn(pool, kv_heads, d).to(kv_dtype), torch.randn(pool, kv_heads, d).to(kv_dtype)
        r2t = torch.stack([torch.randperm(pool)[:2500] for _ in range(4)])
        prefix = torch.tensor([0, 7, 400, 1500]); ext = torch.tensor([9, 1, 30, 200]); seq = prefix + ext
        q = torch.randn(int(ext.sum()), heads, d)
        a, b = torch.zeros_like(q), torch.zeros_like(q)
        kw = dict(scaling=0.25, enable_gqa=heads != kv_heads, causal=causal, sliding_window_size=window)
        native(Backend(), q, a, kc, vc, r2t, torch.arange(4), seq, prefix, ext, None, **kw)
        n_calls = len(calls)
        run(Backend(), q, b, kc, vc, r2t, torch.arange(4), seq, prefix, ext, None, **kw)
        diffs[name] = [float((a - b).abs().max()), float(a.abs().max()), len(calls) > n_calls]
    out["diffs"] = diffs
print(json.dumps(out))
"""


def _run(env: dict | None = None) -> dict:
    res = subprocess.run([sglang_python(), "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_new_queries_extend_equals_sglangs_own():
    out = _run()
    assert out["patched"]
    for name, (diff, scale, fell_back) in out["diffs"].items():
        assert scale > 0.1 and diff <= 1e-5 * max(1.0, scale), (name, diff)
        assert fell_back == (name == "window"), name  # the window layer ran sglang's path (its mask was built)


def test_the_switch_keeps_sglangs_path():
    assert _run({"KVSTEWARD_SGLANG_CPU_EXTEND": "native"}) == {"patched": False}
