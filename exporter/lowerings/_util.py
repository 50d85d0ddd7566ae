"""Helpers shared by lowering families (not lowerings themselves)."""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from hloserve.runtime.artifact.kernels import Holds
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


# -- 16-bit floats moved as bits ----------------------------------------------------------
# XLA:CPU computes bf16/f16 in f32: its float normalization widens the operands of ops it has
# no 16-bit kernels for, data movement included (dynamic-slice, gather, scatter). For a loop
# over stacked bf16 weights that means the WHOLE stack converted to f32 before the loop, every
# call (measured: a 30-layer bf16 scan 2x slower than f32 instead of 2x faster). Moving the
# same bits as uint16 is exact and never widened; the dot then reads bf16 again.
_BITS = {"bfloat16": "uint16", "float16": "uint16"}


def to_bits(x):
    """A 16-bit float array as uint16 of the same bits (any other array unchanged)."""
    bits = _BITS.get(str(getattr(x, "dtype", "")))
    return lax.bitcast_convert_type(x, jnp.dtype(bits)) if bits else x


# The `holds` attribute of hloserve's composites: which 16-bit float an array (or its bits) holds
HOLDS = {Holds.BF16: jnp.bfloat16, Holds.F16: jnp.float16}


def from_bits(x, dtype):
    """Inverse of to_bits for an array that was `dtype` before."""
    return lax.bitcast_convert_type(x, dtype) if str(jnp.dtype(dtype)) in _BITS else x
