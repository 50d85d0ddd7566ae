"""The TPU kernel behind `hloserve.paged_attention`: ragged paged attention in Pallas (Mosaic),
written for the artifact's cache layout `[L, 2, KV, N, BS, D]`.

Grid (token, kv head, block of the context). The block tables, sequence ids, positions, context
lengths, the layer and the window (an operand in version 2) are scalar-prefetched into SMEM, so each K and V block's index map reads the
cache block the token's sequence holds at that place (layer, K|V, head, block) and the pipeline
DMAs exactly that `[BS, D]` tile into VMEM: nothing of the cache is gathered or copied. Grid steps
outside the token's blocks (past its context, or before a sliding window) re-name the nearest block
in range, which the pipeline does not fetch again, and skip the compute. The G query heads sharing
a KV head are one `[G, D]` tile; scores, the online softmax and the sums run in f32.

A step whose rows outnumber its sequences (static: T > S, a prompt chunk in it) runs the tile path
(`tiled`), ragged paged attention in the manner of vLLM-TPU's kernels: decode rows and chunks in one
call, the rows cut into tiles of TILE_ROWS rows of one sequence (paged.tile_table, in the graph
before the kernel), grid (tile, kv head, block). Each K and V block is DMA'd once for the tile's
TILE_ROWS x G query rows and scored with one matrix product on the MXU; every row keeps its own
online softmax and mask (its position, the window), so a chunk's causal edge and a window's start
fall inside a block as they may. A decode row among chunks is a tile of one row (the rest empty
slots, which read no block of their own). Decode-only steps (T = S) keep the per-row grid. TILE_ROWS
is not tuned on a TPU (none has run this; the GPU kernel's 16 is taken). Both run in Pallas
interpret mode on any platform (`interpret=True`, the tests), and lower to Mosaic without the device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .paged import MASKED, PagedParams, block_range, cap, scalar_operands, seen, tile_table, tiles_in, tiles_out, widen

NAME = "pallas_tpu.ragged_paged_attention"
TILE_ROWS = 16   # query rows (tokens) of one sequence per tile of the tile path, times G heads


def supports(block_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this cache shape, or None: its tiles are whole `[BS, D]` blocks and
    `[G, D]` query groups (full trailing dims, which Mosaic accepts at any size)."""
    del block_size, head_dim
    return None


def _online_softmax(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, j, first, last, pos, ctx, window,
                    params: PagedParams, block_size: int):
    """One grid step over a K/V block for the query rows in q_ref ([rows, D]; `pos` a scalar or each
    row's position [rows, 1]): the running max, sum and output in VMEM scratch, written out at the
    grid's last block. A row that sees nothing of a block adds exact zeros once it has seen a position
    (its max is then finite); what a row adds before that is scaled by exp(MASKED - max) = 0 later."""
    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((j >= first) & (j <= last))
    def _block():
        q = q_ref[...]
        k = widen(k_ref[...], params.holds, q.shape[-1])
        v = widen(v_ref[...], params.holds, q.shape[-1])
        s = cap(jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32), params)          # [rows, BS]
        s = jnp.where(seen(j, pos, ctx, block_size, window), s, MASKED)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, precision=jax.lax.Precision.HIGHEST,
                                                      preferred_element_type=jnp.float32)
        m_ref[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _done():
        l = l_ref[...]
        o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _softmax_scratch(rows: int, D: int) -> list:
    """_online_softmax's VMEM scratch for `rows` query rows: the running max, sum and output."""
    return [pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, D), jnp.float32)]


def _kernel(layer_ref, window_ref, tables_ref, seq_ref, pos_ref, lens_ref,   # scalar prefetch (SMEM)
            q_ref, k_ref, v_ref,                                        # [G, D], [BS, R], [BS, R]
            o_ref,                                                      # [G, D]
            m_ref, l_ref, acc_ref,                                      # VMEM scratch: [G, 1], [G, 1], [G, D]
            *, params: PagedParams, block_size: int):
    del layer_ref, tables_ref
    t = pl.program_id(0)
    pos, ctx, window = pos_ref[t], lens_ref[seq_ref[t]], window_ref[0]
    first, last = block_range(pos, ctx, block_size, window)
    _online_softmax(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, j=pl.program_id(2), first=first, last=last,
                    pos=pos, ctx=ctx, window=window, params=params, block_size=block_size)


def _tile_kernel(layer_ref, window_ref, tables_ref, lens_ref, seq_ref, first_ref, last_ref,   # scalar prefetch
                 pos_ref, q_ref, k_ref, v_ref,                          # [R, 1], [R, D], [BS, R'], [BS, R']
                 o_ref,                                                 # [R, D]
                 m_ref, l_ref, acc_ref,                                 # VMEM scratch: [R, 1], [R, 1], [R, D]
                 *, params: PagedParams, block_size: int):
    del layer_ref, tables_ref
    i = pl.program_id(0)
    _online_softmax(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, j=pl.program_id(2), first=first_ref[i],
                    last=last_ref[i], pos=pos_ref[...], ctx=lens_ref[seq_ref[i]], window=window_ref[0],
                    params=params, block_size=block_size)


def paged_attention(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
                    params: PagedParams, interpret: bool = False):
    """The composite's operands -> f32[T, KV, G, D] (runtime/artifact/kernels.py, PAGED_ATTENTION;
    `window`: version 2's operand, None for version 1, whose window is params.window). Steps with
    more rows than sequences take the tile path."""
    run = tiled if q.shape[0] > block_tables.shape[0] else per_token
    return run(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, params=params,
               interpret=interpret)


def per_token(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
              params: PagedParams, interpret: bool = False):
    """The per-row path: grid (row, kv head, block), a row's G heads against each block it sees."""
    T, KV, G, D = q.shape
    L, _, _, N, BS, R = kv_cache.shape                                 # R: D, or D + 2 / D + 3 (int8, fp8 rows)
    S, B = block_tables.shape

    def kv_map(which):
        def index(t, h, j, layer, window, tables, seqs, pos, lens):
            first, last = block_range(pos[t], lens[seqs[t]], BS, window[0])
            jj = jnp.clip(j, first, jnp.maximum(first, last))             # steps out of range re-name a block in it
            jj = jnp.minimum(jj, B - 1)
            return layer[0], which, h, tables[seqs[t] * B + jj], 0, 0
        return pl.BlockSpec((None, None, None, None, BS, R), index)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(T, KV, B),
        in_specs=[pl.BlockSpec((None, None, G, D), lambda t, h, j, *_: (t, h, 0, 0)), kv_map(0), kv_map(1)],
        out_specs=pl.BlockSpec((None, None, G, D), lambda t, h, j, *_: (t, h, 0, 0)),
        scratch_shapes=_softmax_scratch(G, D))
    return pl.pallas_call(
        functools.partial(_kernel, params=params, block_size=BS),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((T, KV, G, D), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="hloserve_paged_attention",
    )(*scalar_operands(layer, window, block_tables, seq_ids, positions, context_lens, params=params, blocks=N),
      q.astype(jnp.float32), kv_cache, kv_cache)


def tiled(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
          params: PagedParams, interpret: bool = False, tile_rows: int = TILE_ROWS):
    """The tile path: grid (tile of `tile_rows` rows of one sequence, kv head, block); the rows are
    gathered into tiles before the kernel and back into step order after it (paged.tiles_in/out)."""
    T, KV, G, D = q.shape
    L, _, _, N, BS, R = kv_cache.shape
    B = block_tables.shape[1]
    layer_s, window_s, tables, _, _, lens = scalar_operands(layer, window, block_tables, seq_ids, positions,
                                                            context_lens, params=params, blocks=N)
    rows, tile_seq, first, last, pos = tile_table(seq_ids, positions, lens, window_s[0], block_size=BS,
                                                  max_blocks=B, tile_rows=tile_rows)
    nt, QR = rows.shape[0], tile_rows * G
    qt = tiles_in(q.astype(jnp.float32), rows)                                         # [nt, KV, QR, D]
    pos_rows = jnp.repeat(pos, G, axis=1)[..., None]                                    # [nt, QR, 1]

    def kv_map(which):
        def index(i, h, j, layer, window, tables, lens, seqs, first, last):
            jj = jnp.minimum(jnp.clip(j, first[i], jnp.maximum(first[i], last[i])), B - 1)   # out of range: a block in it
            return layer[0], which, h, tables[seqs[i] * B + jj], 0, 0
        return pl.BlockSpec((None, None, None, None, BS, R), index)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(nt, KV, B),
        in_specs=[pl.BlockSpec((None, QR, 1), lambda i, h, j, *_: (i, 0, 0)),
                  pl.BlockSpec((None, None, QR, D), lambda i, h, j, *_: (i, h, 0, 0)), kv_map(0), kv_map(1)],
        out_specs=pl.BlockSpec((None, None, QR, D), lambda i, h, j, *_: (i, h, 0, 0)),
        scratch_shapes=_softmax_scratch(QR, D))
    out = pl.pallas_call(
        functools.partial(_tile_kernel, params=params, block_size=BS),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((nt, KV, QR, D), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="hloserve_paged_attention_tiles",
    )(layer_s, window_s, tables, lens, tile_seq, first, last, pos_rows, qt, kv_cache, kv_cache)
    return tiles_out(out, rows, T)
