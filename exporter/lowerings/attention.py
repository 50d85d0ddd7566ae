"""Attention ops of the exporter's own models, lowered to the composites of runtime/artifact/kernels.py.

Each lowering emits a `stablehlo.composite` whose decomposition is the portable StableHLO
formulation: every platform can run it, and a runtime with a kernel for the composite (the CPU
runtime, runtime/kernels/) runs that instead.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from hloserve.runtime.artifact.kernels import PAGED_ATTENTION
from jax import lax

from .. import _private
from .. import custom_ops as _custom_ops  # noqa: F401 - defines torch.ops.hloserve.paged_attention
from ..registry import lower

# Finite "minus infinity" for masked scores: a token that sees nothing gets finite values.
_MASKED = -1e30
_HOLDS = {1: jnp.bfloat16, 2: jnp.float16}


def paged_attention_reference(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, *,
                              window: int, holds: int, scale: float, softcap: float):
    """The portable formulation: every token gathers its sequence's whole (padded) context.

    Whole blocks are gathered as rows of a 2-D view, one row per (layer, K|V, kv head, block),
    K and V by separate gathers, each landing in the layout its dot reads ([KV, T, C, D], batch
    dims first), so XLA adds no slice copy or transpose of the gathered context.
    """
    T, KV, G, D = q.shape
    L, _, _, N, BS, _ = kv_cache.shape
    B = block_tables.shape[1]
    C = B * BS
    rows = kv_cache.reshape(L * 2 * KV * N, BS * D)                       # [L*2*KV*N, BS*D]
    blk = block_tables[seq_ids][None]                                     # [1, T, B]
    heads = jnp.arange(KV, dtype=jnp.int32)
    k_idx = ((layer * 2 * KV + heads) * N)[:, None, None] + blk           # [KV, T, B]
    k = rows[k_idx.reshape(-1)].reshape(KV, T, C, D)                      # [KV, T, C, D]
    v = rows[(k_idx + KV * N).reshape(-1)].reshape(KV, T, C, D)           # [KV, T, C, D]
    if holds:   # widened inside the gather: half the bytes read
        k = lax.bitcast_convert_type(k, _HOLDS[holds]) if k.dtype != _HOLDS[holds] else k
        v = lax.bitcast_convert_type(v, _HOLDS[holds]) if v.dtype != _HOLDS[holds] else v
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    qk = q.transpose(1, 0, 2, 3)                                          # [KV, T, G, D]
    # scores as K @ q^T: the big operand K is the dot's row-major left side
    scores = jnp.matmul(k, qk.swapaxes(-1, -2), precision=lax.Precision.HIGHEST) * scale   # [KV, T, C, G]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    c = jnp.arange(C, dtype=jnp.int32)
    pos = positions[:, None]
    seen = (c[None, :] <= pos) & (c[None, :] < context_lens[seq_ids][:, None])   # [T, C]
    if window:
        seen = seen & (c[None, :] > pos - window)
    scores = jnp.where(seen[None, :, :, None], scores, _MASKED)
    probs = jax_softmax(scores, axis=-2)                                  # over C
    out = jnp.matmul(probs.swapaxes(-1, -2), v, precision=lax.Precision.HIGHEST)   # [KV, T, G, D]
    return out.transpose(1, 0, 2, 3)                                      # [T, KV, G, D]


def jax_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    e = jnp.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


# hloserve::paged_attention(Tensor q, Tensor kv_cache, Tensor layer, Tensor block_tables, Tensor seq_ids,
#                           Tensor positions, Tensor context_lens, int window, int holds) -> Tensor
@lower(torch.ops.hloserve.paged_attention)
def _paged_attention(ctx, q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                     scale, softcap):
    i32 = jnp.int32
    composite = _private.composite(paged_attention_reference, PAGED_ATTENTION.name, PAGED_ATTENTION.version)
    out = composite(q.astype(jnp.float32), kv_cache, jnp.asarray(layer, i32).reshape(()), block_tables.astype(i32),
                    seq_ids.astype(i32), positions.astype(i32), context_lens.astype(i32),
                    window=int(window or 0), holds=int(holds), scale=np.float32(scale),
                    softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)
