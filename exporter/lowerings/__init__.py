"""Lowerings, one module per op family; the composites' lowerings live with their ops in
exporter/composites/. `default_registry()` collects both."""
from __future__ import annotations

import functools

from .. import composites
from ..registry import Registry
from . import control_flow, creation, elementwise, indexing, linalg, nn, quantized, reduction, shape, symbolic

FAMILIES = (elementwise, reduction, shape, creation, indexing, linalg, nn, control_flow, symbolic, quantized,
            *composites.MODULES)


@functools.cache
def default_registry() -> Registry:
    """The registry of every family module (built once, lazily; raises on duplicates)."""
    return Registry.from_modules(FAMILIES)
