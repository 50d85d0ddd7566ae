"""Every private jax and torch API the exporter uses, in one place (checked on jax 0.10.x, torch 2.13).

An upgrade that moves one of these breaks here, with the rest of the exporter untouched. Each name
says what it is for; none of them is re-exported beyond the exporter.
"""
from __future__ import annotations

from jax._src import core as _jax_core
from jax._src.lib.mlir.dialects import hlo as stablehlo_dialect  # noqa: F401  StableHLO versions, portable artifacts

# symbolic-dim arithmetic that jax.export does not expose publicly
max_dim = _jax_core.max_dim
min_dim = _jax_core.min_dim
InconclusiveDimensionOperation = _jax_core.InconclusiveDimensionOperation


def torch_scan():
    """torch's `scan` higher-order op (lowered to a StableHLO while loop); imported on use."""
    from torch._higher_order_ops.scan import scan
    return scan
