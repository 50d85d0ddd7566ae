"""hloserve.runtime: load artifacts through PJRT and run them (never imports torch).

    from hloserve import runtime
    model = runtime.load("art/", buckets={"batch": [1, 8, 32]}, strict=True)
    model.warmup(sizes={"seq": [128]})
    out = model.functions["forward"](input_ids=ids, attention_mask=mask)

Layout: client.py (platform, devices, compile cache), executable.py (compile per
bucketed shape, recompile accounting), buckets.py (padding policy), sharding.py
(mesh + partition rules), model.py (load).
"""
from .executable import Function, FunctionStats, RecompileError
from .model import LoadedModel, load

__all__ = ["Function", "FunctionStats", "LoadedModel", "RecompileError", "load"]
