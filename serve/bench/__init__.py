"""Benchmarks and exactness checks of the engine on a real model (`steward engine check` / `steward bench`)."""
