"""kvsteward.eval."""
