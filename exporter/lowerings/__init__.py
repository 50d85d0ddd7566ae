"""Lowerings, one module per op family. `default_registry()` collects them."""
from __future__ import annotations

import functools

from ..registry import Registry
from . import (attention, control_flow, creation, elementwise, indexing, linalg, nn, quantized, reduction, shape,
               symbolic)

FAMILIES = (elementwise, reduction, shape, creation, indexing, linalg, nn, control_flow, symbolic, quantized, attention)


@functools.cache
def default_registry() -> Registry:
    """The registry of every family module (built once, lazily; raises on duplicates)."""
    return Registry.from_modules(FAMILIES)
