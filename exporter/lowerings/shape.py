"""Shape and layout ops: views, permutes, concatenation, slicing, padding, dtype casts.

Target shapes come from `ctx.out_shape` (torch's own symbolic shape for the
node, in jax dim expressions), so `-1` and symbolic sizes never need solving
here.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import lower
from ._util import canon_dim

aten = torch.ops.aten


# aten::view(Tensor(a) self, SymInt[] size) -> Tensor(a)
@lower(aten.view.default, aten._unsafe_view, aten.reshape, aten.view_copy.default)
def _view(ctx, x, size):
    return jnp.reshape(x, ctx.out_shape)


# aten::view.dtype(Tensor(a) self, ScalarType dtype) -> Tensor(a)   (bitcast)
@lower(aten.view.dtype)
def _view_dtype(ctx, x, dtype):
    out = ctx.out_dtype
    if jnp.dtype(out).itemsize == x.dtype.itemsize:
        return lax.bitcast_convert_type(x, out)
    raise NotImplementedError("view(dtype) between different item sizes")


# aten::expand(Tensor(a) self, SymInt[] size, *, bool implicit=False) -> Tensor(a)
@lower(aten.expand, aten.expand_copy)
def _expand(ctx, x, size, *, implicit=False):
    return jnp.broadcast_to(x, ctx.out_shape)


# aten::permute(Tensor(a) self, int[] dims) -> Tensor(a)
@lower(aten.permute, aten.permute_copy)
def _permute(ctx, x, dims):
    return jnp.transpose(x, [canon_dim(d, x.ndim) for d in dims])


# aten::transpose.int(Tensor(a) self, int dim0, int dim1) -> Tensor(a)
@lower(aten.transpose.int)
def _transpose(ctx, x, dim0, dim1):
    return jnp.swapaxes(x, canon_dim(dim0, x.ndim), canon_dim(dim1, x.ndim)) if x.ndim else x


# aten::t(Tensor(a) self) -> Tensor(a)
@lower(aten.t)
def _t(ctx, x):
    return x.T


# aten::unsqueeze(Tensor(a) self, int dim) -> Tensor(a)
@lower(aten.unsqueeze, aten.unsqueeze_copy)
def _unsqueeze(ctx, x, dim):
    return jnp.expand_dims(x, canon_dim(dim, x.ndim + 1))


# aten::squeeze.dims(Tensor(a) self, int[] dim) -> Tensor(a)
@lower(aten.squeeze, aten.squeeze_copy)
def _squeeze(ctx, x, dim=None):
    return jnp.reshape(x, ctx.out_shape)


# aten::cat(Tensor[] tensors, int dim=0) -> Tensor
@lower(aten.cat)
def _cat(ctx, tensors, dim=0):
    dt = ctx.out_dtype
    # torch skips legacy empty 1-D tensors of shape [0]
    parts = [t.astype(dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and ctx.out_val.ndim != 1)]
    return jnp.concatenate(parts, axis=canon_dim(dim, ctx.out_val.ndim))


# aten::stack(Tensor[] tensors, int dim=0) -> Tensor
@lower(aten.stack)
def _stack(ctx, tensors, dim=0):
    return jnp.stack([t.astype(ctx.out_dtype) for t in tensors], axis=canon_dim(dim, ctx.out_val.ndim))


# aten::split_with_sizes(Tensor(a -> *) self, SymInt[] split_sizes, int dim=0) -> Tensor(a)[]
@lower(aten.split_with_sizes, aten.split_with_sizes_copy)
def _split_with_sizes(ctx, x, sizes, dim=0):
    d = canon_dim(dim, x.ndim)
    outs, start = [], 0
    for s in sizes:
        s = ctx.to_jax_dim(s)
        outs.append(lax.slice_in_dim(x, start, start + s, axis=d))
        start = start + s
    return outs


# aten::split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]
@lower(aten.split.Tensor, aten.split_copy.Tensor)
def _split(ctx, x, split_size, dim=0):
    d = canon_dim(dim, x.ndim)
    sizes = [ctx.to_jax_dim(v.shape[d]) for v in ctx.out_val]
    return _split_with_sizes(ctx, x, sizes, d)


# aten::unbind.int(Tensor(a -> *) self, int dim=0) -> Tensor(a)[]
@lower(aten.unbind, aten.unbind_copy)
def _unbind(ctx, x, dim=0):
    d = canon_dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


# aten::slice.Tensor(Tensor(a) self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor(a)
@lower(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    d = canon_dim(dim, x.ndim)
    n = x.shape[d]
    # torch clamps start/end into [0, n]; the node's output length is known.
    length = ctx.out_shape[d]
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        start = 0 if isinstance(n, int) and start + n < 0 else start + n
    if isinstance(start, int) and isinstance(n, int):
        start = min(start, n)
    if isinstance(length, int) and length == 0:
        return jnp.zeros(ctx.out_shape, x.dtype)
    limit = start + (length - 1) * step + 1
    return lax.slice_in_dim(x, start, limit, stride=step, axis=d)


# aten::select.int(Tensor(a) self, int dim, SymInt index) -> Tensor(a)
@lower(aten.select.int, aten.select_copy.int)
def _select(ctx, x, dim, index):
    d = canon_dim(dim, x.ndim)
    if isinstance(index, int) and index < 0:
        index = index + x.shape[d]
    return lax.index_in_dim(x, index, axis=d, keepdims=False)


# aten::narrow(Tensor(a) self, int dim, SymInt start, SymInt length) -> Tensor(a)
@lower(aten.narrow, aten.narrow_copy)
def _narrow(ctx, x, dim, start, length):
    d = canon_dim(dim, x.ndim)
    return lax.slice_in_dim(x, start, start + length, axis=d)


# aten::clone(Tensor self, *, MemoryFormat? memory_format=None) -> Tensor
@lower(aten.clone, aten.alias, aten.alias_copy, aten.detach, aten.detach_copy, aten.lift_fresh_copy,
       aten.contiguous, aten.lift_fresh)
def _identity(ctx, x, *args, **kwargs):
    return x


# aten::_to_copy(Tensor self, *, ScalarType? dtype=None, ..., MemoryFormat? memory_format=None) -> Tensor
@lower(aten._to_copy)
def _to_copy(ctx, x, **kwargs):
    return jnp.asarray(x).astype(ctx.out_dtype)


# aten::copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor
@lower(aten.copy)
def _copy(ctx, x, src, non_blocking=False):
    return jnp.broadcast_to(jnp.asarray(src).astype(x.dtype), x.shape)


# aten::flip(Tensor self, int[] dims) -> Tensor
@lower(aten.flip)
def _flip(ctx, x, dims):
    return jnp.flip(x, [canon_dim(d, x.ndim) for d in dims]) if x.ndim else x


# aten::roll(Tensor self, SymInt[1] shifts, int[1] dims=[]) -> Tensor
@lower(aten.roll)
def _roll(ctx, x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, shifts, [canon_dim(d, x.ndim) for d in dims])


# aten::repeat(Tensor self, SymInt[] repeats) -> Tensor
@lower(aten.repeat)
def _repeat(ctx, x, repeats):
    x = x.reshape((1,) * (len(repeats) - x.ndim) + tuple(x.shape))
    return jnp.tile(x, repeats)


# aten::constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0) -> Tensor
@lower(aten.constant_pad_nd)
def _constant_pad_nd(ctx, x, pad, value=0):
    # pad lists (before, after) pairs from the LAST dim backwards; negatives crop.
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        cfg[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), cfg)


# aten::tril(Tensor self, int diagonal=0) -> Tensor
@lower(aten.tril)
def _tril(ctx, x, diagonal=0):
    return jnp.tril(x, diagonal)


# aten::triu(Tensor self, int diagonal=0) -> Tensor
@lower(aten.triu)
def _triu(ctx, x, diagonal=0):
    return jnp.triu(x, diagonal)


# aten::pixel_shuffle(Tensor self, int upscale_factor) -> Tensor
@lower(aten.pixel_shuffle)
def _pixel_shuffle(ctx, x, r):
    *b, c, h, w = x.shape
    x = x.reshape(*b, c // (r * r), r, r, h, w)          # (..., C', r, r, H, W)
    n = len(b)
    x = jnp.transpose(x, (*range(n), n, n + 3, n + 1, n + 4, n + 2))  # (..., C', H, r, W, r)
    return x.reshape(ctx.out_shape)


# aten::diagonal(Tensor(a) self, int offset=0, int dim1=0, int dim2=1) -> Tensor(a)
@lower(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, canon_dim(dim1, x.ndim), canon_dim(dim2, x.ndim))  # diag on the last axis


# aten::as_strided(Tensor(a) self, SymInt[] size, SymInt[] stride, SymInt? storage_offset=None) -> Tensor(a)
@lower(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(ctx, x, size, stride, storage_offset=None):
    # size/stride address x's storage. Our array is x in logical order; rebuild the storage torch
    # would see from the input's recorded strides (identical to x.reshape(-1) when contiguous).
    val = ctx.node.args[0].meta["val"]
    in_strides, in_offset = tuple(val.stride()), int(val.storage_offset())
    if not all(isinstance(d, int) for d in (*x.shape, *size, *stride, *in_strides)):
        raise NotImplementedError("as_strided over symbolic sizes or strides; export with static shapes")
    offset = in_offset if storage_offset is None else storage_offset
    if tuple(val.shape) and val.is_contiguous() and in_offset == 0:
        storage = x.reshape(-1)
    else:
        extent = in_offset + sum((n - 1) * st for n, st in zip(x.shape, in_strides)) + 1 if x.size else 0
        where = in_offset + sum(jnp.arange(n).reshape((-1,) + (1,) * (x.ndim - 1 - k)) * st
                                for k, (n, st) in enumerate(zip(x.shape, in_strides)))
        storage = jnp.zeros((max(extent, 1),), x.dtype).at[jnp.reshape(where, -1)].set(x.reshape(-1))
    idx = offset + sum(np.arange(n).reshape((-1,) + (1,) * (len(size) - 1 - k)) * st
                       for k, (n, st) in enumerate(zip(size, stride)))
    idx = np.broadcast_to(idx, tuple(size))                                       # (*size)
    if idx.size and (idx.min() < in_offset or idx.max() >= storage.shape[0]):  # storage holds [in_offset, end)
        raise NotImplementedError(
            f"as_strided reads storage elements outside its input (offsets {idx.min()}..{idx.max()}, input at "
            f"{in_offset}, {x.size} elements); an exported input carries only its own elements")
    return jnp.take(storage, jnp.asarray(idx), mode="clip")


# aten::unfold(Tensor(a) self, int dimension, int size, int step) -> Tensor(a)
@lower(aten.unfold, aten.unfold_copy)
def _unfold(ctx, x, dimension, size, step):
    if x.ndim == 0:
        return x.reshape(1)
    d = canon_dim(dimension, x.ndim)
    n = (x.shape[d] - size) // step + 1
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]               # (n, size)
    win = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=d)                      # (..., n*size, ...)
    win = win.reshape(x.shape[:d] + (n, size) + x.shape[d + 1:])                 # (..., n, size, ...)
    return jnp.moveaxis(win, d + 1, -1)                                          # (..., n, ..., size)
