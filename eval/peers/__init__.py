"""Peers side by side: kvpress's presses next to the engine's policies on RULER prompts (`steward bench peers`)."""
