"""Matrix products and spectral (FFT) ops. Accumulation uses the input dtype's natural precision
(preferred_element_type f32 for low-precision floats), as torch does on CPU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..registry import lower

aten = torch.ops.aten
_HIGHEST = lax.Precision.HIGHEST


def _matmul(a, b, out_dtype):
    if a.dtype in (jnp.bfloat16, jnp.float16):
        # 16-bit products are exact in f32, so precision has nothing to add; HIGHEST would make
        # XLA:CPU widen both operands to f32 and lose its bf16 kernels (2x slower than f32).
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(out_dtype)
    return jnp.matmul(a, b, precision=_HIGHEST).astype(out_dtype)


def _scale_add(prod, bias, alpha, beta, out_dtype):
    """alpha * prod + beta * bias, as torch's add*mm family (beta=0 ignores bias, even NaN)."""
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias * beta if beta != 1 else bias).astype(out_dtype)


# aten::mm(Tensor self, Tensor mat2) -> Tensor
@lower(aten.mm, aten.bmm, aten.matmul)
def _mm(ctx, a, b):
    return _matmul(a, b, ctx.out_dtype)


# aten::addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor
@lower(aten.addmm, aten.baddbmm)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    prod = _matmul(a, b, ctx.out_dtype)
    return _scale_add(prod, bias, alpha, beta, ctx.out_dtype)


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


# -- factorizations and solvers outside core ATen (torch keeps them whole) -------------
def _lu(a):
    """LU with torch's conventions: (LU, 1-based int32 pivots)."""
    lu, piv, _ = lax.linalg.lu(a)
    return lu, piv.astype(jnp.int32) + 1


def _ok(a):
    """The `info` output: 0 for every matrix (jax does not report failures)."""
    return jnp.zeros(a.shape[:-2], jnp.int32)


# aten::linalg_inv_ex(Tensor A, *, bool check_errors=False) -> (Tensor inverse, Tensor info)
@lower(aten.linalg_inv_ex)
def _inv_ex(ctx, a, *, check_errors=False):
    return jnp.linalg.inv(a), _ok(a)


# aten::linalg_cholesky_ex(Tensor self, *, bool upper=False, bool check_errors=False) -> (Tensor L, Tensor info)
@lower(aten.linalg_cholesky_ex)
def _cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    return _cholesky(ctx, a, upper), _ok(a)


# aten::cholesky(Tensor self, bool upper=False) -> Tensor
@lower(aten.cholesky)
def _cholesky(ctx, a, upper=False):
    low = jnp.linalg.cholesky(a)
    return jnp.swapaxes(low, -1, -2).conj() if upper else low


# aten::cholesky_solve(Tensor self, Tensor input2, bool upper=False) -> Tensor   (solves A X = self, A = L L^H)
@lower(aten.cholesky_solve)
def _cholesky_solve(ctx, b, factor, upper=False):
    batch = ctx.out_shape[:-2]
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    factor = jnp.broadcast_to(factor, batch + factor.shape[-2:])
    return jax.scipy.linalg.cho_solve((factor, not upper), b)


# aten::cholesky_inverse(Tensor self, bool upper=False) -> Tensor
@lower(aten.cholesky_inverse)
def _cholesky_inverse(ctx, factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return jax.scipy.linalg.cho_solve((factor, not upper), eye)


# aten::_linalg_det(Tensor A) -> (Tensor result, Tensor LU, Tensor pivots)
@lower(aten._linalg_det)
def _det(ctx, a):
    lu, piv = _lu(a)
    return jnp.linalg.det(a), lu, piv


# aten::_linalg_slogdet(Tensor A) -> (Tensor sign, Tensor logabsdet, Tensor LU, Tensor pivots)
@lower(aten._linalg_slogdet)
def _slogdet(ctx, a):
    sign, logabsdet = jnp.linalg.slogdet(a)
    lu, piv = _lu(a)
    return sign, logabsdet, lu, piv


# aten::_linalg_solve_ex(Tensor A, Tensor B, *, bool left=True, bool check_errors=False)
#     -> (Tensor result, Tensor LU, Tensor pivots, Tensor info)
@lower(aten._linalg_solve_ex)
def _solve_ex(ctx, a, b, *, left=True, check_errors=False):
    out_shape = ctx.out_shape
    vector = len(out_shape) == a.ndim - 1 or b.ndim == 1       # torch treats B as a (batch of) vector(s)
    if not left:  # X A = B  <=>  A^T X^T = B^T
        a, b = jnp.swapaxes(a, -1, -2), jnp.swapaxes(b, -1, -2)
    bm = b[..., None] if vector else b                         # (..., n, k)
    batch = tuple(out_shape[:-1] if vector else out_shape[:-2])
    x = jnp.linalg.solve(jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(bm, batch + bm.shape[-2:]))
    x = x[..., 0] if vector else x
    if not left:
        x = jnp.swapaxes(x, -1, -2)
    lu, piv = _lu(a)
    return x, lu, piv, _ok(a)


# aten::linalg_qr(Tensor A, str mode='reduced') -> (Tensor Q, Tensor R)
@lower(aten.linalg_qr)
def _qr(ctx, a, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


# aten::linalg_solve_triangular(Tensor self, Tensor B, *, bool upper, bool left=True, bool unitriangular=False) -> Tensor
@lower(aten.linalg_solve_triangular)
def _solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    batch = ctx.out_shape[:-2]
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


# aten::triangular_solve(Tensor self, Tensor A, bool upper=True, bool transpose=False, bool unitriangular=False)
#     -> (Tensor solution, Tensor cloned_coefficient)
@lower(aten.triangular_solve)
def _triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    batch = ctx.out_shape[:-2]
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, a


# aten::linalg_matrix_exp(Tensor self) -> Tensor
@lower(aten.linalg_matrix_exp)
def _matrix_exp(ctx, a):
    return jax.scipy.linalg.expm(a)


# aten::addbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1) -> Tensor
@lower(aten.addbmm)
def _addbmm(ctx, bias, b1, b2, *, beta=1, alpha=1):
    prod = jnp.sum(_matmul(b1, b2, ctx.out_dtype), axis=0)
    return _scale_add(prod, bias, alpha, beta, ctx.out_dtype)


# aten::dist(Tensor self, Tensor other, Scalar p=2) -> Tensor
@lower(aten.dist)
def _dist(ctx, a, b, p=2):
    d = jnp.abs(a - b).reshape(-1)
    if p == 0:
        return jnp.sum(d != 0).astype(ctx.out_dtype)
    if p == math.inf:
        return jnp.max(d, initial=0.0)
    if p == -math.inf:
        return jnp.min(d, initial=jnp.inf)
    return jnp.sum(d ** p) ** (1.0 / p)


# aten::_linalg_check_errors(Tensor info, str api_name, *, bool is_matrix) -> ()
@lower(aten._linalg_check_errors)
def _linalg_check_errors(ctx, info, api_name, *, is_matrix):
    # jax's factorizations report no `info`, so there is nothing to check: a singular or
    # non-positive-definite input gives NaNs/infs instead of torch's error.
    return None


# aten::_trilinear(Tensor i1, Tensor i2, Tensor i3, int[] expand1, int[] expand2, int[] expand3, int[] sumdim,
#                  int unroll_dim=1) -> Tensor   (nn.functional.bilinear)
@lower(aten._trilinear)
def _trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    # unsqueeze each operand at its expand dims, multiply with broadcasting, sum out `sumdim`
    i1 = jnp.expand_dims(i1, tuple(expand1)) if expand1 else i1
    i2 = jnp.expand_dims(i2, tuple(expand2)) if expand2 else i2
    i3 = jnp.expand_dims(i3, tuple(expand3)) if expand3 else i3
    return jnp.sum(i1 * i2 * i3, axis=tuple(sumdim))


def _empty_like_out(ctx, i, dtype):
    """Zeros shaped like the node's i-th output (torch returns empty U/V when they are not computed)."""
    return jnp.zeros(ctx.interpreter.symbols.shape(ctx.out_val[i]), dtype)


# aten::_linalg_svd(Tensor A, bool full_matrices=False, bool compute_uv=True, *, str? driver=None)
#     -> (Tensor U, Tensor S, Tensor Vh)
@lower(aten._linalg_svd)
def _svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        return _empty_like_out(ctx, 0, a.dtype), jnp.linalg.svd(a, compute_uv=False), _empty_like_out(ctx, 2, a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)   # LAPACK gesdd, as torch on CPU
    return u, s, vh


# aten::_linalg_eigh(Tensor A, str UPLO="L", bool compute_v=True) -> (Tensor eigenvalues, Tensor eigenvectors)
@lower(aten._linalg_eigh)
def _eigh(ctx, a, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return w, (v if compute_v else _empty_like_out(ctx, 1, a.dtype))
