"""Helpers shared by lowering families (not lowerings themselves)."""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jax import lax

from ..registry import row


def canon_dim(dim: int, ndim: int) -> int:
    """Negative dims count from the end; rank-0 tensors accept dim 0 / -1."""
    if ndim == 0:
        return 0
    return dim + ndim if dim < 0 else dim


def canon_dims(dims, ndim: int) -> tuple[int, ...]:
    if ndim == 0:  # a rank-0 tensor reduces over nothing, whatever dims (0 / -1) it is given
        return ()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({canon_dim(d, ndim) for d in dims}))


def unary(*targets: Any, fn: Callable, module: str) -> Callable:
    """Table row for an elementwise op that maps straight onto a jnp function."""
    return row(*targets, fn=lambda ctx, x, *a, **k: fn(x), module=module)


def binary(*targets: Any, fn: Callable, module: str) -> Callable:
    """Table row for an elementwise binary op (Tensor/Scalar overloads alike)."""
    return row(*targets, fn=lambda ctx, x, y, *a, **k: fn(x, y), module=module)


def running_sum(x, axis: int):
    """cumsum along `axis`. Over a static axis in plain StableHLO ops (lax.associative_scan): jax 0.11
    lowers jnp.cumsum to a `chlo.scan` composite that a CUDA plugin at StableHLO 1.20 refuses once a
    step's kernels are linked (runtime/_private.link_kernels; an H200, 2026-11-30). associative_scan
    needs a static length, so a symbolic axis keeps jnp.cumsum."""
    if isinstance(x.shape[axis], int):
        return lax.associative_scan(jnp.add, x, axis=axis)
    return jnp.cumsum(x, axis=axis)
