"""Matrix products and spectral (FFT) ops. Accumulation uses the input dtype's natural precision
(preferred_element_type f32 for low-precision floats), as torch does on CPU."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
import torch

from ..registry import lower

aten = torch.ops.aten
_HIGHEST = lax.Precision.HIGHEST


def _matmul(a, b, out_dtype):
    acc = jnp.float32 if a.dtype in (jnp.bfloat16, jnp.float16) else None
    return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=acc).astype(out_dtype)


# aten::mm(Tensor self, Tensor mat2) -> Tensor
@lower(aten.mm, aten.bmm, aten.matmul)
def _mm(ctx, a, b):
    return _matmul(a, b, ctx.out_dtype)


# aten::addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor
@lower(aten.addmm, aten.baddbmm)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    prod = _matmul(a, b, ctx.out_dtype)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias * beta if beta != 1 else bias).astype(ctx.out_dtype)


# aten::addmv(Tensor self, Tensor mat, Tensor vec, *, Scalar beta=1, Scalar alpha=1) -> Tensor
@lower(aten.addmv)
def _addmv(ctx, bias, a, v, *, beta=1, alpha=1):
    return _addmm(ctx, bias, a, v, beta=beta, alpha=alpha)


# aten::dot(Tensor self, Tensor tensor) -> Tensor
@lower(aten.dot, aten.vdot, aten.mv)
def _dot(ctx, a, b):
    return _matmul(a, b, ctx.out_dtype)


# -- spectral ops (core ATen keeps _fft_* whole) --------------------------------
def _fft_scale(out, n, normalization):
    """torch's fft_norm_mode: 0 none, 1 1/sqrt(n), 2 1/n."""
    if normalization == 1:
        return out / jnp.sqrt(jnp.asarray(n, out.real.dtype))
    if normalization == 2:
        return out / jnp.asarray(n, out.real.dtype)
    return out


# aten::_fft_r2c(Tensor self, int[] dim, int normalization, bool onesided) -> Tensor
@lower(aten._fft_r2c)
def _fft_r2c(ctx, x, dim, normalization, onesided):
    axes = [d % x.ndim for d in dim]
    out = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(x, axes=axes)  # unscaled forward
    return _fft_scale(out, math.prod(x.shape[d] for d in axes), normalization)


# aten::_fft_c2r(Tensor self, int[] dim, int normalization, SymInt last_dim_size) -> Tensor
@lower(aten._fft_c2r)
def _fft_c2r(ctx, x, dim, normalization, last_dim_size):
    axes = [d % x.ndim for d in dim]
    sizes = [x.shape[d] for d in axes[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")  # "forward": the inverse is unscaled
    return _fft_scale(out, math.prod(sizes), normalization)


# aten::_fft_c2c(Tensor self, SymInt[] dim, int normalization, bool forward) -> Tensor
@lower(aten._fft_c2c)
def _fft_c2c(ctx, x, dim, normalization, forward):
    axes = [d % x.ndim for d in dim]
    out = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _fft_scale(out, math.prod(x.shape[d] for d in axes), normalization)
