"""kvsteward.kernels."""
