"""Custom torch ops of the exporter's own models (lowered in exporter/lowerings/).

    hloserve::mixed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor   # x [..., in] -> [..., out]
    hloserve::layer_linear(Tensor x, Tensor weights, Tensor layer, int holds) -> Tensor   # the composite's op
    hloserve::gather_blocks(Tensor cache, Tensor layer, int kv, Tensor blocks) -> Tensor
    hloserve::paged_attention(...) -> Tensor                                  # the composite's op (v1)
    hloserve::paged_attention_windowed(...) -> Tensor                         # v2: the window an operand

A Linear over 16-bit weights with wider activations: x is rounded to the weight's dtype, the
products (exact in float32: 8 + 8 or 11 + 11 significant bits) are summed in float32 and the
result is x's dtype. This is a TPU's default matmul precision, and on CPU what the bf16 dot
kernels compute (avx512_bf16: twice the f32 rate; the weights half the bytes). Expressed in
ATen it would be a bf16 matmul whose result is rounded to bf16 before widening again (mm of
bf16 returns bf16), so the model calls this op instead. Eager form: the torch reference.

The op is registered with torch's dispatcher when this module is first imported (idempotent
per process).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from hloserve.runtime.artifact.kernels import Holds


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
# [L, out, in] (holds: Holds.BF16 or F16; int16 storage holds their bits), the `hloserve.layer_linear`
# composite of runtime/artifact/kernels.py (lowered in exporter/lowerings/linalg.py): a kernel
# can read the layer where it lies in the stack instead of a sliced copy. x [..., in] -> [..., out].
_HOLDS = {Holds.BF16: torch.bfloat16, Holds.F16: torch.float16}


@torch.library.custom_op("hloserve::layer_linear", mutates_args=())
def layer_linear(x: torch.Tensor, weights: torch.Tensor, layer: torch.Tensor, holds: int) -> torch.Tensor:
    w = weights[layer.long()]
    w = w.view(_HOLDS[holds]) if w.dtype == torch.int16 else w
    return mixed_linear(x, w, None)


@layer_linear.register_fake
def _(x, weights, layer, holds):
    return x.new_empty((*x.shape[:-1], weights.shape[1]))


# hloserve::paged_attention: attention over each token's own paged context, the
# `hloserve.paged_attention` composite of runtime/artifact/kernels.py (lowered in
# exporter/lowerings/attention.py): version 1 with the window an int attribute, version 2
# (paged_attention_windowed) with it a 0-dim int32 operand (a scanned layer's own window).
# The eager forms below are the torch reference.
@torch.library.custom_op("hloserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                    window: int, holds: int, scale: float, softcap: float) -> torch.Tensor:
    return _paged_attention(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                            scale, softcap)


@paged_attention.register_fake
def _(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap):
    return torch.empty_like(q)


@torch.library.custom_op("hloserve::paged_attention_windowed", mutates_args=())
def paged_attention_windowed(q: torch.Tensor, kv_cache: torch.Tensor, layer: torch.Tensor, block_tables: torch.Tensor,
                             seq_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                             window: torch.Tensor, holds: int, scale: float, softcap: float) -> torch.Tensor:
    return _paged_attention(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                            scale, softcap)


@paged_attention_windowed.register_fake
def _(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap):
    return torch.empty_like(q)


def within_window(c: torch.Tensor, pos: torch.Tensor, window) -> torch.Tensor | None:
    """Which positions `c` a token at `pos` sees through a sliding window (c > pos - window), where
    `window` is an int or a 0-dim integer tensor (a scanned layer's; 0 or less: no window); None
    when an int window is 0 (nothing to mask)."""
    if isinstance(window, torch.Tensor):
        return (window <= 0) | (c > pos - window)
    return c > pos - window if window else None


def _paged_attention(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale,
                     softcap):
    T, KV, G, D = q.shape
    L, _, _, N, BS, _ = kv_cache.shape
    B = block_tables.shape[1]
    cache = kv_cache
    if holds:
        cache = cache.view(_HOLDS[holds])
    cache = cache.float()
    blocks = block_tables[seq_ids].long()                                  # [T, B]
    k = cache[layer.long(), 0][:, blocks].reshape(KV, T, B * BS, D)       # [KV, T, C, D]
    v = cache[layer.long(), 1][:, blocks].reshape(KV, T, B * BS, D)       # [KV, T, C, D]
    c = torch.arange(B * BS)
    pos = positions.long()[:, None]
    seen = (c[None, :] <= pos) & (c[None, :] < context_lens[seq_ids].long()[:, None])   # [T, C]
    windowed = within_window(c[None, :], pos, window)
    if windowed is not None:
        seen = seen & windowed
    scores = torch.einsum("tkgd,ktcd->ktgc", q.float(), k) * scale        # [KV, T, G, C]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = torch.where(seen[None, :, None, :], scores, -1e30)
    out = torch.einsum("ktgc,ktcd->tkgd", torch.softmax(scores, dim=-1), v)   # [T, KV, G, D]
    return out.to(q.dtype)


# hloserve::gather_blocks: the K (kv=0) or V (kv=1) blocks `blocks` [R, B] of layer `layer` (0-dim)
# from a paged cache [L, 2, KV, N, BS, D], as [KV, R*B*BS, D]: each sequence's padded context, kv
# heads first (the layout attention's batched dots read). Lowered to ONE gather whose kv-head dim
# is a slice of every index (exporter/lowerings/attention.py), so a cache split by heads over
# devices is read where it lies.
@torch.library.custom_op("hloserve::gather_blocks", mutates_args=())
def gather_blocks(cache: torch.Tensor, layer: torch.Tensor, kv: int, blocks: torch.Tensor) -> torch.Tensor:
    L, _, KV, N, BS, D = cache.shape
    picked = cache[layer.long(), kv][:, blocks.reshape(-1).long()]       # [KV, R*B, BS, D]
    return picked.reshape(KV, -1, D).clone()                              # [KV, R*B*BS, D]


@gather_blocks.register_fake
def _(cache, layer, kv, blocks):
    L, _, KV, N, BS, D = cache.shape
    return cache.new_empty((KV, blocks.numel() * BS, D))
