"""kvsteward.synth."""
