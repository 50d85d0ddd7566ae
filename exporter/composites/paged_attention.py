"""The `hloserve.paged_attention` composite, export side: attention of each token over its own
sequence's paged context (the LLM step's KV cache `[L, 2, KV, N, BS, D]`).

    torch side   hloserve::paged_attention (v1: window an attribute), hloserve::paged_attention_windowed
                 (v2: window an operand), hloserve::gather_blocks; eager forms = the torch reference
    jax side     paged_attention_reference: the portable decomposition (every platform runs it)
    lowerings    each op -> a `stablehlo.composite` carrying that decomposition

The contract is runtime/artifact/kernels.py's PAGED_ATTENTION / PAGED_ATTENTION_V2; the kernels that
replace it at load are runtime/kernels/cpu/paged_attention.cc and runtime/kernels/pallas/{gpu,tpu}.py.
The torch ops are registered with torch's dispatcher when this module is first imported
(idempotent per process).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from hloserve.runtime.artifact.kernels import FP8_E4M3_MAX, PAGED_ATTENTION, PAGED_ATTENTION_V2, Holds
from jax import lax

from .. import _private
from ..bits import held
from ..registry import lower

# -- the torch side: ops the step's model calls; their eager forms are the torch reference ----------
# hloserve::paged_attention: version 1, the window an int attribute; hloserve::paged_attention_windowed:
# version 2, the window a 0-dim int32 operand (a scanned layer's own window).
@torch.library.custom_op("hloserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                    window: int, holds: int, scale: float, softcap: float) -> torch.Tensor:
    return _eager(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap)


@paged_attention.register_fake
def _(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap):
    return torch.empty_like(q)


@torch.library.custom_op("hloserve::paged_attention_windowed", mutates_args=())
def paged_attention_windowed(q: torch.Tensor, kv_cache: torch.Tensor, layer: torch.Tensor, block_tables: torch.Tensor,
                             seq_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                             window: torch.Tensor, holds: int, scale: float, softcap: float) -> torch.Tensor:
    return _eager(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap)


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


def _scale_bytes(scale: torch.Tensor) -> list[torch.Tensor]:
    """bf16 scales [..., 1] -> their bits as two signed bytes (int32), low then high."""
    bits = scale.view(torch.int16).to(torch.int32)
    return [((bits & 0xFF) ^ 0x80) - 0x80, torch.bitwise_right_shift(bits, 8)]


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., D] -> int8 [..., D + 2] (runtime/artifact/kernels.py INT8_ROW): per row (one
    token, one KV head) scale = bf16(max|x| / 127), q = clip(round(x / scale), -127, 127), and the
    scale's bits as two bytes, low then high (arithmetic only: the step's export traces it)."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127).to(torch.bfloat16)
    s = scale.float()
    q = torch.round(x.float() / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127).to(torch.int32)
    return torch.cat([q, *_scale_bytes(scale)], dim=-1).to(torch.int8)


def quantize_int8_zp_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., D] -> int8 [..., D + 3] (runtime/artifact/kernels.py INT8_ZP_ROW): per row the
    range [min(x, 0), max(x, 0)] over the 256 codes, scale = bf16(range / 255), an integer zero point z
    (the code of 0.0, minus 128) and q = clip(round(x / scale) + z, -128, 127); then the scale's two
    bytes and z. A row's values all of one sign use every code (a symmetric row uses half of them for
    the sign it lacks): SmolLM2's log-probabilities against a bf16 cache through the served step,
    0.0248 -> 0.0234 nats (0.0169 was the offline measure, transformers eager; docs/quantization.md)."""
    x = x.float()
    lo, hi = x.amin(dim=-1, keepdim=True).clamp(max=0), x.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).to(torch.bfloat16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    z = torch.round(-lo / s).clamp(0, 255) - 128
    q = (torch.round(x / s) + z).clamp(-128, 127)
    return torch.cat([q.to(torch.int32), *_scale_bytes(scale), z.to(torch.int32)], dim=-1).to(torch.int8)


def e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """f32 values in [-448, 448] -> the bits of their float8 e4m3fn rounding (to nearest even) as int32
    in [-128, 127] (the byte as int8). Integer arithmetic on the f32 bits, which the step's export
    traces (no float8 dtype in its graph): a normal value keeps its top 3 mantissa bits, rounded, and
    its exponent rebiased (127 -> 7); below 2^-6 (e4m3's subnormals) the code is round(|y| * 2^9)."""
    a = y.abs()
    bits = a.view(torch.int32)
    normal = torch.bitwise_right_shift(bits + 0x7FFFF + (torch.bitwise_right_shift(bits, 20) & 1), 20) - (120 << 3)
    mag = torch.where(a < 2.0 ** -6, torch.round(a * 512).to(torch.int32), normal)
    return torch.where(y < 0, mag - 128, mag)                            # the sign bit: 0x80 | mag as int8


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn bits (any integer dtype, the byte's low 8 bits) -> their f32 values; integer
    arithmetic as e4m3_codes (a normal magnitude's bits moved into an f32's, its exponent rebiased;
    a subnormal's mantissa times 2^-9)."""
    b = codes.to(torch.int32) & 0xFF
    mag = b & 0x7F
    normal = (mag * 1048576 + (120 << 23)).view(torch.float32)           # (mag << 20) + (120 << 23)
    value = torch.where(mag < 8, mag.float() * 2.0 ** -9, normal)
    return torch.where(b >= 128, -value, value)


def quantize_fp8_e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., D] -> int8 [..., D + 2] (runtime/artifact/kernels.py FP8_E4M3_ROW): per row (one
    token, one KV head) scale = bf16(max|x| / 448), f = e4m3(clip(x / scale, -448, 448)) stored as its
    bits, then the scale's two bytes, low then high (arithmetic only: the step's export traces it)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).to(torch.bfloat16)
    s = scale.float()
    y = (x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return torch.cat([e4m3_codes(y), *_scale_bytes(scale)], dim=-1).to(torch.int8)


def _row_scale(rows: torch.Tensor, D: int) -> torch.Tensor:
    """The bf16 scale stored in bytes D, D + 1 of each row, as f32 [..., 1]."""
    low, high = rows[..., D:D + 1].to(torch.int32) & 0xFF, rows[..., D + 1:D + 2].to(torch.int32)
    return (high * 16777216 + low * 65536).view(torch.float32)           # the bf16 bits as the top of an f32


def int8_rows_values(rows: torch.Tensor, holds: int = Holds.INT8_ROWS) -> torch.Tensor:
    """Quantized rows [..., D + extra] -> their f32 values [..., D]: q * scale (INT8_ROWS),
    (q - zero) * scale (INT8_ZP_ROWS) or e4m3(f) * scale (FP8_E4M3_ROWS); the inverse of
    quantize_int8_rows / _zp_rows / quantize_fp8_e4m3_rows up to rounding."""
    D = rows.shape[-1] - Holds(holds).row_extra
    scale = _row_scale(rows, D)
    if holds == Holds.FP8_E4M3_ROWS:
        return e4m3_values(rows[..., :D]) * scale
    q = rows[..., :D].float()
    if holds == Holds.INT8_ZP_ROWS:
        q = q - rows[..., D + 2:D + 3].float()
    return q * scale


QUANT_ROWS = (Holds.INT8_ROWS, Holds.INT8_ZP_ROWS, Holds.FP8_E4M3_ROWS)   # quantized rows: values and a scale


def cache_values(cache: torch.Tensor, holds: int) -> torch.Tensor:
    """A cache (or rows gathered from one) as f32 values, whatever `holds` says it stores."""
    if holds in QUANT_ROWS:
        return int8_rows_values(cache, holds)
    if holds and cache.dtype == torch.int16:
        cache = cache.view(getattr(torch, Holds(holds).dtype_name))
    return cache.float()


def _eager(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds, scale, softcap):
    T, KV, G, D = q.shape
    L, _, _, N, BS, _ = kv_cache.shape
    B = block_tables.shape[1]
    cache = cache_values(kv_cache, holds)
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
# is a slice of every index (below), so a cache split by heads over
# devices is read where it lies.
@torch.library.custom_op("hloserve::gather_blocks", mutates_args=())
def gather_blocks_op(cache: torch.Tensor, layer: torch.Tensor, kv: int, blocks: torch.Tensor) -> torch.Tensor:
    L, _, KV, N, BS, D = cache.shape
    picked = cache[layer.long(), kv][:, blocks.reshape(-1).long()]       # [KV, R*B, BS, D]
    return picked.reshape(KV, -1, D).clone()                              # [KV, R*B*BS, D]


@gather_blocks_op.register_fake
def _(cache, layer, kv, blocks):
    L, _, KV, N, BS, D = cache.shape
    return cache.new_empty((KV, blocks.numel() * BS, D))


def int8_values(rows, holds: int):
    """jax: quantized rows [..., D + extra] -> f32 values [..., D] (int8_rows_values' decomposition; the
    Pallas kernels' widen has its own copy). An fp8 row's bytes are bitcast to float8_e4m3fn and
    converted: the plain StableHLO for it, which XLA fuses into the gather like the int8 widening."""
    D = rows.shape[-1] - Holds(holds).row_extra
    bits = rows[..., D + 1].astype(jnp.int32) * 16777216 + (rows[..., D].astype(jnp.int32) & 0xFF) * 65536
    if holds == Holds.FP8_E4M3_ROWS:
        q = lax.bitcast_convert_type(rows[..., :D], jnp.float8_e4m3fn).astype(jnp.float32)
        return q * lax.bitcast_convert_type(bits, jnp.float32)[..., None]
    q = rows[..., :D].astype(jnp.float32)
    if holds == Holds.INT8_ZP_ROWS:
        q = q - rows[..., D + 2:D + 3].astype(jnp.float32)
    return q * lax.bitcast_convert_type(bits, jnp.float32)[..., None]


# -- the jax side: the decomposition and the lowerings --------------------------------------------
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
def _lower_gather_blocks(ctx, cache, layer, kv, blocks):
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
    L, _, _, N, BS, R = kv_cache.shape                                    # R: D, or D + 2 / D + 3 (int8, fp8 rows)
    B = block_tables.shape[1]
    C = B * BS
    blk = block_tables[seq_ids]                                           # [T, B]
    k = gather_blocks(kv_cache, layer, 0, blk).reshape(KV, T, C, R)       # [KV, T, C, R]
    v = gather_blocks(kv_cache, layer, 1, blk).reshape(KV, T, C, R)       # [KV, T, C, R]
    if holds in QUANT_ROWS:   # dequantized inside the gather's fusion
        k, v = int8_values(k, holds), int8_values(v, holds)
    elif holds:   # widened inside the gather: half the bytes read
        k = lax.bitcast_convert_type(k, held(holds)) if k.dtype != held(holds) else k
        v = lax.bitcast_convert_type(v, held(holds)) if v.dtype != held(holds) else v
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
def _lower_paged_attention(ctx, q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                     scale, softcap):
    composite = _private.composite(paged_attention_reference, PAGED_ATTENTION.name, PAGED_ATTENTION.version)
    out = composite(*_operands(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens),
                    window=int(window or 0), holds=int(holds), scale=np.float32(scale),
                    softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)


# hloserve::paged_attention_windowed(..., Tensor window, int holds, float scale, float softcap) -> Tensor:
# version 2, the window an s32[] operand
@lower(torch.ops.hloserve.paged_attention_windowed)
def _lower_paged_attention_windowed(ctx, q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, holds,
                              scale, softcap):
    composite = _private.composite(paged_attention_reference_v2, PAGED_ATTENTION_V2.name, PAGED_ATTENTION_V2.version)
    out = composite(*_operands(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens),
                    jnp.asarray(window, jnp.int32).reshape(()), holds=int(holds), scale=np.float32(scale),
                    softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)
