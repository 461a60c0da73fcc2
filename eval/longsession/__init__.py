"""The long-session benchmark: every arm on the same sessions (runner) and its results, report and plots (report)."""
