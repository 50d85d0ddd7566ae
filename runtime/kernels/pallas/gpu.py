"""The GPU kernel behind `hloserve.paged_attention`: paged attention in Pallas, lowered through
Triton, for the artifact's cache layout `[L, 2, KV, N, BS, D]`.

One program per (token, kv head). It loops over the blocks of the token's context that it can see
(from the first block of a sliding window to the block of its last visible position), loads each
`[BS, D]` K and V tile where the block table says it lies in the cache (no gather of the context,
no copy of the cache), and keeps an online softmax in f32. The G query heads sharing the KV head
are one `[G, D]` tile; scores and sums are f32 broadcast-multiply-reductions rather than `tl.dot`
(exact f32 like the decomposition, no 16-row minimum; decode attention is bound by reading K/V).
Decode rows and prompt chunks are both rows of the grid (`per_token`). A step whose rows outnumber
its sequences (static: T > S, so some sequence has several rows) runs the tile path instead
(`tiled`): the graph first sorts the rows by sequence and cuts each sequence's rows into tiles of
TILE_ROWS, a table of (sequence, first block, last block) per tile plus each row's position; one
program per (tile, kv head) then reads each K/V block once for the tile's TILE_ROWS x G query rows
and scores it with a matrix product (`tl.dot`, f32 operands at highest precision, f32 sums). The grid
is an upper bound on tiles (ceil((T + S (TILE_ROWS - 1)) / TILE_ROWS)); padding tiles loop over no
block. tl.dot needs 16 or more of each dimension: the tile path asks BS >= 16 and D >= 16. Triton needs power-of-two tiles: G is
padded to one here, and BS and D must be powers of two (`supports`; an int8 or fp8 cache's rows of D + 2 or
D + 3 are not, so on a GPU its decomposition runs). Runs in Pallas interpret mode
on any platform (`interpret=True`, the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .paged import MASKED, PagedParams, block_range, cap, scalar_operands, seen, tile_table, tiles_in, tiles_out, widen

NAME = "pallas_triton.paged_attention"
TILE_ROWS = 16   # query rows (tokens) of one sequence per program of the tile path, times G heads


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(block_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this cache shape (then the decomposition runs), or None."""
    if not (_pow2(block_size) and _pow2(head_dim)):
        return f"block_size {block_size} and head_dim {head_dim} must be powers of two for Triton tiles"
    return None


def _kernel(layer_ref, window_ref, tables_ref, seq_ref, pos_ref, lens_ref, q_ref, kv_ref, o_ref, *,
            params: PagedParams, block_size: int, max_blocks: int):
    t, h = pl.program_id(0), pl.program_id(1)
    layer, seq, window = layer_ref[0], seq_ref[t], window_ref[0]
    pos, ctx = pos_ref[t], lens_ref[seq]
    first, last = block_range(pos, ctx, block_size, window)
    q = q_ref[...]                                                       # [G, D]
    G, D = q.shape

    def body(j, carry):
        m_prev, l_prev, acc = carry
        block = tables_ref[seq * max_blocks + j]
        k = widen(kv_ref[layer, 0, h, block, :, :], params.holds, D)     # [BS, D]
        v = widen(kv_ref[layer, 1, h, block, :, :], params.holds, D)
        s = cap((q[:, None, :] * k[None, :, :]).sum(axis=-1), params)    # [G, BS]
        s = jnp.where(seen(j, pos, ctx, block_size, window), s, MASKED)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + p.sum(axis=1)
        acc = alpha[:, None] * acc + (p[:, :, None] * v[None, :, :]).sum(axis=1)
        return m_new, l_new, acc

    init = (jnp.full((G,), MASKED, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, D), jnp.float32))
    _, l, acc = lax.fori_loop(first, jnp.minimum(last, max_blocks - 1) + 1, body, init)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def paged_attention(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
                    params: PagedParams, interpret: bool = False, num_warps: int = 4):
    """The composite's operands -> f32[T, KV, G, D] (runtime/artifact/kernels.py, PAGED_ATTENTION;
    `window`: version 2's operand, None for version 1, whose window is params.window). Steps with
    more rows than sequences take the tile path where the cache's tiles allow it (`tiles_fit`)."""
    T, KV, G, D = q.shape
    _, _, _, _, BS, _ = kv_cache.shape
    why = supports(BS, D)
    if why:
        raise ValueError(f"the Triton paged-attention kernel cannot serve this cache: {why}")
    run = tiled if T > block_tables.shape[0] and tiles_fit(BS, D) else per_token
    return run(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window, params=params,
               interpret=interpret, num_warps=num_warps)


def _padded_heads(q):
    """q as f32 with its G heads padded to a power of two (Triton tiles), and that G."""
    G = q.shape[2]
    Gp = 1 << max(G - 1, 0).bit_length()
    qp = q.astype(jnp.float32)
    return (jnp.pad(qp, ((0, 0), (0, 0), (0, Gp - G), (0, 0))) if Gp != G else qp), Gp


def per_token(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
              params: PagedParams, interpret: bool = False, num_warps: int = 4):
    """The per-token path: one program per (row, kv head), f32 broadcast products (decode steps)."""
    T, KV, G, D = q.shape
    N, BS = kv_cache.shape[3], kv_cache.shape[4]
    B = block_tables.shape[1]
    qp, Gp = _padded_heads(q)
    scalars = scalar_operands(layer, window, block_tables, seq_ids, positions, context_lens, params=params, blocks=N)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, params=params, block_size=BS, max_blocks=B),
        grid=(T, KV),
        in_specs=[any_spec] * 6 + [pl.BlockSpec((None, None, Gp, D), lambda t, h: (t, h, 0, 0)), any_spec],
        out_specs=pl.BlockSpec((None, None, Gp, D), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T, KV, Gp, D), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="hloserve_paged_attention",
    )(*scalars, qp, kv_cache)
    return out[:, :, :G] if Gp != G else out


def tiles_fit(block_size: int, head_dim: int) -> bool:
    """Whether the tile path's matrix products suit the cache (tl.dot: 16 or more per dimension)."""
    return block_size >= 16 and head_dim >= 16


def _tile_kernel(layer_ref, window_ref, tables_ref, lens_ref, seq_ref, first_ref, last_ref, pos_ref, q_ref, kv_ref,
                 o_ref, *, params: PagedParams, block_size: int, max_blocks: int):
    i, h = pl.program_id(0), pl.program_id(1)
    layer, seq, window = layer_ref[0], seq_ref[i], window_ref[0]
    ctx = lens_ref[seq]
    pos = pos_ref[...][:, None]                                          # [R, 1]: each query row's position
    q = q_ref[...]                                                       # [R, D], R = tile rows x G
    R, D = q.shape
    dims = (((1,), (1,)), ((), ()))
    hi = lax.Precision.HIGHEST

    def body(j, carry):
        m_prev, l_prev, acc = carry
        block = tables_ref[seq * max_blocks + j]
        k = widen(kv_ref[layer, 0, h, block, :, :], params.holds, D)     # [BS, D], read once per tile
        v = widen(kv_ref[layer, 1, h, block, :, :], params.holds, D)
        s = cap(lax.dot_general(q, k, dims, precision=hi, preferred_element_type=jnp.float32), params)   # [R, BS]
        s = jnp.where(seen(j, pos, ctx, block_size, window), s, MASKED)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + p.sum(axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p, v, precision=hi, preferred_element_type=jnp.float32)
        return m_new, l_new, acc

    init = (jnp.full((R,), MASKED, jnp.float32), jnp.zeros((R,), jnp.float32), jnp.zeros((R, D), jnp.float32))
    _, l, acc = lax.fori_loop(first_ref[i], jnp.minimum(last_ref[i], max_blocks - 1) + 1, body, init)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def tiled(q, kv_cache, layer, block_tables, seq_ids, positions, context_lens, window=None, *,
          params: PagedParams, interpret: bool = False, num_warps: int = 4, tile_rows: int = TILE_ROWS):
    """The tile path: one program per (tile of `tile_rows` rows of one sequence, kv head); the rows
    are gathered into tiles before the kernel and back into step order after it."""
    T, KV, G, D = q.shape
    N, BS = kv_cache.shape[3], kv_cache.shape[4]
    B = block_tables.shape[1]
    qp, Gp = _padded_heads(q)
    R = tile_rows * Gp
    layer_s, window_s, tables, _, _, lens = scalar_operands(layer, window, block_tables, seq_ids, positions,
                                                            context_lens, params=params, blocks=N)
    rows, tile_seq, first, last, pos = tile_table(seq_ids, positions, lens, window_s[0], block_size=BS,
                                                  max_blocks=B, tile_rows=tile_rows)
    nt = rows.shape[0]
    qt = tiles_in(qp, rows)                                                             # [nt, KV, R, D]
    pos_rows = jnp.repeat(pos, Gp, axis=1)                                              # [nt, R]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_tile_kernel, params=params, block_size=BS, max_blocks=B),
        grid=(nt, KV),
        in_specs=[any_spec] * 7 + [pl.BlockSpec((None, R), lambda i, h: (i, 0)),
                                   pl.BlockSpec((None, None, R, D), lambda i, h: (i, h, 0, 0)), any_spec],
        out_specs=pl.BlockSpec((None, None, R, D), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nt, KV, R, D), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="hloserve_paged_attention_tiles",
    )(layer_s, window_s, tables, lens, tile_seq, first, last, pos_rows, qt, kv_cache)
    return tiles_out(out, rows, T)[:, :, :G]
