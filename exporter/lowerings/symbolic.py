"""Symbolic-int ops: sizes read off tensors and the Python arithmetic torch.export
records on them. Values are ints or jax dim expressions, never arrays."""
from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import torch

from .. import _private as jax_core
from ..registry import lower, row
from ._util import canon_dim

aten = torch.ops.aten
_M = __name__


# aten::sym_size.int(Tensor self, int dim) -> SymInt
@lower(aten.sym_size.int)
def _sym_size(ctx, x, dim):
    return x.shape[canon_dim(dim, x.ndim)]


# aten::sym_numel(Tensor self) -> SymInt
@lower(aten.sym_numel)
def _sym_numel(ctx, x):
    return math.prod(x.shape)


# aten::sym_stride.int(Tensor self, int dim) -> SymInt   (contiguous strides)
@lower(aten.sym_stride.int)
def _sym_stride(ctx, x, dim):
    return math.prod(x.shape[canon_dim(dim, x.ndim) + 1:])


_add = row(operator.add, fn=lambda ctx, a, b: a + b, module=_M)
_sub = row(operator.sub, fn=lambda ctx, a, b: a - b, module=_M)
_mul = row(operator.mul, fn=lambda ctx, a, b: a * b, module=_M)
_floordiv = row(operator.floordiv, fn=lambda ctx, a, b: a // b, module=_M)
_mod = row(operator.mod, fn=lambda ctx, a, b: a % b, module=_M)
_neg = row(operator.neg, fn=lambda ctx, a: -a, module=_M)
_truediv = row(operator.truediv, fn=lambda ctx, a, b: a / b, module=_M)
_max = row(torch.sym_max, fn=lambda ctx, a, b: jax_core.max_dim(a, b), module=_M)
_min = row(torch.sym_min, fn=lambda ctx, a, b: jax_core.min_dim(a, b), module=_M)
_sym_float = row(torch.sym_float, fn=lambda ctx, a: a, module=_M)
_sym_int = row(torch.sym_int, fn=lambda ctx, a: a, module=_M)


def _compare(op):
    """A SymInt comparison: a Python bool when the dims' ranges decide it, else a
    bool array computed from the runtime dims (e.g. the predicate of a torch.cond)."""
    def fn(ctx, a, b):
        try:
            return op(a, b)
        except jax_core.InconclusiveDimensionOperation:
            return op(jnp.asarray(a), jnp.asarray(b))
    return fn


_gt = row(operator.gt, fn=_compare(operator.gt), module=_M)
_ge = row(operator.ge, fn=_compare(operator.ge), module=_M)
_lt = row(operator.lt, fn=_compare(operator.lt), module=_M)
_le = row(operator.le, fn=_compare(operator.le), module=_M)
_eq = row(operator.eq, fn=_compare(operator.eq), module=_M)
_ne = row(operator.ne, fn=_compare(operator.ne), module=_M)
