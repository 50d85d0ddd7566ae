"""Where hloserve keeps things on disk: one root, HLOSERVE_CACHE or ~/.cache/hloserve."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """The cache root: exported default artifacts, downloaded presets, XLA's compile cache."""
    return os.environ.get("HLOSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hloserve"))
