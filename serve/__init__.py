"""kvsteward.serve."""
