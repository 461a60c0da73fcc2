"""kvsteward: a learned KV-cache memory manager for long-horizon agents (synth → train → serve/eval)."""

__version__ = "0.1.0"
