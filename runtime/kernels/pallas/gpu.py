"""The GPU kernel behind `hloserve.paged_attention`: paged attention in Pallas, lowered through
Triton, for the artifact's cache layout `[L, 2, KV, N, BS, D]`.

One program per (token, kv head). It loops over the blocks of the token's context that it can see
(from the first block of a sliding window to the block of its last visible position), loads each
`[BS, D]` K and V tile where the block table says it lies in the cache (no gather of the context,
no copy of the cache), and keeps an online softmax in f32. The G query heads sharing the KV head
are one `[G, D]` tile; scores and sums are f32 broadcast-multiply-reductions rather than `tl.dot`
(exact f32 like the decomposition, no 16-row minimum; decode attention is bound by reading K/V).
Decode rows and prompt chunks are both rows of the grid. Triton needs power-of-two tiles: G is
padded to one here, and BS and D must be powers of two (`supports`; an int8 cache's rows of D + 2 or
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

from .paged import MASKED, PagedParams, block_range, cap, scalar_operands, seen, widen

NAME = "pallas_triton.paged_attention"


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
    `window`: version 2's operand, None for version 1, whose window is params.window)."""
    T, KV, G, D = q.shape
    L, _, _, N, BS, _ = kv_cache.shape
    S, B = block_tables.shape
    why = supports(BS, D)
    if why:
        raise ValueError(f"the Triton paged-attention kernel cannot serve this cache: {why}")
    Gp = 1 << max(G - 1, 0).bit_length()                                 # G padded to a power of two
    qp = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, Gp - G), (0, 0))) if Gp != G else q.astype(jnp.float32)
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
