"""kvsteward.train."""
