"""hloserve::quantized_embedding (quantization/modules.py): the rows an index picks from a quantized
table, dequantized as they are gathered (the layout's jax twin, `dequantize`, lives with the
`hloserve.quant_linear` composite in exporter/composites/quant_linear.py)."""
from __future__ import annotations

import jax.numpy as jnp
import torch
from hloserve.quantization import primitives

from ..composites.quant_linear import dequantize
from ..registry import lower


# hloserve::quantized_embedding(Tensor qweight, Tensor scale, Tensor? min, Tensor indices,
#                               int bits, int group, ScalarType dtype, int rows=0) -> Tensor
@lower(torch.ops.hloserve.quantized_embedding.default)
def _lower_quantized_embedding(ctx, qweight, scale, min_, indices, bits, group, dtype, rows=0):
    if rows:   # interleaved by 16 rows (a tied LM head's layout): gathered where they lie
        q, s, m = primitives.gather_rows(qweight, scale, min_, indices, bits, xp=jnp)
        return dequantize(q, s, m, 8, group).astype(ctx.out_dtype)      # [*idx, in]
    rows = jnp.take(qweight, indices, axis=0)                            # [*idx, in | in/2]
    s = jnp.take(scale, indices, axis=0)                                 # [*idx] | [*idx, G]
    m = None if min_ is None else jnp.take(min_, indices, axis=0)
    return dequantize(rows, s, m, bits, group).astype(ctx.out_dtype)     # [*idx, in]
