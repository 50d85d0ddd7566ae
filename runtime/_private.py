"""Every private jax API the runtime uses, in one place (checked on jax 0.10.x)."""
from __future__ import annotations


def reset_compilation_cache() -> None:
    """Forget jax's persistent-cache object so the next compile reads the configured directory
    (the only way to switch cache directories within a process)."""
    from jax._src import compilation_cache
    compilation_cache.reset_cache()
