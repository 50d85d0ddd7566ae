"""Attention ops of the exporter's own models, lowered to the composites of runtime/artifact/kernels.py.

Each lowering emits a `stablehlo.composite` whose decomposition is the portable StableHLO
formulation: every platform can run it, and a runtime with a kernel for the composite (the CPU
runtime, runtime/kernels/) runs that instead.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from hloserve.runtime.artifact.kernels import PAGED_ATTENTION, PAGED_ATTENTION_V2
from jax import lax

from .. import _private
from .. import custom_ops as _custom_ops  # noqa: F401 - defines torch.ops.hloserve.paged_attention
from ..registry import lower
from ._util import HOLDS

# Finite "minus infinity" for masked scores: a token that sees nothing gets finite values.
_MASKED = -1e30


def gather_blocks(cache, layer, kv: int, blocks):
    """cache [L, 2, KV, N, BS, D] -> [KV, R*B*BS, D]: the blocks `blocks` [R, B] of layer `layer`,
    K (kv=0) or V (kv=1), in one gather. Each index picks (layer, kv, block) and the kv-head dim is
    a slice of every index, so XLA's SPMD partitioner reads a cache split by heads where it lies
    (folding the heads into the indexed rows would make it gather the whole cache first)."""
    L, _, KV, N, BS, D = cache.shape
    flat = blocks.reshape(-1).astype(jnp.int32)                           # [R*B]
    lead = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), flat.shape),
                      jnp.full(flat.shape, kv, jnp.int32), flat], axis=-1)   # [R*B, 3]: (layer, kv, block)
    dims = lax.GatherDimensionNumbers(offset_dims=(0, 2, 3), collapsed_slice_dims=(0, 1, 3),
                                      start_index_map=(0, 1, 3))
    out = lax.gather(cache, lead, dims, slice_sizes=(1, 1, KV, 1, BS, D),
                     mode=lax.GatherScatterMode.CLIP)                     # [KV, R*B, BS, D]
    return out.reshape(KV, flat.shape[0] * BS, D)                         # [KV, R*B*BS, D]


# hloserve::gather_blocks(Tensor cache, Tensor layer, int kv, Tensor blocks) -> Tensor
@lower(torch.ops.hloserve.gather_blocks)
def _gather_blocks(ctx, cache, layer, kv, blocks):
    return gather_blocks(cache, jnp.asarray(layer).reshape(()), int(kv), blocks)


def paged_attention_reference(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, *,
                              window, holds: int, scale: float, softcap: float):
    """The portable formulation: every token gathers its sequence's whole (padded) context.
    `window` is version 1's int attribute or version 2's s32[] operand (0 or less: no window).

    Whole blocks are gathered (gather_blocks), K and V by separate gathers, each landing in the
    layout its dot reads ([KV, T, C, D], batch dims first), so XLA adds no slice copy or
    transpose of the gathered context.
    """
    T, KV, G, D = q.shape
    L, _, _, N, BS, _ = kv_cache.shape
    B = block_tables.shape[1]
    C = B * BS
    blk = block_tables[seq_ids]                                           # [T, B]
    k = gather_blocks(kv_cache, layer, 0, blk).reshape(KV, T, C, D)       # [KV, T, C, D]
    v = gather_blocks(kv_cache, layer, 1, blk).reshape(KV, T, C, D)       # [KV, T, C, D]
    if holds:   # widened inside the gather: half the bytes read
        k = lax.bitcast_convert_type(k, HOLDS[holds]) if k.dtype != HOLDS[holds] else k
        v = lax.bitcast_convert_type(v, HOLDS[holds]) if v.dtype != HOLDS[holds] else v
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    qk = q.transpose(1, 0, 2, 3)                                          # [KV, T, G, D]
    # scores as K @ q^T: the big operand K is the dot's row-major left side
    scores = jnp.matmul(k, qk.swapaxes(-1, -2), precision=lax.Precision.HIGHEST) * scale   # [KV, T, C, G]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    c = jnp.arange(C, dtype=jnp.int32)
    pos = positions[:, None]
    seen = (c[None, :] <= pos) & (c[None, :] < context_lens[seq_ids][:, None])   # [T, C]
    if not isinstance(window, int):     # version 2: the layer's window is data
        seen = seen & ((window <= 0) | (c[None, :] > pos - window))
    elif window:
        seen = seen & (c[None, :] > pos - window)
    scores = jnp.where(seen[None, :, :, None], scores, _MASKED)
    probs = jax_softmax(scores, axis=-2)                                  # over C
    out = jnp.matmul(probs.swapaxes(-1, -2), v, precision=lax.Precision.HIGHEST)   # [KV, T, G, D]
    return out.transpose(1, 0, 2, 3)                                      # [T, KV, G, D]


def paged_attention_reference_v2(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, *,
                                 holds: int, scale: float, softcap: float):
    """Version 2's decomposition: version 1's, with the window an s32[] operand."""
    return paged_attention_reference(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens,
                                     window=window, holds=holds, scale=scale, softcap=softcap)


def jax_softmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    e = jnp.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def _operands(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens) -> tuple:
    """The operands both versions of the paged-attention composite share, in their contract's types."""
    i32 = jnp.int32
    return (q.astype(jnp.float32), kv_cache, jnp.asarray(layer, i32).reshape(()), block_tables.astype(i32),
            seq_ids.astype(i32), positions.astype(i32), context_lens.astype(i32))


# hloserve::paged_attention(Tensor q, Tensor kv_cache, Tensor layer, Tensor block_tables, Tensor seq_ids,
#                           Tensor positions, Tensor context_lens, int window, int holds, float scale,
#                           float softcap) -> Tensor: version 1, the window an attribute
@lower(torch.ops.hloserve.paged_attention)
def _paged_attention(ctx, q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                     scale, softcap):
    composite = _private.composite(paged_attention_reference, PAGED_ATTENTION.name, PAGED_ATTENTION.version)
    out = composite(*_operands(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens),
                    window=int(window or 0), holds=int(holds), scale=np.float32(scale),
                    softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)


# hloserve::paged_attention_windowed(..., Tensor window, int holds, float scale, float softcap) -> Tensor:
# version 2, the window an s32[] operand
@lower(torch.ops.hloserve.paged_attention_windowed)
def _paged_attention_windowed(ctx, q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                              scale, softcap):
    composite = _private.composite(paged_attention_reference_v2, PAGED_ATTENTION_V2.name, PAGED_ATTENTION_V2.version)
    out = composite(*_operands(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens),
                    jnp.asarray(window, jnp.int32).reshape(()), holds=int(holds), scale=np.float32(scale),
                    softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)
