"""Compatibility shim: the first loader's `load(path, verify=, device=)` on top of runtime.model.load."""
from __future__ import annotations

from typing import Any

from .model import LoadedModel, load as _load


def load(path: str, *, verify: bool = True, device: Any = None, **kwargs: Any) -> LoadedModel:
    """`hloserve.runtime.load` with the old `device=` argument (one device)."""
    if device is not None:
        kwargs["devices"] = [device]
    return _load(path, verify=verify, **kwargs)
