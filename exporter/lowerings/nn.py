"""Neural-network ops core ATen keeps whole: convolution, pooling, normalization,
attention, upsampling."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import lower
from .reduction import mean_of

aten = torch.ops.aten


def _spatial_rank(ctx, stem: str) -> int:
    """'max_pool2d_with_indices' -> 2: the op name carries the spatial rank."""
    return int(ctx.node.target.__name__.split(stem)[1][0])


def _tuple(v, n):
    return tuple(v) * n if len(v) == 1 else tuple(v)


# aten::convolution(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding,
#                   SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups) -> Tensor
@lower(aten.convolution)
def _convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = w.ndim - 2
    stride, padding, dilation = _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    if not transposed:
        out = lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=dn, feature_group_count=groups, precision=lax.Precision.HIGHEST,
            preferred_element_type=acc)
    else:
        # Transposed conv = input-dilated conv with the kernel flipped and in/out swapped per group.
        output_padding = _tuple(output_padding, nd)
        cin = w.shape[0]
        w = w.reshape(groups, cin // groups, *w.shape[1:])            # (G, Cin/G, Cout/G, *k)
        w = jnp.swapaxes(w, 1, 2).reshape(-1, cin // groups, *w.shape[3:])  # (Cout, Cin/G, *k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
                for k, p, d, op in zip(w.shape[2:], padding, dilation, output_padding)]
        out = lax.conv_general_dilated(
            x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
            dimension_numbers=dn, feature_group_count=groups, precision=lax.Precision.HIGHEST,
            preferred_element_type=acc)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(out.dtype)
    out = out.astype(ctx.out_dtype)
    return out[0] if unbatched else out


def _pool_window(x, nd, kernel, stride, padding, dilation, init, op, ceil_mode):
    kernel = _tuple(kernel, nd)
    stride = _tuple(stride, nd) if stride else kernel
    padding, dilation = _tuple(padding, nd), _tuple(dilation, nd)
    lead = x.ndim - nd
    pads = []
    for i in range(nd):
        size = x.shape[lead + i]
        eff = dilation[i] * (kernel[i] - 1) + 1
        extra = 0
        if ceil_mode:
            out = math.ceil((size + 2 * padding[i] - eff) / stride[i]) + 1
            if (out - 1) * stride[i] >= size + padding[i]:
                out -= 1
            extra = max(0, (out - 1) * stride[i] + eff - (size + 2 * padding[i]))
        pads.append((padding[i], padding[i] + extra))
    return lax.reduce_window(
        x, init, op, (1,) * lead + kernel, (1,) * lead + stride, [(0, 0)] * lead + pads,
        window_dilation=(1,) * lead + dilation), kernel, stride, pads


# aten::max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0,
#                               int[2] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)
@lower(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices)
def _max_pool_with_indices(ctx, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    nd = _spatial_rank(ctx, "max_pool")
    init = jnp.array(-jnp.inf, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    vals, *_ = _pool_window(x, nd, kernel, stride, padding, dilation, init, lax.max, ceil_mode)
    # Indices (flat over the spatial dims, as torch) via a paired reduction.
    lead = x.ndim - nd
    spatial = x.shape[lead:]
    flat = jnp.arange(math.prod(spatial), dtype=jnp.int32).reshape(spatial)
    flat = jnp.broadcast_to(flat, x.shape)

    def pick(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = (bv > av) | ((bv == av) & (bi < ai)) | jnp.isnan(bv)
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    kernel_t = _tuple(kernel, nd)
    stride_t = _tuple(stride, nd) if stride else kernel_t
    _, _, _, pads = _pool_window(x, nd, kernel, stride, padding, dilation, init, lax.max, ceil_mode)
    _, idx = lax.reduce_window(
        (x, flat), (init, jnp.array(-1, jnp.int32)), pick, (1,) * lead + kernel_t, (1,) * lead + stride_t,
        [(0, 0)] * lead + pads, window_dilation=(1,) * lead + _tuple(dilation, nd))
    return vals, idx


# aten::avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0,
#                  bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor
@lower(aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d)
def _avg_pool(ctx, x, kernel, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    nd = _spatial_rank(ctx, "avg_pool")
    zero = jnp.array(0, x.dtype)
    sums, kernel, stride, pads = _pool_window(x, nd, kernel, stride, padding, (1,), zero, lax.add, ceil_mode)
    if divisor_override:
        return sums / divisor_override
    lead = x.ndim - nd
    ones = jnp.ones(x.shape[lead:], x.dtype)
    if count_include_pad:
        # count padding (but not ceil_mode overhang) as elements
        padded = _tuple(padding, nd)
        ones = jnp.pad(ones, [(p, p) for p in padded], constant_values=1)
        pads = [(0, hi - lo) for (lo, hi) in pads]
    counts = lax.reduce_window(ones, zero, lax.add, kernel, stride, pads)
    return sums / counts


# aten::_adaptive_avg_pool2d(Tensor self, SymInt[2] output_size) -> Tensor
@lower(aten._adaptive_avg_pool2d, aten.adaptive_avg_pool1d, aten._adaptive_avg_pool3d)
def _adaptive_avg_pool(ctx, x, output_size):
    nd = len(output_size)
    lead = x.ndim - nd
    out = x
    for i, o in enumerate(output_size):
        d = lead + i
        n = x.shape[d]
        parts = []
        for j in range(o):
            s, e = (j * n) // o, -((-(j + 1) * n) // o)
            parts.append(jnp.mean(lax.slice_in_dim(out, s, e, axis=d), axis=d, keepdims=True))
        out = jnp.concatenate(parts, axis=d)
    return out


# aten::native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps)
#   -> (Tensor, Tensor, Tensor)
@lower(aten.native_layer_norm)
def _native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x
    mean = mean_of(ctx, xf, axes, True)        # batch-invariant exports: through hloserve.row_sum
    var = mean_of(ctx, jnp.square(xf - mean), axes, True)
    rstd = lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(x.dtype), mean, rstd


# aten::native_group_norm(Tensor input, Tensor? weight, Tensor? bias, SymInt N, SymInt C, SymInt HxW,
#                         int group, float eps) -> (Tensor, Tensor, Tensor)
@lower(aten.native_group_norm)
def _native_group_norm(ctx, x, weight, bias, n, c, hw, group, eps):
    shape = x.shape
    xg = x.reshape(n, group, (c // group) * hw)              # (N, G, C/G * HxW)
    mean = jnp.mean(xg, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=-1, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = ((xg - mean) * rstd).reshape(shape)
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(bshape)
    if bias is not None:
        out = out + bias.reshape(bshape)
    return out, mean.reshape(n, group), rstd.reshape(n, group)


# aten::_native_batch_norm_legit_no_training(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean,
#                                            Tensor running_var, float momentum, float eps) -> (Tensor, Tensor, Tensor)
@lower(aten._native_batch_norm_legit_no_training)
def _batch_norm_inference(ctx, x, weight, bias, mean, var, momentum, eps):
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    out = (x - mean.reshape(bshape)) * lax.rsqrt(var.reshape(bshape) + eps)
    if weight is not None:
        out = out * weight.reshape(bshape)
    if bias is not None:
        out = out + bias.reshape(bshape)
    empty = jnp.zeros((0,), x.dtype)
    return out, empty, empty


# aten::_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean,
#     Tensor running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)
@lower(aten._native_batch_norm_legit_functional)
def _batch_norm_functional(ctx, x, weight, bias, mean, var, training, momentum, eps):
    if not training:
        out, _, _ = _batch_norm_inference(ctx, x, weight, bias, mean, var, momentum, eps)
        empty = jnp.zeros((0,), x.dtype)
        return out, empty, empty, mean, var
    out, batch_mean, rstd, batch_var = _batch_norm_train(x, weight, bias, eps)
    count = x.size // x.shape[1]
    unbiased = batch_var * (count / max(count - 1, 1))
    return (out, batch_mean, rstd, (1 - momentum) * mean + momentum * batch_mean.astype(mean.dtype),
            (1 - momentum) * var + momentum * unbiased.astype(var.dtype))


def _batch_norm_train(x, weight, bias, eps):
    """Normalize with batch statistics over every dim but 1: (out, mean[C], rstd[C], biased var[C])."""
    axes = (0,) + tuple(range(2, x.ndim))
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - mean.reshape(bshape)), axis=axes)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean.reshape(bshape)) * rstd.reshape(bshape)
    if weight is not None:
        out = out * weight.reshape(bshape)
    if bias is not None:
        out = out + bias.reshape(bshape)
    return out, mean, rstd, var


# aten::_native_batch_norm_legit.no_stats(Tensor input, Tensor? weight, Tensor? bias, bool training,
#                                         float momentum, float eps) -> (Tensor, Tensor, Tensor)
@lower(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(ctx, x, weight, bias, training, momentum, eps):
    out, mean, rstd, _ = _batch_norm_train(x, weight, bias, eps)
    return out, mean, rstd


# aten::upsample_nearest2d.vec(Tensor input, SymInt[]? output_size, float[]? scale_factors) -> Tensor
@lower(aten.upsample_nearest2d, aten.upsample_nearest1d, aten.upsample_nearest3d)
def _upsample_nearest(ctx, x, output_size=None, *scales):
    out_shape = ctx.out_shape
    nd = len(out_shape) - 2
    if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], (list, tuple))):
        scales = tuple(scales[0]) if scales[0] is not None else ()  # .vec: one list or None
    scales = tuple(scales) + (None,) * (nd - len(scales))
    for i in range(nd):
        d = 2 + i
        n_in, n_out = x.shape[d], out_shape[d]
        # torch's nearest_neighbor_compute_source_index: floor(dst * scale) in float32, where scale is
        # 1/scale_factor when the caller gave one, else in/out
        scale = np.float32(1.0 / scales[i]) if scales[i] else np.float32(n_in) / np.float32(n_out)
        idx = jnp.floor(jnp.arange(n_out, dtype=jnp.float32) * scale).astype(jnp.int32)
        x = jnp.take(x, jnp.minimum(idx, n_in - 1), axis=d)
    return x


# aten::upsample_bilinear2d.vec(Tensor input, SymInt[]? output_size, bool align_corners, float[]? scale_factors) -> Tensor
# aten::upsample_bilinear2d(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None,
#     float? scales_w=None) -> Tensor   (likewise upsample_linear1d, upsample_trilinear3d)
@lower(aten.upsample_bilinear2d, aten.upsample_linear1d, aten.upsample_trilinear3d)
def _upsample_linear(ctx, x, output_size, align_corners, *scales):
    out_shape = ctx.out_shape
    nd = len(out_shape) - 2
    if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], (list, tuple))):
        scales = tuple(scales[0]) if scales[0] is not None else ()  # .vec: one list or None
    scales = tuple(scales) + (None,) * (nd - len(scales))
    for i in range(nd):  # separable: interpolate one spatial dim at a time, as torch's kernels do
        d = 2 + i
        n_in, n_out = x.shape[d], out_shape[d]
        if not (isinstance(n_in, int) and isinstance(n_out, int)):
            raise NotImplementedError(f"linear upsampling over a symbolic spatial dim ({n_in} -> {n_out}); "
                                      f"export with static image sizes")
        # torch's area_pixel_compute_scale / area_pixel_compute_source_index (linear modes clamp at 0)
        dst = jnp.arange(n_out, dtype=jnp.float32)
        if align_corners:
            src = dst * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
        else:
            ratio = 1.0 / scales[i] if scales[i] else n_in / n_out
            src = jnp.maximum((dst + 0.5) * ratio - 0.5, 0.0)
        i0 = jnp.minimum(jnp.floor(src).astype(jnp.int32), n_in - 1)
        i1 = jnp.minimum(i0 + 1, n_in - 1)
        w1 = (src - i0).astype(x.dtype).reshape((n_out,) + (1,) * (x.ndim - d - 1))  # broadcast along dim d
        x = jnp.take(x, i0, axis=d) * (1 - w1) + jnp.take(x, i1, axis=d) * w1
    return x


# aten::_scaled_dot_product_flash_attention_for_cpu / scaled_dot_product_attention: decomposed by torch
# before reaching us in the default table; kept here for programs that preserve it.
# aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None,
#     float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor
@lower(aten.scaled_dot_product_attention)
def _sdpa(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision=lax.Precision.HIGHEST) * scale  # (..., L, S)
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((L, S), bool)), s, -jnp.inf)
    if attn_mask is not None:
        s = jnp.where(attn_mask, s, -jnp.inf) if attn_mask.dtype == jnp.bool_ else s + attn_mask
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("...qk,...kd->...qd", p, v, precision=lax.Precision.HIGHEST)


# aten::max_pool2d_with_indices_backward(Tensor grad_output, Tensor self, int[2] kernel_size, int[2] stride,
#     int[2] padding, int[2] dilation, bool ceil_mode, Tensor indices) -> Tensor
@lower(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)
def _max_pool_backward(ctx, grad, x, kernel, stride, padding, dilation, ceil_mode, indices):
    nd = _spatial_rank(ctx, "max_pool")
    lead = x.shape[:x.ndim - nd]
    rows = math.prod(lead)
    spatial = math.prod(x.shape[x.ndim - nd:])
    g = grad.reshape(rows, -1)                                   # (N*C, out spatial)
    idx = indices.reshape(rows, -1)
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], idx.shape)
    out = jnp.zeros((rows, spatial), grad.dtype).at[r, idx].add(g)  # (N*C, in spatial)
    return out.reshape(x.shape)


def _pairwise_dist(a, b, p):
    """(..., P, M), (..., R, M) -> (..., P, R) p-norm distances, computed from differences."""
    diff = jnp.abs(a[..., :, None, :] - b[..., None, :, :])   # (..., P, R, M)
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(a.dtype)
    if p == math.inf:
        return jnp.max(diff, axis=-1, initial=0.0)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(diff ** p, axis=-1) ** (1.0 / p)


# aten::_cdist_forward(Tensor x1, Tensor x2, float p, int? compute_mode) -> Tensor
@lower(aten._cdist_forward)
def _cdist_forward(ctx, x1, x2, p, compute_mode=None):
    batch = ctx.out_shape[:-2]
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    return _pairwise_dist(x1, x2, p)


# aten::_pdist_forward(Tensor self, float p=2) -> Tensor
@lower(aten._pdist_forward)
def _pdist_forward(ctx, x, p=2.0):
    n = x.shape[0]
    i, j = np.triu_indices(n, k=1)                 # row-major pairs i < j, as torch orders them
    return _pairwise_dist(x, x, p)[i, j]


def _grid_reflect(coord, twice_low, twice_high):
    """torch's reflect_coordinates: fold coord into [twice_low/2, twice_high/2]."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo, span = twice_low / 2, (twice_high - twice_low) / 2
    c = jnp.abs(coord - lo)
    extra, flips = jnp.fmod(c, span), jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _grid_pad(coord, size, padding_mode, align_corners):
    """torch's compute_coordinates: 0 zeros (as is), 1 border (clip), 2 reflection (reflect, then clip)."""
    if padding_mode == 1:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == 2:
        coord = _grid_reflect(coord, 0, 2 * (size - 1)) if align_corners else _grid_reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _grid_cubic(t, a=-0.75):
    """The four cubic-convolution weights for fractional offset t (torch's get_cubic_upsample_coefficients)."""
    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


# aten::grid_sampler_2d(Tensor input, Tensor grid, int interpolation_mode, int padding_mode,
#                       bool align_corners) -> Tensor
@lower(aten.grid_sampler_2d)
def _grid_sampler_2d(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    # x: (N, C, H, W); grid: (N, Ho, Wo, 2) holding (x, y) in [-1, 1]; modes: 0 bilinear, 1 nearest, 2 bicubic
    h, w = x.shape[2], x.shape[3]

    def unnormalize(c, size):
        return (c + 1) / 2 * (size - 1) if align_corners else ((c + 1) * size - 1) / 2

    ix, iy = unnormalize(grid[..., 0], w), unnormalize(grid[..., 1], h)   # (N, Ho, Wo)

    def tap(yy, xx):
        """x at integer (yy, xx) per batch, zero outside the image: (N, C, Ho, Wo)."""
        inside = (xx >= 0) & (xx <= w - 1) & (yy >= 0) & (yy <= h - 1)
        yi = jnp.clip(yy, 0, h - 1).astype(jnp.int32)
        xi = jnp.clip(xx, 0, w - 1).astype(jnp.int32)
        vals = jax.vmap(lambda img, a, b: img[:, a, b])(x, yi, xi)            # (N, C, Ho, Wo)
        return vals * inside[:, None].astype(x.dtype)

    if interpolation_mode == 2:
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        wx, wy = _grid_cubic(ix - x0), _grid_cubic(iy - y0)
        rows = []
        for i in range(4):
            yy = _grid_pad(y0 - 1 + i, h, padding_mode, align_corners)
            row = sum(tap(yy, _grid_pad(x0 - 1 + j, w, padding_mode, align_corners)) * wx[j][:, None]
                      for j in range(4))
            rows.append(row)
        return sum(r * wy[i][:, None] for i, r in enumerate(rows))
    ix, iy = _grid_pad(ix, w, padding_mode, align_corners), _grid_pad(iy, h, padding_mode, align_corners)
    if interpolation_mode == 1:
        return tap(jnp.round(iy), jnp.round(ix))  # round half to even, as nearbyint
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    tx, ty = (ix - x0)[:, None], (iy - y0)[:, None]
    return (tap(y0, x0) * (1 - tx) * (1 - ty) + tap(y0, x0 + 1) * tx * (1 - ty)
            + tap(y0 + 1, x0) * (1 - tx) * ty + tap(y0 + 1, x0 + 1) * tx * ty)
