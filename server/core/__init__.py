"""The engine core: scheduling policy, the runner that executes plans, sampling, structured output and
detokenization (over server/text), the engine loop; no HTTP, no serving defaults (server/config.py)."""
