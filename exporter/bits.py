"""16-bit floats moved as bits, and what a composite's `holds` attribute names.

XLA:CPU computes bf16/f16 in f32: its float normalization widens the operands of ops it has
no 16-bit kernels for, data movement included (dynamic-slice, gather, scatter). For a loop
over stacked bf16 weights that means the WHOLE stack converted to f32 before the loop, every
call (measured: a 30-layer bf16 scan 2x slower than f32 instead of 2x faster). Moving the
same bits as uint16 is exact and never widened; the dot then reads bf16 again.
"""
from __future__ import annotations

import jax.numpy as jnp
from hloserve.runtime.artifact.kernels import Holds
from jax import lax

_BITS = {"bfloat16": "uint16", "float16": "uint16"}


def to_bits(x):
    """A 16-bit float array as uint16 of the same bits (any other array unchanged)."""
    bits = _BITS.get(str(getattr(x, "dtype", "")))
    return lax.bitcast_convert_type(x, jnp.dtype(bits)) if bits else x


def from_bits(x, dtype):
    """Inverse of to_bits for an array that was `dtype` before."""
    return lax.bitcast_convert_type(x, dtype) if str(jnp.dtype(dtype)) in _BITS else x


def held(holds: int):
    """The jnp dtype a composite's `holds` attribute names (Holds.BF16 -> bfloat16; OWN -> None)."""
    name = Holds(int(holds)).dtype_name
    return jnp.dtype(name) if name else None
