"""Agent traces for the memory manager: environments, scripted solvers, hindsight labels, the shortcut audit, cheap
baselines, structure features, the trace importer and BFCL."""
