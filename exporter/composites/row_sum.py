"""The `hloserve.row_sum` composite, export side: each row's sum, which the reductions' lowerings emit
for a sum (mean) over an f32 tensor's trailing dims in a batch-invariant export.

    jax side     row_sum_reference: the portable decomposition (jnp.sum over the last dim)
    emitted by   exporter/lowerings/reduction.py (sum, mean, softmax) and nn.py (layer norm), where
                 the Interpreter's `batch_invariant` says so (`hloserve export --batch-invariant`)

Why a composite for a sum: XLA's CPU compiler sums the rows of a [T, N] reduce in one order below
8 rows and in another from 8 up (measured on [T, 576]: 123 of 256 rows came out with other last
bits at T = 8 than at T = 1). A norm's mean of squares then differed in the last bit between a
decode step of one row and a step of 16, the bf16 rounding of the next matrix product's input
turned that into 0.04-0.2 in the logits, and a speculative verifying step (a row per proposed
token) could pick another greedy token than plain decoding did. The CPU kernel
(runtime/kernels/cpu/row_sum.cc) sums a row in one order at every row count; the decomposition
stays what accelerators run.

The contract is runtime/artifact/kernels.py's ROW_SUM.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from hloserve.runtime.artifact.kernels import ROW_SUM

from .. import _private


def row_sum_reference(x):
    """The `hloserve.row_sum` composite's decomposition: f32[R, N] -> f32[R]."""
    return jnp.sum(x, axis=-1)


def trailing_sum(x, dims: int, keepdims: bool):
    """The sum of f32 `x` over its last `dims` dims (static sizes) through the composite."""
    lead, trail = x.shape[:x.ndim - dims], x.shape[x.ndim - dims:]
    composite = _private.composite(row_sum_reference, ROW_SUM.name, ROW_SUM.version)
    return composite(x.reshape((-1, math.prod(trail)))).reshape(lead + (1,) * dims if keepdims else lead)


def reduces_trailing(x, axes) -> int | None:
    """How many trailing dims `axes` (canonical: non-negative) are, where they are exactly the last
    ones of an f32 tensor with static sizes there, else None."""
    if x.dtype != jnp.float32 or x.ndim == 0:
        return None
    axes = tuple(sorted(axes))
    if not axes or axes != tuple(range(x.ndim - len(axes), x.ndim)):
        return None
    if not all(isinstance(d, int) for d in x.shape[x.ndim - len(axes):]):
        return None
    return len(axes)
