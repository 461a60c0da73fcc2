"""kvsteward.kernels: exact RoPE re-rotation (torch reference + Triton kernel) and its float64 accuracy checks.

The Triton module is imported lazily by `rerotate` (only on CUDA tensors or under TRITON_INTERPRET=1).
"""

from kvsteward.kernels.rope import (
    LAYOUTS,
    SUPPORTED_ROPE_TYPES,
    RopeSpec,
    UnsupportedRope,
    apply_rope,
    rerotate,
    rerotate_reference,
    rope_spec,
    rotation_cos_sin,
)

__all__ = [
    "LAYOUTS", "SUPPORTED_ROPE_TYPES", "RopeSpec", "UnsupportedRope", "apply_rope", "rerotate",
    "rerotate_reference", "rope_spec", "rotation_cos_sin",
]
