"""Elementwise ops: arithmetic, comparisons, logic, transcendental functions.

Dtype promotion is not handled here: the interpreter casts every result to
the dtype torch recorded for the node.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..composites.product_sum import product_sum
from ..registry import lower, row
from ._util import binary, unary

aten = torch.ops.aten
_M = __name__

# -- one-line table rows: aten op -> jnp function -------------------------
_abs = unary(aten.abs, fn=jnp.abs, module=_M)
_neg = unary(aten.neg, fn=jnp.negative, module=_M)
_exp = unary(aten.exp, fn=jnp.exp, module=_M)
_exp2 = unary(aten.exp2, fn=jnp.exp2, module=_M)
_expm1 = unary(aten.expm1, fn=jnp.expm1, module=_M)
_log = unary(aten.log, fn=jnp.log, module=_M)
_log2 = unary(aten.log2, fn=jnp.log2, module=_M)
_log10 = unary(aten.log10, fn=jnp.log10, module=_M)
_log1p = unary(aten.log1p, fn=jnp.log1p, module=_M)
_sqrt = unary(aten.sqrt, fn=jnp.sqrt, module=_M)
_rsqrt = unary(aten.rsqrt, fn=lax.rsqrt, module=_M)
_sin = unary(aten.sin, fn=jnp.sin, module=_M)
_cos = unary(aten.cos, fn=jnp.cos, module=_M)
_tan = unary(aten.tan, fn=jnp.tan, module=_M)
_asin = unary(aten.asin, fn=jnp.arcsin, module=_M)
_acos = unary(aten.acos, fn=jnp.arccos, module=_M)
_atan = unary(aten.atan, fn=jnp.arctan, module=_M)
_sinh = unary(aten.sinh, fn=jnp.sinh, module=_M)
_cosh = unary(aten.cosh, fn=jnp.cosh, module=_M)
_tanh = unary(aten.tanh, fn=jnp.tanh, module=_M)
_asinh = unary(aten.asinh, fn=jnp.arcsinh, module=_M)
_acosh = unary(aten.acosh, fn=jnp.arccosh, module=_M)
_atanh = unary(aten.atanh, fn=jnp.arctanh, module=_M)
_sigmoid = unary(aten.sigmoid, fn=jax.nn.sigmoid, module=_M)
_erf = unary(aten.erf, fn=jax.scipy.special.erf, module=_M)
_erfc = unary(aten.erfc, fn=jax.scipy.special.erfc, module=_M)
_erfinv = unary(aten.erfinv, fn=jax.scipy.special.erfinv, module=_M)
_floor = unary(aten.floor, fn=jnp.floor, module=_M)
_ceil = unary(aten.ceil, fn=jnp.ceil, module=_M)
_trunc = unary(aten.trunc, fn=jnp.trunc, module=_M)
_sign = unary(aten.sign, fn=jnp.sign, module=_M)
_reciprocal = unary(aten.reciprocal, fn=jnp.reciprocal, module=_M)
_isnan = unary(aten.isnan, fn=jnp.isnan, module=_M)
_isinf = unary(aten.isinf, fn=jnp.isinf, module=_M)
_bitwise_not = unary(aten.bitwise_not, fn=lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x), module=_M)
_logical_not = unary(aten.logical_not, fn=jnp.logical_not, module=_M)
_lgamma = unary(aten.lgamma, fn=jax.scipy.special.gammaln, module=_M)
_digamma = unary(aten.digamma, fn=jax.scipy.special.digamma, module=_M)

_mul = binary(aten.mul, fn=jnp.multiply, module=_M)
_eq = binary(aten.eq, fn=jnp.equal, module=_M)
_ne = binary(aten.ne, fn=jnp.not_equal, module=_M)
_lt = binary(aten.lt, fn=jnp.less, module=_M)
_le = binary(aten.le, fn=jnp.less_equal, module=_M)
_gt = binary(aten.gt, fn=jnp.greater, module=_M)
_ge = binary(aten.ge, fn=jnp.greater_equal, module=_M)
_maximum = binary(aten.maximum, fn=jnp.maximum, module=_M)
_minimum = binary(aten.minimum, fn=jnp.minimum, module=_M)
_logical_and = binary(aten.logical_and, fn=jnp.logical_and, module=_M)
_logical_or = binary(aten.logical_or, fn=jnp.logical_or, module=_M)
_logical_xor = binary(aten.logical_xor, fn=jnp.logical_xor, module=_M)
_bitwise_and = binary(aten.bitwise_and, fn=jnp.bitwise_and, module=_M)
_bitwise_or = binary(aten.bitwise_or, fn=jnp.bitwise_or, module=_M)
_bitwise_xor = binary(aten.bitwise_xor, fn=jnp.bitwise_xor, module=_M)
_atan2 = binary(aten.atan2, fn=jnp.arctan2, module=_M)
_hypot = binary(aten.hypot, fn=jnp.hypot, module=_M)
_copysign = binary(aten.copysign, fn=jnp.copysign, module=_M)
_nextafter = binary(aten.nextafter, fn=jnp.nextafter, module=_M)


def _compute(ctx, *xs):
    """Cast operands to the node's result dtype first (torch computes in it)."""
    dt = ctx.out_dtype
    return [jnp.asarray(x, dtype=dt) if not hasattr(x, "dtype") else x.astype(dt) for x in xs]


def _promoted(*targets, fn):
    """Table row: a binary op computed in torch's result dtype (operands cast first)."""
    return row(*targets, fn=lambda ctx, x, y: fn(*_compute(ctx, x, y)), module=_M)


_remainder = _promoted(aten.remainder, fn=jnp.remainder)          # Python-style modulo
_fmod = _promoted(aten.fmod, fn=jnp.fmod)                         # C-style modulo
_shl = _promoted(aten.bitwise_left_shift, fn=jnp.left_shift)
_shr = _promoted(aten.bitwise_right_shift, fn=jnp.right_shift)


# aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor
@lower(aten.add)
def _add(ctx, x, y, *, alpha=1):
    if (ops := _products(ctx, alpha)) is not None:
        return product_sum(*ops, ctx.out_shape, _order(ctx))
    x, y = _compute(ctx, x, y)
    return x + (y * alpha if alpha != 1 else y)


# aten::sub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor
@lower(aten.sub)
def _sub(ctx, x, y, *, alpha=1):
    if (ops := _products(ctx, alpha)) is not None:
        a, b, c, d = ops
        return product_sum(a, b, -c, d, ctx.out_shape, _order(ctx))     # a*b - c*d: negating c is exact
    x, y = _compute(ctx, x, y)
    return x - (y * alpha if alpha != 1 else y)


def _products(ctx, alpha) -> list | None:
    """[a, b, c, d] where this node adds (or subtracts) two f32 products a*b and c*d of tensors in a
    batch-invariant export (`hloserve export --batch-invariant`), else None. Such a sum goes through
    the hloserve.product_sum composite, whose CPU kernel rounds both products
    (exporter/composites/product_sum.py: XLA's CPU compiler fuses one of them into a multiply-add,
    which one depending on the shapes, and a rotary embedding then computed a token's query
    differently in steps of one row and of several)."""
    args = ctx.node.args
    if not ctx.interpreter.batch_invariant or alpha != 1 or len(args) != 2 or ctx.out_dtype != jnp.float32:
        return None
    if not all(isinstance(n, torch.fx.Node) and n.target == aten.mul.Tensor and len(n.args) == 2 for n in args):
        return None
    ops = [ctx.value(v) if isinstance(v, torch.fx.Node) else v for n in args for v in n.args]
    if not all(getattr(v, "dtype", None) == jnp.float32 for v in ops):
        return None
    return ops


def _order(ctx) -> tuple[int, ...] | None:
    """The dims' order the first product's first operand lies in, where it is a transpose of another
    tensor (product_sum flattens in that order), else None."""
    src = ctx.node.args[0].args[0]
    rank = len(ctx.out_shape)
    if not isinstance(src, torch.fx.Node) or len(getattr(src.meta.get("val"), "shape", ())) != rank:
        return None
    if src.target == aten.transpose.int:
        i, j = (d % rank for d in src.args[1:3])
        order = list(range(rank))
        order[i], order[j] = order[j], order[i]
        return tuple(order)
    if src.target == aten.permute.default:
        dims = [d % rank for d in src.args[1]]
        return tuple(dims.index(i) for i in range(rank))
    return None


# aten::rsub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor
@lower(aten.rsub)
def _rsub(ctx, x, y, alpha=1):
    x, y = _compute(ctx, x, y)
    return y - x * alpha


# aten::div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode) -> Tensor
@lower(aten.div)
def _div(ctx, x, y, *, rounding_mode=None):
    if rounding_mode is None:
        x, y = _compute(ctx, x, y)
        return x / y
    x, y = jnp.asarray(x), jnp.asarray(y)
    if jnp.issubdtype(ctx.out_dtype, jnp.integer):
        q = lax.div(*jnp.broadcast_arrays(x.astype(ctx.out_dtype), jnp.asarray(y, ctx.out_dtype)))
        if rounding_mode == "floor":  # lax.div truncates toward zero
            r = x - q * y
            q = jnp.where((r != 0) & ((r < 0) != (y < 0)), q - 1, q)
        return q
    x, y = _compute(ctx, x, y)
    q = x / y
    return jnp.floor(q) if rounding_mode == "floor" else jnp.trunc(q)


# aten::pow.Tensor_Tensor(Tensor self, Tensor exponent) -> Tensor
@lower(aten.pow)
def _pow(ctx, x, y):
    if isinstance(y, int) and not isinstance(y, bool) and 0 <= y <= 8:
        return lax.integer_pow(jnp.asarray(x, ctx.out_dtype), y)
    x, y = _compute(ctx, x, y)
    return jnp.power(x, y)


# aten::where.self(Tensor condition, Tensor self, Tensor other) -> Tensor
@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx, cond, x, y):
    x, y = _compute(ctx, x, y)
    return jnp.where(cond, x, y)


# aten::clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> Tensor
@lower(aten.clamp, aten.clip)
def _clamp(ctx, x, min=None, max=None):
    (x,) = _compute(ctx, x)
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min, x.dtype))
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max, x.dtype))
    return x


# aten::clamp_min(Tensor self, Scalar min) -> Tensor
@lower(aten.clamp_min)
def _clamp_min(ctx, x, min):
    return _clamp(ctx, x, min=min)


# aten::clamp_max(Tensor self, Scalar max) -> Tensor
@lower(aten.clamp_max)
def _clamp_max(ctx, x, max):
    return _clamp(ctx, x, max=max)


# aten::round(Tensor self) -> Tensor ; aten::round.decimals(Tensor self, *, int decimals) -> Tensor
@lower(aten.round)
def _round(ctx, x, *, decimals=0):
    return jnp.round(x, decimals)


# aten::relu(Tensor self) -> Tensor
@lower(aten.relu)
def _relu(ctx, x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


# aten::gelu(Tensor self, *, str approximate='none') -> Tensor
@lower(aten.gelu)
def _gelu(ctx, x, *, approximate="none"):
    return jax.nn.gelu(x, approximate=(approximate == "tanh"))


# aten::silu(Tensor self) -> Tensor
@lower(aten.silu)
def _silu(ctx, x):
    return jax.nn.silu(x)


# aten::hardtanh(Tensor self, Scalar min_val=-1, Scalar max_val=1) -> Tensor
@lower(aten.hardtanh)
def _hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    return jnp.clip(x, min_val, max_val)


# aten::leaky_relu(Tensor self, Scalar negative_slope=0.01) -> Tensor
@lower(aten.leaky_relu)
def _leaky_relu(ctx, x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


# aten::elu(Tensor self, Scalar alpha=1, Scalar scale=1, Scalar input_scale=1) -> Tensor
@lower(aten.elu)
def _elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    return scale * jnp.where(x > 0, x, alpha * jnp.expm1(x * input_scale))


# aten::logit(Tensor self, float? eps=None) -> Tensor
@lower(aten.logit)
def _logit(ctx, x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


# aten::sgn(Tensor self) -> Tensor
@lower(aten.sgn)
def _sgn(ctx, x):
    return jnp.sign(x)


# aten::frac(Tensor self) -> Tensor
@lower(aten.frac)
def _frac(ctx, x):
    return x - jnp.trunc(x)


# aten::xlogy.Tensor(Tensor self, Tensor other) -> Tensor
@lower(aten.xlogy)
def _xlogy(ctx, x, y):
    x, y = _compute(ctx, x, y)
    return jax.scipy.special.xlogy(x, y)


# aten::lerp.Scalar(Tensor self, Tensor end, Scalar weight) -> Tensor
@lower(aten.lerp)
def _lerp(ctx, x, end, weight):
    return x + weight * (end - x)


# -- special functions and IEEE helpers outside core ATen (torch keeps them whole) ----
_special = jax.scipy.special
_i0 = unary(aten.i0, aten.special_modified_bessel_i0, fn=_special.i0, module=_M)
_i0e = unary(aten.special_i0e, fn=_special.i0e, module=_M)
_i1 = unary(aten.special_i1, aten.special_modified_bessel_i1, fn=_special.i1, module=_M)
_i1e = unary(aten.special_i1e, fn=_special.i1e, module=_M)
_ndtri = unary(aten.special_ndtri, fn=_special.ndtri, module=_M)
_erfcx = unary(aten.special_erfcx, fn=_special.erfcx, module=_M)
_signbit = unary(aten.signbit, fn=jnp.signbit, module=_M)
_conj = unary(aten._conj, aten.conj_physical, fn=jnp.conj, module=_M)
_fmax = binary(aten.fmax, fn=jnp.fmax, module=_M)
_fmin = binary(aten.fmin, fn=jnp.fmin, module=_M)
_zeta = binary(aten.special_zeta, fn=_special.zeta, module=_M)
_igamma = binary(aten.igamma, fn=_special.gammainc, module=_M)
_igammac = binary(aten.igammac, fn=_special.gammaincc, module=_M)


# aten::ldexp.Tensor(Tensor self, Tensor other) -> Tensor   (self * 2**other)
@lower(aten.ldexp.Tensor)
def _ldexp(ctx, x, e):
    x, e = _compute(ctx, x, e)
    return x * jnp.exp2(e)


# aten::frexp.Tensor(Tensor self) -> (Tensor mantissa, Tensor exponent)
@lower(aten.frexp.Tensor)
def _frexp(ctx, x):
    m, e = jnp.frexp(x)
    return m, e.astype(jnp.int32)


# aten::angle(Tensor self) -> Tensor   (real input: pi for negatives, NaN stays NaN)
@lower(aten.angle)
def _angle(ctx, x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    (x,) = _compute(ctx, x)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0.0).astype(x.dtype))
