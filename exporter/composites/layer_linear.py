"""The `hloserve.layer_linear` composite, export side: one layer's matrix product, read where the
layer lies in a stack of 16-bit weight matrices; and the plain mixed-precision Linear it builds on.

    torch side   hloserve::mixed_linear(x, weight, bias?)   hloserve::layer_linear(x, weights, layer, holds)
                 eager forms = the torch reference
    jax side     mixed_dot; layer_linear_reference: the portable decomposition
    lowerings    mixed_linear -> a dot; layer_linear -> a `stablehlo.composite` carrying its decomposition

A Linear over 16-bit weights with wider activations: x is rounded to the weight's dtype, the
products (exact in float32: 8 + 8 or 11 + 11 significant bits) are summed in float32 and the
result is x's dtype. This is a TPU's default matmul precision, and on CPU what the bf16 dot
kernels compute (avx512_bf16: twice the f32 rate; the weights half the bytes). Expressed in
ATen it would be a bf16 matmul whose result is rounded to bf16 before widening again (mm of
bf16 returns bf16), so the model calls this op instead.

The contract is runtime/artifact/kernels.py's LAYER_LINEAR; the kernels that replace it at load are
runtime/kernels/cpu/linear.cc on a CPU and runtime/kernels/pallas/linear_gpu.py on a GPU (a TPU runs
the decomposition: XLA's dot). The torch ops are registered with torch's dispatcher when this module
is first imported (idempotent).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from hloserve.runtime.artifact.kernels import LAYER_LINEAR, Holds
from jax import lax

from .. import _private
from ..bits import from_bits, held, to_bits
from ..registry import lower


# -- the torch side ----------------------------------------------------------------------------------
# The eager form widens the matrix a block of rows at a time (about 4 MiB of float32): the block is
# multiplied while it is in cache, instead of a widened copy of the whole matrix going through memory
# twice (2-3x faster on a 1B model's eager step, which the generic step's export runs to check its scan).
_WIDEN_ELEMENTS = 1 << 20


@torch.library.custom_op("hloserve::mixed_linear", mutates_args=())
def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x = x.to(weight.dtype).to(x.dtype)
    rows = max(1, _WIDEN_ELEMENTS // weight.shape[1])
    if weight.dtype == x.dtype or weight.shape[0] <= rows:
        return F.linear(x, weight.to(x.dtype), bias)
    out = torch.cat([F.linear(x, weight[r:r + rows].to(x.dtype)) for r in range(0, weight.shape[0], rows)], dim=-1)
    return out if bias is None else out + bias


@mixed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# hloserve::layer_linear: mixed_linear by layer `layer` (0-dim) of a stack of 16-bit matrices
# [L, out, in] (holds: Holds.BF16 or F16; int16 storage holds their bits): a kernel can read the
# layer where it lies in the stack instead of a sliced copy. x [..., in] -> [..., out].

@torch.library.custom_op("hloserve::layer_linear", mutates_args=())
def layer_linear(x: torch.Tensor, weights: torch.Tensor, layer: torch.Tensor, holds: int) -> torch.Tensor:
    w = weights[layer.long()]
    w = w.view(getattr(torch, Holds(holds).dtype_name)) if w.dtype == torch.int16 else w
    return mixed_linear(x, w, None)


@layer_linear.register_fake
def _(x, weights, layer, holds):
    return x.new_empty((*x.shape[:-1], weights.shape[1]))


# -- the jax side -------------------------------------------------------------------------------------
def mixed_dot(x, weight):
    """x [M, in] (any float) . weight [out, in] (16-bit float) -> f32 [M, out]: x rounded to the
    weight's dtype, products summed in f32.

    XLA:CPU runs 16-bit dots on its bf16 kernels only as a matrix product whose operands it does
    not have to move: so the weight's dim 1 is contracted in place (a transposed bf16 operand is
    widened to f32 first, 1.8x slower), and a single row is padded to two (a one-row dot becomes
    a vector product computed in f32 on a widened weight: 13x slower for a 49152 x 576 LM head).
    """
    rows, k = x.shape
    x2 = x.astype(weight.dtype)                                           # [M, in]
    pad = max(2 - rows, 0) if isinstance(rows, int) else jax.core.max_dim(rows, 2) - rows   # 0 for M >= 2
    if not isinstance(pad, int) or pad:
        x2 = jnp.concatenate([x2, jnp.zeros((pad, k), x2.dtype)])          # [max(M, 2), in]
    y = lax.dot_general(x2, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:rows]                                                       # [M, out]


# hloserve::mixed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor
@lower(torch.ops.hloserve.mixed_linear)
def _lower_mixed_linear(ctx, x, weight, bias=None):
    *lead, k = x.shape
    y = mixed_dot(x.reshape(math.prod(lead), k), weight)
    y = y.reshape(*lead, weight.shape[0]).astype(x.dtype)                 # [..., out]
    return y if bias is None else y + bias.astype(x.dtype)


def layer_linear_reference(x, weights, layer, *, holds):
    """The `hloserve.layer_linear` composite's decomposition: x f32[M, K], weights [L, N, K]
    (16-bit floats or their bits), layer s32[] -> f32[M, N]. The layer is sliced as bits: XLA:CPU
    would widen a 16-bit float stack to f32 before slicing it (exporter/bits.py)."""
    dtype = held(holds)
    if weights.shape[0] == 1:                                             # one matrix (an LM head)
        w = weights.reshape(weights.shape[1:])
    else:
        w = lax.dynamic_index_in_dim(to_bits(weights), layer, 0, keepdims=False)
    return mixed_dot(x, from_bits(w, dtype))


# hloserve::layer_linear(Tensor x, Tensor weights, Tensor layer, int holds) -> Tensor
@lower(torch.ops.hloserve.layer_linear)
def _lower_layer_linear(ctx, x, weights, layer, holds):
    *lead, k = x.shape
    composite = _private.composite(layer_linear_reference, LAYER_LINEAR.name, LAYER_LINEAR.version)
    y = composite(x.reshape(math.prod(lead), k).astype(jnp.float32), weights,
                  jnp.asarray(layer, jnp.int32).reshape(()), holds=int(holds))
    return y.reshape(*lead, weights.shape[1]).astype(x.dtype)             # [..., out]
