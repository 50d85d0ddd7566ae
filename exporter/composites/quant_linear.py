"""The `hloserve.quant_linear` composite, export side: one layer's matrix product with weight-only
quantized matrices (int8 / int4, group-wise; GGUF Q8_0 / Q4_0 / Q4_1 blocks as they are; version 3:
GGUF Q4_K / Q5_K / Q6_K super-blocks kept, hloserve::kquant_linear; version 4: GGUF Q5_0's 5-bit
values kept; version 6: version 2's layout with prompt chunks of bf16_rows rows and more multiplied
in bf16), dequantized where they are read.

    torch side   hloserve::quantized_linear and hloserve::quantized_embedding live in
                 quantization/modules.py (quantization may not import the exporter); their eager
                 forms are the torch reference
    jax side     dequantize / unpack_int4 (the layout's jax twin of quantization/primitives.py);
                 quant_linear_reference (version 1), quant_linear_v2_reference (rows interleaved by 16,
                 put back in order by primitives.rows_in_order traced with jax.numpy: one definition
                 for numpy, jax and the torch op)
    lowering     hloserve::quantized_linear -> a `stablehlo.composite` carrying its decomposition

The contract is runtime/artifact/kernels.py's QUANT_LINEAR / QUANT_LINEAR_V2 (/ V3 / V4 / V5 / V6); the kernel that replaces
it at load on a CPU is runtime/kernels/cpu/quant_linear.cc. Storage layout: quantization/schemes.py.

Dequantization happens in the graph, next to its consumer, in a form XLA:CPU keeps cheap
(benchmarks/quant.py measures the alternatives; docs/quantization.md has the numbers):

  * int8:  w = q.astype(f32) * scale (+ min) per group, then dot(x, w).
  * int4:  never interleave the nibbles back into element order. The low nibbles of a row are
    its even elements, the high nibbles its odd ones, so
        y = dot(x[..., 0::2], deq(low)) + dot(x[..., 1::2], deq(high))
    and each half dequantizes with plain shifts and a per-group multiply (a group of g
    elements is g/2 consecutive nibbles of each half). Unpacking to [.., in] first costs a
    concatenate XLA does not fuse (measured 4-5x slower per layer).
  * Large weights (out * in > BLOCK_ABOVE, e.g. a 49152 x 576 LM head) are processed in row
    blocks inside a loop (lax.map): XLA:CPU does not fuse a convert/multiply into a dot, so the
    dequantized weight is materialized; one block at a time it stays in cache instead of
    writing and re-reading a full float copy on every call.

Inside the Llama decoder's layer scan (stablehlo.while over stacked weights) each iteration
dequantizes ONE layer: the int8/int4 layer is read from memory once (1/4 or ~1/7 of the f32
bytes) and its float copy is used while still in cache. On GPU, XLA fuses the same
convert/multiply into the GEMM's operand.

Exactness: the multiply-add of asymmetric groups is float32 q * scale + min with scale and min
widened first, the gguf package's Q4_1 arithmetic. XLA:CPU may contract it into an FMA; with
f16 scales (every GGUF import) q * scale needs at most 4 + 11 bits, is exact in float32, and
the FMA rounds identically, so imported GGUF weights dequantize bit-exactly (tests check it).
With f32 scales an asymmetric value may differ from NumPy's by one ulp.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import torch
from hloserve.quantization import modules as _qmodules  # noqa: F401 (defines torch.ops.hloserve.quantized_linear)
from hloserve.quantization import primitives
from hloserve.runtime.artifact.kernels import (QUANT_BF16_ROWS, QUANT_LINEAR, QUANT_LINEAR_V2, QUANT_LINEAR_V3,
                                               QUANT_LINEAR_V4, QUANT_LINEAR_V5, QUANT_LINEAR_V6, Block)
from hloserve.runtime.artifact.kernels import quantize_blocks as _contract_quantize_blocks
from hloserve.quantization.schemes import WeightScheme
from jax import lax

from .. import _private
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


BLOCK_ABOVE = 1 << 22   # weights of more elements than this are dequantized in row blocks ...
BLOCK_ELEMS = 1 << 20   # ... of at most this many elements (4 MiB in float32: stays in L2/L3)


def _dot(x, w, acc):
    """x [..., in] . w [out, in] -> [..., out]."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=acc)


def _int4_halves(packed, scale, min_, group: int):
    """Packed int4 [out, in/2] -> (even elements, odd elements), each float32 [out, in/2], dequantized."""
    b = lax.bitcast_convert_type(packed, jnp.int8)
    if min_ is None:   # signed nibbles: arithmetic shifts sign-extend
        lo = lax.shift_right_arithmetic(lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
        hi = lax.shift_right_arithmetic(b, jnp.int8(4))
    else:
        lo = b & jnp.int8(0xF)
        hi = lax.shift_right_logical(b, jnp.int8(4))
    out, half = packed.shape
    G = half // (group // 2)

    def deq(v):
        w = v.astype(jnp.float32).reshape(out, G, group // 2) * scale.astype(jnp.float32).reshape(out, G, 1)
        if min_ is not None:
            w = w + min_.astype(jnp.float32).reshape(out, G, 1)
        return w.reshape(out, half)                                      # [out, in/2]
    return deq(lo), deq(hi)


def _linear_block(x, qweight, scale, min_, bits: int, group: int):
    """x [..., in] times one [rows, in] block of a stored weight -> [..., rows] (accumulated in f32 for bf16/f16)."""
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    if bits == 4:
        even, odd = _int4_halves(qweight, scale, min_, group)
        return _dot(x[..., 0::2], even.astype(x.dtype), acc) + _dot(x[..., 1::2], odd.astype(x.dtype), acc)
    return _dot(x, dequantize(qweight, scale, min_, bits, group).astype(x.dtype), acc)


def _block_rows(out: int, n_in: int) -> int:
    """Rows per block: `out` up to BLOCK_ABOVE elements, else the largest divisor of `out` with
    rows * n_in <= BLOCK_ELEMS."""
    if out * n_in <= BLOCK_ABOVE:
        return out
    rows = max(1, BLOCK_ELEMS // n_in)
    while out % rows:
        rows -= 1
    return rows


def quantize_blocks(x):
    """x f32 [M, K] as the contract's int8 activations (runtime.artifact.kernels.quantize_blocks)."""
    return _contract_quantize_blocks(x, jnp, barrier=lax.optimization_barrier)


def _picked(qweight, scale, min_, layer):
    """Layer `layer` of each stored stack (a stack of one is indexed statically); min_ None when empty."""
    pick = (lambda a: a[0]) if qweight.shape[0] == 1 else (lambda a: lax.dynamic_index_in_dim(a, layer, 0, False))
    return pick(qweight), pick(scale), pick(min_) if min_.size else None


def layer_product(x, qw, s, mn, bits: int, group: int, *, bf16: bool = False):
    """x f32[M, K] quantized as the contract says (`bf16`: x and the dequantized matrix rounded to
    bfloat16, version 6's chunks), times one layer's stored matrix [N, ...] (row by row): whole, or
    in row blocks inside a loop for large matrices (see the module docstring)."""
    xr = x.astype(jnp.bfloat16) if bf16 else quantize_blocks(x)         # the contract's activations
    out, n_in = qw.shape[0], x.shape[-1]
    rows = _block_rows(out, n_in)
    if rows == out:
        return _linear_block(xr, qw, s, mn, bits, group)                 # [M, N]
    n = out // rows

    def blocks(a):
        return a.reshape(n, rows, *a.shape[1:]) if a is not None else None   # [n, rows, ...]

    ys = lax.map(lambda b: _linear_block(xr, *b, bits, group), (blocks(qw), blocks(s), blocks(mn)))
    return jnp.moveaxis(ys, 0, -2).reshape(x.shape[0], out)              # [n, M, rows] -> [M, N]


def quant_linear_reference(x, qweight, scale, min_, layer, *, bits: int, group: int):
    """The `hloserve.quant_linear` composite's decomposition (its contract: runtime/artifact/kernels.py):
    x f32[M, K], qweight [L, N, K | K/2], scale [L, N, K/group], min_ like scale or f32[0], layer
    s32[] -> f32[M, N]. Slices the layer, then dequantizes next to the dot as described above."""
    return layer_product(x, *_picked(qweight, scale, min_, layer), bits, group)


def quant_linear_v2_reference(x, qweight, scale, min_, layer, *, bits: int, group: int):
    """The `hloserve.quant_linear` version 2 (and 4: bits 5) composite's decomposition: the layer's matrix
    put back in row order, then version 1's arithmetic (x quantized per block as Q8_0, W = q * scale + min)."""
    q, s, mn = primitives.rows_in_order(*_picked(qweight, scale, min_, layer), bits, xp=jnp)
    return layer_product(x, q, s, mn, 8, group)                         # int values: bits 8's dequantize


def quant_linear_v6_reference(x, qweight, scale, min_, layer, *, bits: int, group: int, bf16_rows: int):
    """The `hloserve.quant_linear` version 6 composite's decomposition: version 2's below `bf16_rows`
    rows of x; from there x and the dequantized matrix rounded to bfloat16 (_linear_block's dot of
    16-bit operands with f32 sums). The row count is symbolic in an artifact: both branches are
    lowered under a conditional on it, which XLA folds once the step's shape is known."""
    q, s, mn = primitives.rows_in_order(*_picked(qweight, scale, min_, layer), bits, xp=jnp)
    chunk = functools.partial(layer_product, x, q, s, mn, 8, group, bf16=True)
    rows = functools.partial(layer_product, x, q, s, mn, 8, group)
    m = x.shape[0]
    if isinstance(m, int):
        return chunk() if m >= bf16_rows else rows()
    return lax.cond(jnp.asarray(m, jnp.int32) >= bf16_rows, chunk, rows)


def quant_linear_v3_reference(x, qweight, blocks, layer, *, kind: int, rows: int = 0):
    """The `hloserve.quant_linear` version 3 (and, with rows=16, version 5) composite's decomposition:
    the layer's K-quant headers decoded into per-sub-block scales and mins (primitives.block_scales
    traced with jax.numpy, exact in f32), then version 1's arithmetic on the quants (int4 unsigned for
    Q4_K, int8 for Q5_K / Q6_K; version 5's put back in row order by primitives.block_quants first)."""
    scheme = WeightScheme.of_block(Block(kind).name)
    pick = (lambda a: a[0]) if qweight.shape[0] == 1 else (lambda a: lax.dynamic_index_in_dim(a, layer, 0, False))
    scale, mn = primitives.block_scales(pick(blocks), scheme.block, xp=jnp)             # [N, K/g]
    if rows:
        q = primitives.block_quants(pick(qweight), dataclasses.replace(scheme, rows=rows), xp=jnp)   # [N, K] values
        return layer_product(x, q, scale, mn, 8, scheme.group)
    return layer_product(x, pick(qweight), scale, mn, scheme.bits, scheme.group)


def quant_linear_v5_reference(x, qweight, blocks, layer, *, kind: int):
    """The version 5 composite's decomposition: version 3's with the quants interleaved by 16 rows."""
    return quant_linear_v3_reference(x, qweight, blocks, layer, kind=kind, rows=16)


# hloserve::kquant_linear(Tensor x, Tensor qweight, Tensor blocks, Tensor? bias, Tensor layer, int kind,
#                         int rows=0) -> Tensor
@lower(torch.ops.hloserve.kquant_linear.default)
def _lower_kquant_linear(ctx, x, qweight, blocks, bias, layer, kind, rows=0):
    *lead, k = x.shape
    reference, contract = (quant_linear_v5_reference, QUANT_LINEAR_V5) if rows else (quant_linear_v3_reference,
                                                                                     QUANT_LINEAR_V3)
    composite = _private.composite(reference, contract.name, contract.version)
    y = composite(x.reshape(math.prod(lead), k).astype(jnp.float32), qweight, blocks,
                  jnp.asarray(layer, jnp.int32).reshape(()), kind=int(kind))
    y = y.reshape(*lead, blocks.shape[1])                                # [..., N]
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(ctx.out_dtype)


# hloserve::quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? min, Tensor? bias,
#                            Tensor layer, int bits, int group, int rows=0) -> Tensor
@lower(torch.ops.hloserve.quantized_linear.default)
def _lower_quantized_linear(ctx, x, qweight, scale, min_, bias, layer, bits, group, rows=0):
    if bits == 4 and not group:
        raise ValueError("int4 weights need a group size (schemes.WeightScheme refuses per-channel int4)")
    *lead, k = x.shape
    L = qweight.shape[0]
    g = group or k
    extra = {}
    if rows:   # interleaved by 16 rows: version 2 (version 4: 5-bit values, the same decomposition)
        out = qweight.shape[1] * rows
        shape = (L, out // rows, k // g, rows)                           # [L, N/16, G, 16]
        reference, contract = quant_linear_v2_reference, QUANT_LINEAR_V4 if bits == 5 else QUANT_LINEAR_V2
        if bits != 5 and not ctx.interpreter.batch_invariant:   # version 6: prompt chunks in bf16
            reference, contract, extra = quant_linear_v6_reference, QUANT_LINEAR_V6, {"bf16_rows": QUANT_BF16_ROWS}
    else:
        out = qweight.shape[1]
        shape = (L, out, k // g)                                         # [L, N, G] (per channel: G = 1)
        reference, contract = quant_linear_reference, QUANT_LINEAR
    scale = scale.reshape(shape)
    min_ = jnp.zeros((0,), jnp.float32) if min_ is None else min_.reshape(shape)
    composite = _private.composite(reference, contract.name, contract.version)
    y = composite(x.reshape(math.prod(lead), k).astype(jnp.float32), qweight, scale, min_,
                  jnp.asarray(layer, jnp.int32).reshape(()), bits=int(bits), group=int(g), **extra)
    y = y.reshape(*lead, out)                                            # [..., N]
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(ctx.out_dtype)
