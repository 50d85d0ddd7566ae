"""Weight-only quantized ops (hloserve::quantized_linear / quantized_embedding, see
quantization/modules.py; storage layout in quantization/schemes.py).

Dequantization happens in the graph, next to its consumer:

    int4: uint8 [.., out, in/2] --shifts--> int8 [.., out, in]   (signed: arithmetic shifts)
    q.astype(f32) * scale (+ min), per group           -> f32 [.., out, in]
    dot(x, w) contracting `in`                         -> [.., out]

Why this form (benchmarks/quant.py measures the alternatives): XLA:CPU does not fuse a
convert/multiply into a dot, so outside a loop this materializes the float weight on every
call. Inside the Llama decoder's layer scan (stablehlo.while over stacked weights) it
materializes ONE layer's weight per iteration: the int8/int4 layer is read from memory once
(1/4 or ~1/7 of the f32 bytes) and its float copy is used while still in cache, which is what
makes decode faster than f32. On GPU, XLA fuses the same convert/multiply into the GEMM's
operand. The multiply-add of asymmetric groups is float32 q * scale + min with scale and min
widened first: the gguf package's Q4_1 arithmetic. XLA:CPU may contract it into an FMA; with
f16 scales (every GGUF import) q * scale needs at most 4 + 11 bits, is exact in float32, and
the FMA rounds identically, so imported GGUF weights dequantize bit-exactly (tests check it).
With f32 scales an asymmetric value may differ from NumPy's by one ulp.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hloserve.quantization import modules as _qmodules  # noqa: F401 - defines the torch.ops.hloserve ops
import torch

from ..registry import lower

_HIGHEST = lax.Precision.HIGHEST


def unpack_int4(packed, signed: bool):
    """uint8 [..., m] -> int8 [..., 2m]; element 2k from the low nibble, 2k+1 from the high one."""
    b = lax.bitcast_convert_type(packed, jnp.int8)
    if signed:   # arithmetic shifts sign-extend each nibble
        lo = lax.shift_right_arithmetic(lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
        hi = lax.shift_right_arithmetic(b, jnp.int8(4))
    else:
        lo = b & jnp.int8(0xF)
        hi = lax.shift_right_logical(b, jnp.int8(4))
    both = jnp.stack([lo, hi], axis=-1)                                  # [..., m, 2]
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])        # [..., 2m]


def dequantize(qweight, scale, min_, bits: int, group: int):
    """float32 [..., out, in] of a stored weight (the in-graph twin of primitives.dequantize)."""
    q = unpack_int4(qweight, signed=min_ is None) if bits == 4 else qweight
    n_in = q.shape[-1]
    g = group or n_in
    qg = q.astype(jnp.float32).reshape(*q.shape[:-1], n_in // g, g)      # [..., out, G, g]
    w = qg * scale.astype(jnp.float32).reshape(*q.shape[:-1], n_in // g, 1)
    if min_ is not None:
        w = w + min_.astype(jnp.float32).reshape(*q.shape[:-1], n_in // g, 1)
    return w.reshape(q.shape)                                            # [..., out, in]


# hloserve::quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? min, Tensor? bias,
#                            int bits, int group) -> Tensor
@lower(torch.ops.hloserve.quantized_linear.default)
def _quantized_linear(ctx, x, qweight, scale, min_, bias, bits, group):
    w = dequantize(qweight, scale, min_, bits, group).astype(x.dtype)   # [out, in]
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=_HIGHEST,
                        preferred_element_type=acc)                      # [..., out]
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(ctx.out_dtype)


# hloserve::quantized_embedding(Tensor qweight, Tensor scale, Tensor? min, Tensor indices,
#                               int bits, int group, ScalarType dtype) -> Tensor
@lower(torch.ops.hloserve.quantized_embedding.default)
def _quantized_embedding(ctx, qweight, scale, min_, indices, bits, group, dtype):
    rows = jnp.take(qweight, indices, axis=0)                            # [*idx, in | in/2]
    s = jnp.take(scale, indices, axis=0)                                 # [*idx] | [*idx, G]
    m = None if min_ is None else jnp.take(min_, indices, axis=0)
    return dequantize(rows, s, m, bits, group).astype(ctx.out_dtype)     # [*idx, in]
