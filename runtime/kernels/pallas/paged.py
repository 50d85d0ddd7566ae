"""What every accelerator kernel of `hloserve.paged_attention` shares: its static parameters, the
range of cache blocks a token reads, the mask inside a block, the widening of stored K/V, and the
table that cuts a step's rows into tiles of one sequence (both kernels' tile paths).

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


def _cumsum(x):
    """A running sum in plain StableHLO ops: jax 0.11 lowers jnp.cumsum to a `chlo.scan` composite that
    a CUDA plugin at StableHLO 1.20 refuses when the linked step is serialized for it (H200, 2026-11-30)."""
    return lax.associative_scan(jnp.add, x)


def tile_table(seq_ids, positions, context_lens, window, *, block_size: int, max_blocks: int, tile_rows: int):
    """The tiles of a step, computed in the graph before the kernel: the rows sorted by sequence
    (stable) and cut into runs of `tile_rows` rows of one sequence. Returns (rows s32[nt, tile_rows]:
    each slot's row, T for an empty slot; seq s32[nt]; first, last s32[nt]: the blocks the tile's rows
    see, last < first for a tile that sees nothing), nt the static bound on tiles."""
    T, S = seq_ids.shape[0], context_lens.shape[0]
    nt = min(T, -(-(T + S * (tile_rows - 1)) // tile_rows))
    seq = jnp.clip(seq_ids.astype(jnp.int32), 0, S - 1)
    order = jnp.argsort(seq, stable=True)
    sorted_seq = seq[order]
    counts = jnp.zeros((S,), jnp.int32).at[seq].add(1)
    rank = jnp.arange(T, dtype=jnp.int32) - (_cumsum(counts) - counts)[sorted_seq]   # row's place in its sequence
    tile = _cumsum((rank % tile_rows == 0).astype(jnp.int32)) - 1
    rows = jnp.full((nt, tile_rows), T, jnp.int32).at[tile, rank % tile_rows].set(order.astype(jnp.int32))
    tile_seq = jnp.zeros((nt,), jnp.int32).at[tile].set(sorted_seq)
    pos = jnp.concatenate([positions.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])[rows]   # -1: empty slot
    w = window if window is not None else 0
    first, last = block_range(pos, context_lens.astype(jnp.int32)[tile_seq][:, None], block_size, w)
    first = jnp.where(pos >= 0, first, max_blocks).min(axis=1)
    return rows, tile_seq, first, last.max(axis=1), pos


def tiles_in(q, rows):
    """A step's query rows [T, KV, G, D] gathered into its tiles [nt, KV, tile_rows * G, D] (`rows`:
    tile_table's; an empty slot reads zeros). A tile's query rows are (row, head) pairs, row-major."""
    T, KV, G, D = q.shape
    nt, tile_rows = rows.shape
    qt = jnp.concatenate([q, jnp.zeros((1, KV, G, D), q.dtype)])[rows]                 # [nt, tile_rows, KV, G, D]
    return qt.transpose(0, 2, 1, 3, 4).reshape(nt, KV, tile_rows * G, D)


def tiles_out(out, rows, T: int):
    """The tiles' outputs [nt, KV, tile_rows * G, D] back in step order [T, KV, G, D]."""
    nt, KV, R, D = out.shape
    tile_rows = rows.shape[1]
    G = R // tile_rows
    flat = out.reshape(nt, KV, tile_rows, G, D).transpose(0, 2, 1, 3, 4).reshape(nt * tile_rows, KV, G, D)
    where = jnp.zeros((T + 1,), jnp.int32).at[rows.reshape(-1)].set(jnp.arange(nt * tile_rows, dtype=jnp.int32))
    return flat[where[:T]]


def cap(scores, params: PagedParams):
    """Scaled, soft-capped scores."""
    scores = scores * params.scale
    if params.softcap:
        scores = params.softcap * jnp.tanh(scores / params.softcap)
    return scores
