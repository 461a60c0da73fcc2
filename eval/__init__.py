"""kvsteward.eval: `manager` (the learned manager against the cheap baselines on traces) and `longsession` (the
long-session benchmark); `scoring` and `tracking` serve both."""
