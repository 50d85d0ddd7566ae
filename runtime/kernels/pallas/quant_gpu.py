"""The GPU kernel behind `hloserve.quant_linear` version 2: weight-only int8 / int4 matrix products
in Pallas, lowered through Triton, dequantizing in registers next to the dot (quant.py has the layout).

One program per (tile of BM activation rows, 16-row block of the layer's matrix). It loops over the
row block's bytes in tiles of U steps of `a` (U x 16 x 4 bytes: U x 64 int8 elements, or U x 128
int4 ones), read where they lie in the stacked weights at the layer (no slice, no copy). For each
c of the 4 byte columns it loads the strided [U, 16] tile, widens it to f32 (int4: both nibbles,
sign-extended without mins), multiplies by the tile's scale rows (and adds the mins), and adds
x_c [BM, U] times that tile to a [BM, 16] f32 accumulator: `jnp.dot` at highest precision (tl.dot
with f32 operands, f32 sums: the contract's arithmetic, no TF32) where the tile has 16 or more of
each dimension (Triton's minimum), else a broadcast product summed in f32. The dequantized weight
never reaches memory: the matrix is read once per tile of rows, at 1 (int8) or 1/2 (int4) byte
per element.

Version 3 (GGUF K-quants, `kquant_linear`): one program per (tile of BM activation rows, TN rows of
the layer's matrix), looping over the rows' bytes in tiles of TB. The quants are read as [TN, TB /
group, group] blocks where they lie in the stack (a view of the bytes by sub-block, no copy), so the
layer's scale and min rows (decoded in the graph, quant.py) broadcast over each sub-block's bytes
and the dequantized tile is reshaped to [TN, TB] for the dot.

Version 4 (5-bit values, GGUF Q5_0 kept, `five_linear`): version 2's programs, looping over B blocks
of 32 elements at a time, the layer's matrix viewed as [blocks, 5, 16, 4] bytes per 16-row block. For
each k-step s and byte column c it loads the strided [B, 16] tile of nibbles (as int4's, unsigned)
and, for each half, the 8 mask bytes of the step ([B, 2, 4] of the fifth run), broadcast to the 16
rows (row r reads byte r // 2) and shifted by 4 (r % 2) + c: the lane's fifth bit, 16 added where it
is set. One scale row per block, as the stack stores it.
Runs in Pallas interpret mode on any platform (`interpret=True`, the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .quant import (ROWS, KQuantParams, QuantParams, five_phases, kquant16_operands, kquant_scales, layer_of,
                    padded_rows, phases, rounded, steps, weights_nt, widen)

NAME = "pallas_triton.quant_linear"
KQUANT_NAME = "pallas_triton.kquant_linear"
FIVE_NAME = "pallas_triton.five_linear"
MAX_STEPS = 32      # steps of `a` per tile: 32 x 64 bytes of a row block
DOT_MIN = 16        # tl.dot needs 16 or more in each dimension
KQ_BYTES = 256      # version 3: bytes of a row per tile (at most)
KQ_ROWS = 64        # version 3: rows of the matrix per program (at most)
FIVE_BLOCKS = 16    # version 4: 32-element blocks per loop iteration (at most; a power of two dividing K / 32)


def row_tile(m: int) -> int:
    """Activation rows per program: 16 (decode steps and tl.dot's minimum), 32 or 64 for longer steps."""
    return 16 if m <= 16 else 32 if m <= 64 else 64


def _scale_tile(ref, layer, nb, a0, u: int, per_group: int):
    """Each step's scale (or min) of a [U, 16] tile from rows a0 .. a0 + U: the group rows the tile
    falls in, widened to f32, row j of the group span chosen where the step index reaches it."""
    g0 = a0 // per_group
    rows = [ref[layer, nb, g0 + j, :].astype(jnp.float32) for j in range(max(1, u // per_group))]
    tile = jnp.broadcast_to(rows[0][None, :], (u, ROWS))
    if len(rows) > 1:
        step = lax.broadcasted_iota(jnp.int32, (u, ROWS), 0)
        for j, row in enumerate(rows[1:], 1):
            tile = jnp.where(step >= j * per_group, row[None, :], tile)
    return tile


def _product(x, w):
    """x [BM, U] times w [U, 16], f32 products and sums."""
    if min(x.shape[0], x.shape[1]) >= DOT_MIN:
        return jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (x[:, :, None] * w[None, :, :]).sum(axis=1)


def _kernel(layer_ref, x_ref, w_ref, s_ref, *rest, params: QuantParams, bm: int, u: int, ka: int,
            symmetric: bool, picked: bool):
    m_ref, o_ref = (None, rest[0]) if symmetric else rest
    i, nb = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    at = 0 if picked else layer                                         # the scales' layer
    rows = pl.ds(i * bm, bm)

    def body(t, acc):
        a0 = t * u
        s = _scale_tile(s_ref, at, nb, a0, u, params.per_group)
        mn = None if symmetric else _scale_tile(m_ref, at, nb, a0, u, params.per_group)
        for c in range(4):
            parts = widen(w_ref[layer, nb, pl.ds(a0, u), :, c], params.bits, symmetric)
            for h, q in enumerate(parts):          # int4: the high nibble is phase 4 + c
                w = rounded(q * s if symmetric else q * s + mn, params)
                acc = acc + _product(x_ref[4 * h + c, rows, pl.ds(a0, u)], w)
        return acc

    o_ref[...] = lax.fori_loop(0, ka // u, body, jnp.zeros((bm, ROWS), jnp.float32))


def quant_linear(x, qweight, scale, min_, layer, *, params: QuantParams, interpret: bool = False,
                 num_warps: int = 4, picked: bool = False):
    """The composite's operands (QUANT_LINEAR_V2: x f32[M, K], qweight [L, N/16, 16 K | 8 K], scale and
    min [L, N/16, K/group, 16] or min f32[0], layer s32[]) -> f32[M, N]. `picked`: scale and min are
    the layer's already, a stack of one (version 5's decoded headers)."""
    M, K = x.shape
    L, NB = qweight.shape[:2]
    symmetric = min_.size == 0
    ka = K // params.unit
    u = steps(params, K, MAX_STEPS)
    bm = row_tile(M)
    mp = padded_rows(M, bm)
    xs = phases(x, params, mp)                                           # [unit, Mp, K / unit]
    w = qweight.reshape(L, NB, ka, ROWS, 4)                              # byte (a, 4 r + c) as [a, r, c]
    mins = () if symmetric else (min_,)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, params=params, bm=bm, u=u, ka=ka, symmetric=symmetric, picked=picked),
        grid=(mp // bm, NB),
        in_specs=[any_spec] * (4 + len(mins)),
        out_specs=pl.BlockSpec((bm, ROWS), lambda i, nb: (i, nb)),
        out_shape=jax.ShapeDtypeStruct((mp, NB * ROWS), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="hloserve_quant_linear",
    )(layer_of(layer, L), xs, w, scale, *mins)
    return out[:M]


def kquant16_linear(x, qweight, blocks, layer, *, params: KQuantParams, interpret: bool = False,
                    num_warps: int = 4):
    """Version 5 (QUANT_LINEAR_V5: qweight interleaved as version 2's, blocks u8 [L, N, K/256 * H]) on
    version 2's kernel, the layer's headers decoded in the graph (quant.kquant16_operands)."""
    scale, mins, p = kquant16_operands(blocks, layer, params)
    return quant_linear(x, qweight, scale, mins, layer, params=p, interpret=interpret, num_warps=num_warps,
                        picked=True)


def _product_nt(x, w):
    """x [BM, TB] times w [TN, TB] transposed, f32 products and sums (tl.dot where every dimension
    has 16 or more, else a broadcast product)."""
    if min(*x.shape, w.shape[0]) >= DOT_MIN:
        return weights_nt(x, w)
    return (x[:, None, :] * w[None, :, :]).sum(axis=2)


def _kquant_kernel(layer_ref, x_ref, w_ref, s_ref, *rest, params: KQuantParams, bm: int, tn: int, tb: int,
                   kb: int):
    m_ref, o_ref = rest if params.has_min else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * tn, tn)
    g = tb // params.group_bytes                                         # sub-blocks of a tile

    def body(t, acc):
        subs = pl.ds(t * g, g)
        s = s_ref[cols, subs][:, :, None]                               # [TN, g, 1]
        mn = None if m_ref is None else m_ref[cols, subs][:, :, None]
        for p, qp in enumerate(widen(w_ref[layer, cols, subs, :], params.bits, signed=False)):   # [TN, g, group bytes]
            w = (qp * s if mn is None else qp * s + mn).reshape(tn, tb)
            acc = acc + _product_nt(x_ref[p, rows, pl.ds(t * tb, tb)], w)
        return acc

    o_ref[...] = lax.fori_loop(0, kb // tb, body, jnp.zeros((bm, tn), jnp.float32))


def kquant_tiles(params: KQuantParams, m: int, n: int, kb: int) -> tuple[int, int, int]:
    """(BM rows, TN matrix rows, TB bytes) per program: Triton's tiles are powers of two, so TN is
    the largest up to KQ_ROWS dividing N (1 at worst) and TB the largest up to KQ_BYTES dividing the
    row's bytes (a multiple of 128: K is a multiple of 256)."""
    tn = next(t for t in (KQ_ROWS >> s for s in range(7)) if n % t == 0)
    tb = next(t for t in (KQ_BYTES, KQ_BYTES // 2) if kb % t == 0)
    return row_tile(m), tn, tb


def kquant_linear(x, qweight, blocks, layer, *, params: KQuantParams, interpret: bool = False, num_warps: int = 4):
    """The composite's operands (QUANT_LINEAR_V3: x f32[M, K], qweight [L, N, K/2] u8 (Q4_K) or [L, N, K]
    s8, blocks u8 [L, N, K/256 * H], layer s32[]) -> f32[M, N]."""
    M, K = x.shape
    L, N, KB = qweight.shape
    bm, tn, tb = kquant_tiles(params, M, N, KB)
    mp = padded_rows(M, bm)
    scale, low = kquant_scales(blocks, layer, params)                    # [N, K / group] f32
    rows = (scale,) if low is None else (scale, low)
    w = qweight.reshape(L, N, KB // params.group_bytes, params.group_bytes)   # bytes by sub-block
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kquant_kernel, params=params, bm=bm, tn=tn, tb=tb, kb=KB),
        grid=(mp // bm, N // tn),
        in_specs=[any_spec] * (3 + len(rows)),
        out_specs=pl.BlockSpec((bm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="hloserve_kquant_linear",
    )(layer_of(layer, L), phases(x, params, mp), w, *rows)
    return out[:M]


def _five_kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, *, bm: int, b: int, nblk: int):
    i, nb = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows = pl.ds(i * bm, bm)
    row = lax.broadcasted_iota(jnp.int32, (b, ROWS), 1)

    def body(t, acc):
        blocks = pl.ds(t * b, b)
        scale = s_ref[layer, nb, blocks, :].astype(jnp.float32)                   # [B, 16]
        for s in range(4):
            for h in range(2):   # the step's mask bytes of its low (h 0) or high (1) nibbles, row r's at r // 2
                masks = w_ref[layer, nb, blocks, 4, pl.ds(4 * s + 2 * h, 2), :].reshape(b, 8).astype(jnp.int32)
                masks = jnp.broadcast_to(masks[:, :, None], (b, 8, 2)).reshape(b, ROWS)
                for c in range(4):
                    code = widen(w_ref[layer, nb, blocks, s, :, c], 4, signed=False)[h]            # [B, 16]
                    bit = lax.shift_right_logical(masks, 4 * (row & 1) + c) & 1
                    w = (code + 16.0 * bit.astype(jnp.float32) - 16.0) * scale
                    acc = acc + _product(x_ref[4 * h + c, s, rows, blocks], w)
        return acc

    o_ref[...] = lax.fori_loop(0, nblk // b, body, jnp.zeros((bm, ROWS), jnp.float32))


def five_linear(x, qweight, scale, min_, layer, *, params: QuantParams, interpret: bool = False, num_warps: int = 4):
    """The composite's operands (QUANT_LINEAR_V4: x f32[M, K], qweight u8 [L, N/16, 10 K], scale
    [L, N/16, K/32, 16], min f32[0], layer s32[]) -> f32[M, N]."""
    del min_, params
    M, K = x.shape
    L, NB = qweight.shape[:2]
    nblk = K // 32
    b = next(t for t in (FIVE_BLOCKS >> s for s in range(5)) if nblk % t == 0)
    bm = row_tile(M)
    mp = padded_rows(M, bm)
    w = qweight.reshape(L, NB, nblk, 5, ROWS, 4)                          # block, run, row, byte column
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_five_kernel, bm=bm, b=b, nblk=nblk),
        grid=(mp // bm, NB),
        in_specs=[any_spec] * 4,
        out_specs=pl.BlockSpec((bm, ROWS), lambda i, nb: (i, nb)),
        out_shape=jax.ShapeDtypeStruct((mp, NB * ROWS), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="hloserve_five_linear",
    )(layer_of(layer, L), five_phases(x, mp), w, scale)
    return out[:M]
