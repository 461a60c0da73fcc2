"""The exact cache engine: slots, attention, sessions, eviction policies, bounded positions, spill tiers.

Layers, imported one way (bottom first): `slots` (the slot table) → `attention` (attention over slots, score
accumulation) → `blueprint`, `policies` (scorers + the shared top-B selection) → `spill`, `tiers` (where evicted KV
goes) → `session` (append / drop / reposition / fork with operation history) → `restore`, `reference` (rebuild a state
from its history; the independent reference path) → `ops` (the AKV request grammar as engine ops) → `engine` (one model
and its sessions). The engine imports nothing from `server`, `manager`, `sglang` or `bench`
(`tests/test_layers.py`).
"""

from kvsteward.serve.engine.engine import Engine
from kvsteward.serve.engine.session import CacheOpError, Session, SessionConfig

__all__ = ["CacheOpError", "Engine", "Session", "SessionConfig"]
