"""Long sessions for the retrievability benchmark: definitions and probes in two domains, fillers, the schema, the
planners and the sessions re-expressed as agent traces."""
