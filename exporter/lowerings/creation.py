"""Tensor factories: full, zeros/ones/empty (and *_like), arange, scalar_tensor.

Factories take their shape from `ctx.out_shape` and their dtype from the node,
so symbolic sizes and torch's default dtypes are honoured. Uninitialized
memory (`empty`) lowers to zeros: deterministic and just as cheap in XLA.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from ..registry import lower

aten = torch.ops.aten


# aten::full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.full.default)
def _full(ctx, size, fill_value, **kwargs):
    return jnp.full(ctx.out_shape, fill_value, ctx.out_dtype)


# aten::full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.full_like)
def _full_like(ctx, x, fill_value, **kwargs):
    return jnp.full(ctx.out_shape, fill_value, ctx.out_dtype)


# aten::zeros(SymInt[] size, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.zeros.default, aten.empty.memory_format, aten.empty_strided, aten.new_zeros, aten.new_empty,
       aten.new_empty_strided, aten.zeros_like, aten.empty_like, aten.empty_permuted)
def _zeros(ctx, *args, **kwargs):
    return jnp.zeros(ctx.out_shape, ctx.out_dtype)


# aten::ones(SymInt[] size, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.ones.default, aten.new_ones, aten.ones_like)
def _ones(ctx, *args, **kwargs):
    return jnp.ones(ctx.out_shape, ctx.out_dtype)


# aten::new_full(Tensor self, SymInt[] size, Scalar fill_value, *, ...) -> Tensor
@lower(aten.new_full)
def _new_full(ctx, x, size, fill_value, **kwargs):
    return jnp.full(ctx.out_shape, fill_value, ctx.out_dtype)


# aten::scalar_tensor(Scalar s, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.scalar_tensor)
def _scalar_tensor(ctx, s, **kwargs):
    return jnp.asarray(s, ctx.out_dtype)


# aten::arange.start_step(Scalar start, Scalar end, Scalar step=1, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.arange)
def _arange(ctx, *args, **kwargs):
    nums = [a for a in args if not isinstance(a, torch.dtype)]
    start, step = (0, 1)
    if len(nums) == 1:
        (end,) = nums
    elif len(nums) == 2:
        start, end = nums
    else:
        start, end, step = nums[:3]
    (n,) = ctx.out_shape
    dt = ctx.out_dtype
    if isinstance(start, int) and isinstance(step, int) and jnp.issubdtype(dt, jnp.integer):
        return start + lax.iota(dt, n) * step
    return (start + lax.iota(jnp.float32, n) * step).astype(dt) if dt != jnp.float64 else start + lax.iota(dt, n) * step


# aten::linspace(Scalar start, Scalar end, int steps, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.linspace)
def _linspace(ctx, start, end, steps, **kwargs):
    return jnp.linspace(start, end, steps).astype(ctx.out_dtype)


# aten::eye(SymInt n, *, ScalarType? dtype=None, ...) -> Tensor
@lower(aten.eye)
def _eye(ctx, n, m=None, **kwargs):
    return jnp.eye(*ctx.out_shape, dtype=ctx.out_dtype)
