"""Gather/scatter family: embedding, index, index_put, gather, scatter, masked fills.

torch indices may be negative (Python-style); jax's `mode="fill"`/clip modes
differ, so indices are wrapped explicitly where torch allows negatives.
Gathers and plain scatters of bf16/f16 move the bits as uint16 (exporter/bits.py): XLA:CPU would
otherwise widen the whole operand (an embedding table, a KV cache) to f32 on every call.
Row gathers (embedding, index_select) clamp their indices (torch requires them in bounds):
jnp.take's default NaN fill adds a bounds check and a select to every gathered element;
clamping touches only the indices.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..bits import from_bits, to_bits
from ..registry import lower
from ._util import canon_dim, running_sum

# torch errors on an out-of-range row index; clamping it costs nothing per gathered element
_IN_BOUNDS = "clip"

aten = torch.ops.aten


def _wrap(idx, size):
    """Python-style negative indices -> [0, size)."""
    idx = jnp.asarray(idx)
    return jnp.where(idx < 0, idx + size, idx)


# aten::embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False) -> Tensor
@lower(aten.embedding)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return from_bits(jnp.take(to_bits(weight), indices, axis=0, mode=_IN_BOUNDS), weight.dtype)


# aten::index_select(Tensor self, int dim, Tensor index) -> Tensor
@lower(aten.index_select)
def _index_select(ctx, x, dim, index):
    d = canon_dim(dim, x.ndim)
    if x.ndim == 0:
        return x
    return from_bits(jnp.take(to_bits(x), _wrap(index, x.shape[d]).reshape(-1), axis=d, mode=_IN_BOUNDS), x.dtype)


# aten::index.Tensor(Tensor self, Tensor?[] indices) -> Tensor
@lower(aten.index.Tensor)
def _index(ctx, x, indices):
    key = tuple(slice(None) if i is None else
                (i if i.dtype == jnp.bool_ else _wrap(i, x.shape[k]))
                for k, i in enumerate(indices))
    return from_bits(to_bits(x)[key], x.dtype)


# aten::index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor
@lower(aten.index_put)
def _index_put(ctx, x, indices, values, accumulate=False):
    values = jnp.asarray(values, x.dtype)
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == jnp.bool_:
        # x[mask] = v with v broadcast over the selected rows: a select, no data-dependent shape.
        mask = indices[0]
        rest = x.ndim - mask.ndim
        if values.ndim <= rest or (values.ndim == rest + 1 and values.shape[0] == 1):
            v = values.reshape(values.shape[-rest:] if rest else ()) if values.ndim > rest else values
            m = mask.reshape(mask.shape + (1,) * rest)                      # (*mask, 1, ...)
            return jnp.where(m, x + v if accumulate else jnp.broadcast_to(v, x.shape), x)
    key = tuple(slice(None) if i is None else
                (i if i.dtype == jnp.bool_ else _wrap(i, x.shape[k]))
                for k, i in enumerate(indices))
    values = jnp.asarray(values, x.dtype)
    if accumulate:
        return x.at[key].add(values)
    return from_bits(to_bits(x).at[key].set(to_bits(values)), x.dtype)


# aten::gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor
@lower(aten.gather)
def _gather(ctx, x, dim, index, *, sparse_grad=False):
    if x.ndim == 0:
        return jnp.broadcast_to(x, index.shape)
    if index.size == 0:
        return jnp.zeros(ctx.out_shape, x.dtype)
    d = canon_dim(dim, x.ndim)
    # index may be smaller than x in dims other than d: slice x to match
    x = x[tuple(slice(0, index.shape[k]) if k != d else slice(None) for k in range(x.ndim))]
    return jnp.take_along_axis(x, _wrap(index, x.shape[d]), axis=d)


def _scatter_indices(x, dim, index):
    d = canon_dim(dim, x.ndim)
    grids = jnp.meshgrid(*[jnp.arange(s) for s in index.shape], indexing="ij")
    grids[d] = _wrap(index, x.shape[d])
    return tuple(grids)


# aten::scatter.src(Tensor self, int dim, Tensor index, Tensor src) -> Tensor
@lower(aten.scatter.src, aten.scatter.value)
def _scatter(ctx, x, dim, index, src):
    if x.ndim == 0:
        return jnp.asarray(src, x.dtype).reshape(())
    if not hasattr(src, "shape") or src.ndim == 0:
        src = jnp.full(index.shape, src, x.dtype)
    src = src[tuple(slice(0, s) for s in index.shape)]
    return x.at[_scatter_indices(x, dim, index)].set(src.astype(x.dtype))


# aten::scatter_add(Tensor self, int dim, Tensor index, Tensor src) -> Tensor
@lower(aten.scatter_add)
def _scatter_add(ctx, x, dim, index, src):
    if x.ndim == 0:
        return x + src.reshape(())
    src = src[tuple(slice(0, s) for s in index.shape)]
    return x.at[_scatter_indices(x, dim, index)].add(src.astype(x.dtype))


# aten::scatter_reduce.two(Tensor self, int dim, Tensor index, Tensor src, str reduce, *, bool include_self=True) -> Tensor
@lower(aten.scatter_reduce.two)
def _scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    if x.ndim == 0:
        x, index, src = x.reshape(1), index.reshape(1), src.reshape(1)
        return _scatter_reduce(ctx, x, 0, index, src, reduce, include_self=include_self).reshape(())
    idx = _scatter_indices(x, dim, index)
    src = src[tuple(slice(0, s) for s in index.shape)].astype(x.dtype)
    if reduce in ("sum", "mean"):
        base = x if include_self else x.at[idx].set(0)
        out = base.at[idx].add(src)
        if reduce == "mean":
            count = jnp.ones_like(x) if include_self else jnp.zeros_like(x).at[idx].set(0)
            count = count.at[idx].add(1)
            out = out / jnp.maximum(count, 1) if jnp.issubdtype(x.dtype, jnp.floating) else out // jnp.maximum(count, 1)
        return out
    if reduce == "prod":
        base = x if include_self else x.at[idx].set(1)
        return base.at[idx].multiply(src)
    if reduce in ("amax", "amin"):
        fill = jnp.finfo(x.dtype).min if reduce == "amax" else jnp.finfo(x.dtype).max
        base = x if include_self else x.at[idx].set(fill)
        return base.at[idx].max(src) if reduce == "amax" else base.at[idx].min(src)
    raise NotImplementedError(f"scatter_reduce with reduce={reduce!r}")


# aten::index_copy(Tensor self, int dim, Tensor index, Tensor source) -> Tensor
@lower(aten.index_copy)
def _index_copy(ctx, x, dim, index, source):
    d = canon_dim(dim, x.ndim)
    key = (slice(None),) * d + (_wrap(index, x.shape[d]),)
    return x.at[key].set(source.astype(x.dtype))


# aten::index_add(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) -> Tensor
@lower(aten.index_add)
def _index_add(ctx, x, dim, index, source, *, alpha=1):
    d = canon_dim(dim, x.ndim)
    key = (slice(None),) * d + (_wrap(index, x.shape[d]),)
    return x.at[key].add((source * alpha).astype(x.dtype))


# aten::masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) -> Tensor
@lower(aten.masked_fill)
def _masked_fill(ctx, x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


# aten::slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor
@lower(aten.slice_scatter)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    d = canon_dim(dim, x.ndim)
    n = x.shape[d]
    start = 0 if start is None else (start + n if isinstance(start, int) and start < 0 else start)
    if isinstance(start, int) and isinstance(n, int):
        start = min(max(start, 0), n)
    length = src.shape[d]
    key = (slice(None),) * d + (slice(start, start + (length - 1) * step + 1 if step > 1 else start + length, step),)
    if step == 1:
        return lax.dynamic_update_slice_in_dim(x, src.astype(x.dtype), start, axis=d)
    return x.at[key].set(src.astype(x.dtype))


# aten::select_scatter(Tensor self, Tensor src, int dim, SymInt index) -> Tensor
@lower(aten.select_scatter)
def _select_scatter(ctx, x, src, dim, index):
    d = canon_dim(dim, x.ndim)
    if isinstance(index, int) and index < 0:
        index = index + x.shape[d]
    return lax.dynamic_update_index_in_dim(x, src.astype(x.dtype), index, axis=d)


# aten::masked_scatter(Tensor self, Tensor mask, Tensor source) -> Tensor
@lower(aten.masked_scatter)
def _masked_scatter(ctx, x, mask, source):
    # the k-th True of mask (row-major) takes source.flat[k]
    mask = jnp.broadcast_to(mask, ctx.out_shape)
    x = jnp.broadcast_to(x, ctx.out_shape)
    k = running_sum(mask.reshape(-1).astype(jnp.int32), 0) - 1
    picked = jnp.take(source.reshape(-1), jnp.clip(k, 0, max(source.size - 1, 0)), mode="clip")
    return jnp.where(mask, picked.reshape(mask.shape).astype(x.dtype), x)


# aten::diagonal_scatter(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1) -> Tensor
@lower(aten.diagonal_scatter)
def _diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = canon_dim(dim1, x.ndim), canon_dim(dim2, x.ndim)
    xt = jnp.moveaxis(x, (d1, d2), (-2, -1))                                    # (..., n1, n2)
    n = src.shape[-1]
    rows = np.arange(n) + max(-offset, 0)
    cols = np.arange(n) + max(offset, 0)
    xt = xt.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(xt, (-2, -1), (d1, d2))


# aten::scatter.reduce(Tensor self, int dim, Tensor index, Tensor src, *, str reduce) -> Tensor
# aten::scatter.value_reduce(Tensor self, int dim, Tensor index, Scalar value, *, str reduce) -> Tensor
@lower(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy_reduce(ctx, x, dim, index, src, *, reduce):
    if not hasattr(src, "shape") or src.ndim == 0:
        src = jnp.full(index.shape, src, x.dtype)
    return _scatter_reduce(ctx, x, dim, index, src, {"add": "sum", "multiply": "prod"}[reduce])


# aten::put(Tensor self, Tensor index, Tensor source, bool accumulate=False) -> Tensor
@lower(aten.put)
def _put(ctx, x, index, source, accumulate=False):
    flat = x.reshape(-1)
    idx = _wrap(index.reshape(-1), flat.shape[0])
    src = source.reshape(-1).astype(x.dtype)
    flat = flat.at[idx].add(src) if accumulate else flat.at[idx].set(src)
    return flat.reshape(x.shape)


# aten::index_reduce(Tensor self, int dim, Tensor index, Tensor source, str reduce, *, bool include_self=True) -> Tensor
@lower(aten.index_reduce)
def _index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    d = canon_dim(dim, x.ndim)
    if x.ndim == 0:
        x, source = x.reshape(1), source.reshape(1)
        return _index_reduce(ctx, x, 0, index, source, reduce, include_self=include_self).reshape(())
    # index_reduce along d == scatter_reduce with the index broadcast over source's other dims
    shape = [1] * source.ndim
    shape[d] = -1
    full = jnp.broadcast_to(_wrap(index, x.shape[d]).reshape(shape), source.shape)
    return _scatter_reduce(ctx, x, d, full, source, reduce, include_self=include_self)
