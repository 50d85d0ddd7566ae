"""Matrix products. Accumulation uses the input dtype's natural precision
(preferred_element_type f32 for low-precision floats), as torch does on CPU."""
from __future__ import annotations

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
