"""hloserve.runtime: load artifacts through PJRT and run them (never imports torch).

    from hloserve import runtime
    model = runtime.load("art/", buckets={"batch": [1, 8, 32]}, strict=True)
    model.warmup(sizes={"seq": [128]})
    out = model.functions["forward"](input_ids=ids, attention_mask=mask)

Layout: artifact/ (the format: manifest, weights, LLM step contract; no jax), client.py (platform,
devices, compile cache), executable.py (compile per bucketed shape, recompile accounting), buckets.py
(padding policy), sharding.py (mesh + partition rules), model.py (load), progress.py, paths.py.
The names below load lazily, so `import hloserve.runtime.artifact` does not import jax.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Function": "executable", "FunctionStats": "executable", "RecompileError": "executable",
         "LoadedModel": "model", "load": "model", "kernel_support": "model"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
