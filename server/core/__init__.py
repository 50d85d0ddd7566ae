"""The engine core: scheduling policy, the runner that executes plans, sampling, the engine loop (no HTTP, no text)."""
