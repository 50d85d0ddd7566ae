"""The `hloserve.product_sum` composite, export side: a*b + c*d with each product rounded before the
sum, which the lowering of `aten.add` / `aten.sub` emits for a sum (difference) of two f32 products.

    jax side     product_sum_reference: the portable decomposition (a * b + c * d)
    emitted by   exporter/lowerings/elementwise.py's add and sub, for Tensor products on both sides

Why a composite for two multiplies and an add: XLA's CPU compiler contracts one of the two products
into a fused multiply-add (one rounding instead of two), and which one it picks follows the loop it
emits for the fusion, which follows the shapes. A rotary embedding, q*cos + rotate(q)*sin, then gave
the same token's rotated query different last bits in a decode step of one token (no transposes:
q*cos fused everywhere) and in a step of several (a mix), so the logits of a token depended on how
many rows its step had, and speculative decoding's verifying steps (several rows) could pick
another greedy token than a plain decode (one row) at a near tie (docs/api.md, "Speculative
decoding"). The CPU kernel (runtime/kernels/cpu/product_sum.cc) rounds both products, always; the
decomposition stays what accelerators run. The operands are broadcast to the result's shape and
flattened first, so the composite's contract is one flat elementwise loop.

The contract is runtime/artifact/kernels.py's PRODUCT_SUM.
"""
from __future__ import annotations

import jax.numpy as jnp
from hloserve.runtime.artifact.kernels import PRODUCT_SUM

from .. import _private


def product_sum_reference(a, b, c, d):
    """The `hloserve.product_sum` composite's decomposition: f32 [N] x 4 -> a*b + c*d."""
    return a * b + c * d


def product_sum(a, b, c, d, shape, order=None):
    """a*b + c*d (f32 operands broadcastable to `shape`) through the composite, shaped `shape`.
    `order`: a permutation of the dims to flatten them in (the one `a` lies in, where it is a transposed
    view: a rotary embedding's q is [batch, heads, tokens, head_dim] read from [batch, tokens, heads,
    head_dim]), so XLA cancels the transposes instead of copying every operand into the flat order."""
    order = tuple(range(len(shape))) if order is None else tuple(order)
    flat = [jnp.transpose(jnp.broadcast_to(x, shape), order).reshape(-1) for x in (a, b, c, d)]
    composite = _private.composite(product_sum_reference, PRODUCT_SUM.name, PRODUCT_SUM.version)
    out = composite(*flat).reshape(tuple(shape[i] for i in order))
    return jnp.transpose(out, tuple(order.index(i) for i in range(len(order))))
