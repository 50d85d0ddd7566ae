"""Reductions: sum/mean/max/min/prod/any/all/var, argmax/argmin, cumulative ops, softmax."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..composites.row_sum import reduces_trailing, trailing_sum
from ..registry import lower
from ._util import canon_dim, canon_dims, running_sum

aten = torch.ops.aten


# aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor
@lower(aten.sum)
def _sum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return sum_of(ctx, x.astype(ctx.out_dtype), canon_dims(dim, x.ndim), keepdim)


# aten::mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor
@lower(aten.mean)
def _mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return mean_of(ctx, x.astype(ctx.out_dtype), canon_dims(dim, x.ndim), keepdim)


def sum_of(ctx, x, axes: tuple[int, ...], keepdims: bool):
    """jnp.sum over `axes`; in a batch-invariant export (the Interpreter's `batch_invariant`) an f32
    sum over trailing dims goes through the hloserve.row_sum composite, whose CPU kernel sums a row in
    one order however many rows the step has (exporter/composites/row_sum.py says why)."""
    if ctx.interpreter.batch_invariant and (dims := reduces_trailing(x, axes)):
        return trailing_sum(x, dims, keepdims)
    return jnp.sum(x, axis=axes, keepdims=keepdims)


def mean_of(ctx, x, axes: tuple[int, ...], keepdims: bool):
    """jnp.mean over `axes`, its sum through the composite where `sum_of` would take it."""
    if ctx.interpreter.batch_invariant and (dims := reduces_trailing(x, axes)):
        return trailing_sum(x, dims, keepdims) / np.float32(math.prod(x.shape[a] for a in axes))
    return jnp.mean(x, axis=axes, keepdims=keepdims)


# aten::prod.dim_int(Tensor self, int dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor
@lower(aten.prod)
def _prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.prod(x.astype(ctx.out_dtype), axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor
@lower(aten.amax)
def _amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(x, axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::amin(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor
@lower(aten.amin)
def _amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(x, axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::max(Tensor self) -> Tensor ; aten::max.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)
@lower(aten.max.default, aten.max.dim)
def _max(ctx, x, dim=None, keepdim=False):
    if dim is None:
        return jnp.max(x)
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = canon_dim(dim, x.ndim)
    return jnp.max(x, axis=d, keepdims=keepdim), jnp.argmax(x, axis=d, keepdims=keepdim)


# aten::min(Tensor self) -> Tensor ; aten::min.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)
@lower(aten.min.default, aten.min.dim)
def _min(ctx, x, dim=None, keepdim=False):
    if dim is None:
        return jnp.min(x)
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = canon_dim(dim, x.ndim)
    return jnp.min(x, axis=d, keepdims=keepdim), jnp.argmin(x, axis=d, keepdims=keepdim)


def _arg_reduce(fn, x, dim, keepdim):
    """argmax/argmin as torch has them: a 0-dim input is index 0, no dim means the flattened index."""
    if x.ndim == 0:
        return jnp.zeros((), jnp.int32)
    if dim is None:
        return fn(x.reshape(-1)).reshape((1,) * x.ndim if keepdim else ())
    return fn(x, axis=canon_dim(dim, x.ndim), keepdims=keepdim)


# aten::argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor
@lower(aten.argmax)
def _argmax(ctx, x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmax, x, dim, keepdim)


# aten::argmin(Tensor self, int? dim=None, bool keepdim=False) -> Tensor
@lower(aten.argmin)
def _argmin(ctx, x, dim=None, keepdim=False):
    return _arg_reduce(jnp.argmin, x, dim, keepdim)


# aten::any.dims(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor
@lower(aten.any)
def _any(ctx, x, dim=None, keepdim=False):
    return jnp.any(x != 0, axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::all.dims(Tensor self, int[]? dim=None, bool keepdim=False) -> Tensor
@lower(aten.all)
def _all(ctx, x, dim=None, keepdim=False):
    return jnp.all(x != 0, axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor
@lower(aten.var.correction)
def _var(ctx, x, dim=None, *, correction=None, keepdim=False):
    return jnp.var(x, axis=canon_dims(dim, x.ndim), ddof=1 if correction is None else correction, keepdims=keepdim)


# aten::var_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)
@lower(aten.var_mean.correction)
def _var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    axes = canon_dims(dim, x.ndim)
    return (jnp.var(x, axis=axes, ddof=1 if correction is None else correction, keepdims=keepdim),
            jnp.mean(x, axis=axes, keepdims=keepdim))


# aten::cumsum(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor
@lower(aten.cumsum)
def _cumsum(ctx, x, dim, *, dtype=None):
    if x.ndim == 0:
        return x.astype(ctx.out_dtype)
    return running_sum(x.astype(ctx.out_dtype), canon_dim(dim, x.ndim))


# aten::cumprod(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor
@lower(aten.cumprod)
def _cumprod(ctx, x, dim, *, dtype=None):
    if x.ndim == 0:
        return x.astype(ctx.out_dtype)
    return jnp.cumprod(x.astype(ctx.out_dtype), axis=canon_dim(dim, x.ndim))


# aten::logsumexp(Tensor self, int[1] dim, bool keepdim=False) -> Tensor
@lower(aten.logsumexp)
def _logsumexp(ctx, x, dim, keepdim=False):
    return jax.scipy.special.logsumexp(x, axis=canon_dims(dim, x.ndim), keepdims=keepdim)


# aten::_softmax(Tensor self, int dim, bool half_to_float) -> Tensor
@lower(aten._softmax, aten.softmax.int)
def _softmax(ctx, x, dim, half_to_float=False, *rest):
    if x.ndim == 0:
        return jnp.ones_like(x)
    x, d = x.astype(ctx.out_dtype), canon_dim(dim, x.ndim)
    if ctx.interpreter.batch_invariant and reduces_trailing(x, (d,)):   # the sum through row_sum, as sum_of
        e = jnp.exp(x - lax.stop_gradient(x.max(axis=d, keepdims=True)))
        return e / trailing_sum(e, 1, True)
    return jax.nn.softmax(x, axis=d)


# aten::_log_softmax(Tensor self, int dim, bool half_to_float) -> Tensor
@lower(aten._log_softmax, aten.log_softmax.int)
def _log_softmax(ctx, x, dim, half_to_float=False, *rest):
    if x.ndim == 0:
        return jnp.zeros_like(x)
    return jax.nn.log_softmax(x.astype(ctx.out_dtype), axis=canon_dim(dim, x.ndim))


# aten::topk(Tensor self, SymInt k, int dim=-1, bool largest=True, bool sorted=True) -> (Tensor values, Tensor indices)
@lower(aten.topk)
def _topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = canon_dim(dim, x.ndim)
    xt = jnp.moveaxis(x, d, -1)
    vals, idx = lax.top_k(xt if largest else -xt, k)
    if not largest:
        vals = -vals
    return jnp.moveaxis(vals, -1, d), jnp.moveaxis(idx, -1, d)


# aten::sort.stable(Tensor self, *, bool? stable, int dim=-1, bool descending=False) -> (Tensor values, Tensor indices)
@lower(aten.sort)
def _sort(ctx, x, *args, stable=None, dim=-1, descending=False):
    if args:  # aten::sort(Tensor self, int dim=-1, bool descending=False)
        dim, *rest = args
        descending = rest[0] if rest else descending
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = canon_dim(dim, x.ndim)
    idx = jnp.argsort(x, axis=d, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=d), idx


# aten::linalg_vector_norm(Tensor self, Scalar ord=2, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor
@lower(aten.linalg_vector_norm)
def _linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    # dim=None or [] reduces over every dim, as in torch.
    axes = canon_dims(dim, x.ndim) if x.ndim else None
    return jnp.linalg.vector_norm(x.astype(ctx.out_dtype), ord=ord, axis=axes, keepdims=keepdim)


# aten::logcumsumexp(Tensor self, int dim) -> Tensor
@lower(aten.logcumsumexp)
def _logcumsumexp(ctx, x, dim):
    if x.ndim == 0:
        return x
    return lax.cumlogsumexp(x, axis=canon_dim(dim, x.ndim))


def _cum_extreme(x, dim, better):
    """Running max/min with the index of its LAST occurrence; NaN wins and sticks (torch's cummax/cummin)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    d = canon_dim(dim, x.ndim)
    idx = lax.broadcasted_iota(jnp.int32, x.shape, d)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = jnp.isnan(bv) | (~jnp.isnan(av) & better(bv, av))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)
    return lax.associative_scan(combine, (x, idx), axis=d)


# aten::cummax(Tensor self, int dim) -> (Tensor values, Tensor indices)
@lower(aten.cummax)
def _cummax(ctx, x, dim):
    return _cum_extreme(x, dim, lambda b, a: b >= a)


# aten::cummin(Tensor self, int dim) -> (Tensor values, Tensor indices)
@lower(aten.cummin)
def _cummin(ctx, x, dim):
    return _cum_extreme(x, dim, lambda b, a: b <= a)


# aten::searchsorted.Tensor(Tensor sorted_sequence, Tensor self, *, bool out_int32=False, bool right=False,
#                           str? side=None, Tensor? sorter=None) -> Tensor
@lower(aten.searchsorted.Tensor)
def _searchsorted(ctx, seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    if seq.ndim == 1:
        return jnp.searchsorted(seq, x, side=side) if seq.shape[0] else jnp.zeros(jnp.shape(x), jnp.int32)
    flat_seq = seq.reshape(math.prod(seq.shape[:-1]), seq.shape[-1])     # (B, S)
    flat_x = x.reshape(flat_seq.shape[0], x.shape[-1])                   # (B, V)
    if flat_seq.shape[0] == 0 or flat_x.shape[1] == 0:
        return jnp.zeros(x.shape, jnp.int32)
    if flat_seq.shape[1] == 0:  # nothing to search: every value goes to position 0
        return jnp.zeros(x.shape, jnp.int32)
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_x)
    return out.reshape(x.shape)


# aten::bucketize.Tensor(Tensor self, Tensor boundaries, *, bool out_int32=False, bool right=False) -> Tensor
@lower(aten.bucketize.Tensor)
def _bucketize(ctx, x, boundaries, *, out_int32=False, right=False):
    return jnp.searchsorted(boundaries, x, side="right" if right else "left")
