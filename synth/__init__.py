"""kvsteward.synth: offline data — `traces` (agent traces for the memory manager) and `longsession` (long sessions for
the retrievability benchmark, which may read `traces`, never the other way); `chat` and `rng` serve both."""
