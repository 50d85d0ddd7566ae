"""What every accelerator kernel of `hloserve.paged_attention` shares: its static parameters, the
range of cache blocks a token reads, the mask inside a block, and the widening of stored K/V.

The contract is runtime/artifact/kernels.py's PAGED_ATTENTION; the reference is its decomposition
(exporter/composites/paged_attention.py). Both kernels walk only the blocks a token can see, with an online
softmax over them, and read each block where it lies in the cache `[L, 2, KV, N, BS, R]` (R = D, or
D + 2 / D + 3 for int8 rows, D + 2 for fp8 e4m3 rows, dequantized by `widen` as each tile is read).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from hloserve.runtime.artifact.kernels import Holds
from jax import lax

# Finite "minus infinity" for masked scores, as the decomposition uses: no NaN from a row that sees nothing.
MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class PagedParams:
    """The composite's attributes, as a kernel takes them (static: one kernel per value)."""
    window: int | None   # attend to positions > position - window (0: no window; None: an operand, version 2)
    holds: int       # what the cache elements are: 0 its own dtype, 1 bfloat16, 2 float16, 3/4 int8 rows, 5 fp8
    scale: float     # the scores' factor
    softcap: float   # scores become softcap * tanh(scores / softcap) (0: no capping)

    @classmethod
    def from_attributes(cls, attrs: dict) -> "PagedParams":
        window = int(attrs["window"]) if "window" in attrs else None
        return cls(window=window, holds=int(attrs["holds"]), scale=float(attrs["scale"]),
                   softcap=float(attrs["softcap"]))


def block_range(position, context_len, block_size: int, window):
    """(first, last) block of a token's context: the blocks holding positions c with
    c <= position, c < context_len and, with a window, c > position - window. last < first when
    the token sees nothing (padding: context_len 0). `window`: an int, or an s32 scalar read in
    the kernel (version 2; 0 or less: no window).
    (Truncating division of non-negative values: Mosaic's floor division asks which TPU it runs on,
    which a lowering without the device cannot answer.)"""
    end = jnp.minimum(position, context_len - 1)                     # the last position seen
    if isinstance(window, int):
        start = jnp.maximum(position - window + 1, 0) if window else jnp.int32(0)
    else:
        start = jnp.where(window > 0, jnp.maximum(position - window + 1, 0), 0)
    last = jnp.where(end >= 0, lax.div(jnp.maximum(end, 0), block_size), -1)
    return lax.div(start, block_size), last


def seen(block, position, context_len, block_size: int, window):
    """bool[1, BS]: which positions of block `block` the token attends to (`window` as block_range's)."""
    c = block * block_size + lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
    ok = (c <= position) & (c < context_len)
    if not isinstance(window, int):
        ok = ok & ((window <= 0) | (c > position - window))
    elif window:
        ok = ok & (c > position - window)
    return ok


def window_operand(window, params: PagedParams):
    """s32[1]: the window a kernel reads (version 2's operand, or version 1's attribute as a constant)."""
    return jnp.reshape(jnp.asarray(params.window if window is None else window, jnp.int32), (1,))


def scalar_operands(layer, window, block_tables, seq_ids, positions, context_lens, *, params: PagedParams,
                    blocks: int) -> list:
    """The six s32 operands both kernels read as scalars: layer[1], window[1], the block tables
    flattened (entries clipped to the cache's `blocks`, as the decomposition's gather clips), the
    sequence ids, positions and context lengths."""
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, blocks - 1).reshape(-1)
    return [jnp.reshape(layer, (1,)).astype(jnp.int32), window_operand(window, params), tables,
            seq_ids.astype(jnp.int32), positions.astype(jnp.int32), context_lens.astype(jnp.int32)]


def widen(x, holds: int, head_dim: int):
    """Stored K/V rows [.., R] -> f32 [.., head_dim]: bits of a 16-bit float are reinterpreted first;
    int8 rows are dequantized by their row's bf16 scale: q * scale (Holds.INT8_ROWS, R = head_dim + 2)
    or (q - zero) * scale with the row's int8 zero point (Holds.INT8_ZP_ROWS, R = head_dim + 3); fp8
    rows as e4m3(f) * scale (Holds.FP8_E4M3_ROWS, R = head_dim + 2)."""
    if holds in (Holds.INT8_ROWS, Holds.INT8_ZP_ROWS, Holds.FP8_E4M3_ROWS):
        scale_bits = x[..., head_dim + 1].astype(jnp.int32) * 16777216 + (x[..., head_dim].astype(jnp.int32) & 0xFF) * 65536
        if holds == Holds.FP8_E4M3_ROWS:
            return e4m3_values(x[..., :head_dim]) * lax.bitcast_convert_type(scale_bits, jnp.float32)[..., None]
        q = x[..., :head_dim].astype(jnp.float32)
        if holds == Holds.INT8_ZP_ROWS:
            q = q - x[..., head_dim + 2:head_dim + 3].astype(jnp.float32)
        return q * lax.bitcast_convert_type(scale_bits, jnp.float32)[..., None]
    held = jnp.dtype(Holds(holds).dtype_name) if holds else None
    if held is not None and x.dtype != held:
        x = lax.bitcast_convert_type(x, held)
    return x.astype(jnp.float32)


def e4m3_values(codes):
    """float8 e4m3fn bits (int8) -> their f32 values, in 32-bit integer arithmetic and one bitcast
    (Mosaic lowers these on every TPU; no float8 type in the kernel): a normal magnitude's 7 bits
    moved into an f32's exponent and mantissa with the exponent rebiased (7 -> 127), a subnormal's
    mantissa times 2^-9, then the sign."""
    b = codes.astype(jnp.int32) & 0xFF
    mag = b & 0x7F
    normal = lax.bitcast_convert_type(mag * 1048576 + (120 << 23), jnp.float32)
    value = jnp.where(mag < 8, mag.astype(jnp.float32) * (2.0 ** -9), normal)
    return jnp.where(b >= 128, -value, value)


def cap(scores, params: PagedParams):
    """Scaled, soft-capped scores."""
    scores = scores * params.scale
    if params.softcap:
        scores = params.softcap * jnp.tanh(scores / params.softcap)
    return scores
