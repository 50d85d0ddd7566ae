"""The TPU kernel behind `hloserve.quant_linear` version 2: weight-only int8 / int4 matrix products in
Pallas (Mosaic), dequantizing in VMEM next to the MXU's dot (quant.py has the layout).

Grid (tile of BM activation rows, T 16-row blocks of the layer's matrix, tile of U steps of `a`).
The layer is scalar-prefetched, so each weight block's index map names the layer's bytes and the
pipeline DMAs a [T, U, 64] block of int8 / packed int4 bytes from where it lies in the stack (no
slice of the stack, no dequantized copy in HBM). Lanes stay whole: a block's 64 bytes of step a
are rows r = l // 4, byte column c = l % 4, and rather than splitting lanes, the kernel multiplies
all 4 (int4: 8) activation phases, stacked as rows, by the dequantized [U, 64] tile in one dot and
keeps the [4 BM, 64] sums in f32 scratch; after the last step, row r's output is the sum over c of
phase c's sums at lane 4 r + c, picked by 0/1 matrices (exact: one nonzero term each). The scales
are widened to f32 with the layer picked in the graph ([N/16, G, 16], a copy of 1/4 - 1/8 of the
weight's bytes for groups of 32: Mosaic reads no f16) and spread over a tile's lanes and steps by
0/1 products as well. Every dot is f32 at highest precision with f32 sums (the contract).

Version 3 (GGUF K-quants, `kquant_linear`): grid (tile of BM activation rows, TN rows of the layer's
matrix, TB bytes of them), the quants DMA'd as [TN, TB] blocks of the stack at the scalar-prefetched
layer; the layer's scale and min rows (decoded in the graph, quant.py) come as [TN, TB / group]
blocks and are spread over the tile's bytes by 0/1 products; the phases' products are summed into
a [BM, TN] f32 scratch.

Version 4 (5-bit values, GGUF Q5_0 kept, `five_linear`): version 2's grid and lane sums, the layer's
matrix viewed as [blocks, 5, 64] bytes per 16-row block (4 k-steps of nibbles, then the masks), a
tile [T, B, 5, 64]; per k-step, the nibbles widened as int4's and each lane's fifth bit taken from
its mask byte (spread over the 8 lanes it covers by a 0/1 product, then shifted by the lane's place),
one scale row per block spread over the lanes as version 2's.
Runs in Pallas interpret mode on any platform (`interpret=True`, the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .quant import (ROWS, KQuantParams, QuantParams, five_phases, kquant16_operands, kquant_scales, layer_of,
                    padded_rows, phases, rounded, steps, weights_nt, widen)

NAME = "pallas_tpu.quant_linear"
KQUANT_NAME = "pallas_tpu.kquant_linear"
FIVE_NAME = "pallas_tpu.five_linear"
LANES = 4 * ROWS    # bytes of one step of `a` in a 16-row block
WHOLE_K = 512       # steps of `a` up to which one tile takes the whole row (else tiles of 128 lanes' multiples)
KQ_BYTES = 2048     # version 3: bytes of a row per tile, up to which one tile takes the whole row
FIVE_BLOCKS = 128   # version 4: 32-element blocks of a row per tile (the whole row up to this many, or where none divides)


def _dot(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pick(shape, rows_of, cols_of):
    """A 0/1 f32 matrix: 1 where rows_of(row index) == cols_of(column index) (indices >= 0: lax.div
    is their floor division, which Mosaic lowers without asking the chip)."""
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    c = lax.broadcasted_iota(jnp.int32, shape, 1)
    return (rows_of(r) == cols_of(c)).astype(jnp.float32)


def _spread(rows, u: int, per_group: int):
    """Group rows [n, 16] (n groups of the tile) -> [U, 64]: step a, lane l gets row a // per_group's
    entry l // 4."""
    lanes = _dot(rows, _pick((ROWS, LANES), lambda r: r, lambda c: lax.div(c, 4)))       # [n, 64]
    if rows.shape[0] == 1:
        return jnp.broadcast_to(lanes, (u, LANES))
    return _dot(_pick((u, rows.shape[0]), lambda a: lax.div(a, per_group), lambda j: j), lanes)


def _kernel(layer_ref, x_ref, w_ref, s_ref, *rest, params: QuantParams, bm: int, u: int, groups: int,
            symmetric: bool):
    del layer_ref
    m_ref, o_ref, acc_ref = (None, *rest) if symmetric else rest
    k = pl.program_id(2)
    g0 = lax.div(k * u, params.per_group)   # lax.div: Mosaic lowers no floor division's sign
    T = w_ref.shape[0]

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for t in range(T):
        s = _spread(s_ref[t, pl.ds(g0, groups), :], u, params.per_group)
        mn = None if symmetric else _spread(m_ref[t, pl.ds(g0, groups), :], u, params.per_group)
        total = acc_ref[t]
        for h, q in enumerate(widen(w_ref[t], params.bits, symmetric)):         # int4: high nibbles are phases 4..7
            w = rounded(q * s if symmetric else q * s + mn, params)
            total = total + _dot(x_ref[4 * h:4 * h + 4].reshape(4 * bm, u), w)
        acc_ref[t] = total

    @pl.when(k == pl.num_programs(2) - 1)
    def _done():
        for t in range(T):
            sums = acc_ref[t]
            o_ref[t] = sum(_dot(sums[c * bm:(c + 1) * bm], _pick((LANES, ROWS), lambda l: l, lambda r, c=c: 4 * r + c))
                           for c in range(4))


def _tiles(params: QuantParams, m: int, k: int, nb: int) -> tuple[int, int, int]:
    """(BM rows, T row blocks, U steps) per program: U the whole row up to WHOLE_K steps, else a
    multiple of 128 (Mosaic's lane tiles) lying in one group or covering whole groups."""
    bm = min(128, padded_rows(m, 8))
    t = next(t for t in (8, 4, 2, 1) if nb % t == 0)
    ka = k // params.unit
    u = ka
    if ka > WHOLE_K:
        step = steps(params, k, WHOLE_K)
        u = step if step % 128 == 0 else ka
    return bm, t, u


def quant_linear(x, qweight, scale, min_, layer, *, params: QuantParams, interpret: bool = False,
                 picked: bool = False):
    """The composite's operands (QUANT_LINEAR_V2: x f32[M, K], qweight [L, N/16, 16 K | 8 K], scale and
    min [L, N/16, K/group, 16] or min f32[0], layer s32[]) -> f32[M, N]. `picked`: scale and min are
    the layer's already, a stack of one (version 5's decoded headers)."""
    M, K = x.shape
    L, NB = qweight.shape[:2]
    G = scale.shape[2]
    symmetric = min_.size == 0
    bm, T, u = _tiles(params, M, K, NB)
    ka = K // params.unit
    mp = padded_rows(M, bm)
    at = layer_of(layer, L)
    picked = [(a[0] if picked else lax.dynamic_index_in_dim(a, at[0], 0, False)).astype(jnp.float32)
              for a in ((scale,) if symmetric else (scale, min_))]           # [N/16, G, 16] f32
    groups = max(1, u // params.per_group)
    scale_spec = pl.BlockSpec((T, G, ROWS), lambda i, j, k, layer: (j, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(mp // bm, NB // T, ka // u),
        in_specs=[pl.BlockSpec((params.unit, bm, u), lambda i, j, k, layer: (0, i, k)),
                  pl.BlockSpec((None, T, u, LANES), lambda i, j, k, layer: (layer[0], j, k, 0)),
                  *[scale_spec] * len(picked)],
        out_specs=pl.BlockSpec((T, bm, ROWS), lambda i, j, k, layer: (j, i, 0)),
        scratch_shapes=[pltpu.VMEM((T, 4 * bm, LANES), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_kernel, params=params, bm=bm, u=u, groups=groups, symmetric=symmetric),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NB, mp, ROWS), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="hloserve_quant_linear",
    )(at, phases(x, params, mp), qweight.reshape(L, NB, ka, LANES), *picked)
    return out.transpose(1, 0, 2).reshape(mp, NB * ROWS)[:M]


def kquant16_linear(x, qweight, blocks, layer, *, params: KQuantParams, interpret: bool = False):
    """Version 5 (QUANT_LINEAR_V5: qweight interleaved as version 2's, blocks u8 [L, N, K/256 * H]) on
    version 2's kernel, the layer's headers decoded in the graph (quant.kquant16_operands)."""
    scale, mins, p = kquant16_operands(blocks, layer, params)
    return quant_linear(x, qweight, scale, mins, layer, params=p, interpret=interpret, picked=True)


def _spread_bytes(rows, group_bytes: int, width: int):
    """Scale (or min) rows [TN, width / group_bytes] -> [TN, width], byte b taking its sub-block's
    entry: a product with a 0/1 matrix (exact: one nonzero term)."""
    return _dot(rows, _pick((rows.shape[1], width), lambda j: j, lambda b: lax.div(b, group_bytes)))


def _kquant_kernel(layer_ref, x_ref, w_ref, s_ref, *rest, params: KQuantParams):
    del layer_ref
    m_ref, o_ref, acc_ref = rest if params.has_min else (None, *rest)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = w_ref[...]                                                       # [TN, TB]
    width = q.shape[1]
    scale = _spread_bytes(s_ref[...], params.group_bytes, width)
    low = None if m_ref is None else _spread_bytes(m_ref[...], params.group_bytes, width)
    total = acc_ref[...]
    for p, qp in enumerate(widen(q, params.bits, signed=False)):
        total = total + weights_nt(x_ref[p], qp * scale if low is None else qp * scale + low)
    acc_ref[...] = total

    @pl.when(k == pl.num_programs(2) - 1)
    def _done():
        o_ref[...] = acc_ref[...]


def _kquant_tiles(params: KQuantParams, m: int, n: int, kb: int) -> tuple[int, int, int]:
    """(BM rows, TN matrix rows, TB bytes) per program: TB the whole row up to KQ_BYTES (or where no
    multiple of 128 scale lanes divides it), else the largest such multiple up to KQ_BYTES (at least
    one); TN 256 or 128 where they divide N, else the whole N."""
    bm = min(128, padded_rows(m, 8))
    tn = next((t for t in (256, 128) if n % t == 0), n)
    lanes = 128 * params.group_bytes                                     # TB whose scale blocks are whole lane tiles
    tb = kb
    if kb > KQ_BYTES and kb % lanes == 0:
        tb = max([t for t in range(lanes, KQ_BYTES + 1, lanes) if kb % t == 0], default=lanes)
    return bm, tn, tb


def kquant_linear(x, qweight, blocks, layer, *, params: KQuantParams, interpret: bool = False):
    """The composite's operands (QUANT_LINEAR_V3: x f32[M, K], qweight [L, N, K/2] u8 (Q4_K) or [L, N, K]
    s8, blocks u8 [L, N, K/256 * H], layer s32[]) -> f32[M, N]."""
    M, K = x.shape
    L, N, KB = qweight.shape
    bm, tn, tb = _kquant_tiles(params, M, N, KB)
    mp = padded_rows(M, bm)
    at = layer_of(layer, L)
    scale, low = kquant_scales(blocks, layer, params)                    # [N, K / group] f32
    rows = (scale,) if low is None else (scale, low)
    g = tb // params.group_bytes
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(mp // bm, N // tn, KB // tb),
        in_specs=[pl.BlockSpec((params.unit, bm, tb), lambda i, j, k, layer: (0, i, k)),
                  pl.BlockSpec((None, tn, tb), lambda i, j, k, layer: (layer[0], j, k)),
                  *[pl.BlockSpec((tn, g), lambda i, j, k, layer: (j, k))] * len(rows)],
        out_specs=pl.BlockSpec((bm, tn), lambda i, j, k, layer: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, tn), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_kquant_kernel, params=params),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((mp, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="hloserve_kquant_linear",
    )(at, phases(x, params, mp), qweight, *rows)
    return out[:M]


def _fifth_bits(masks, step: int, high: int):
    """A tile's mask bytes f32 [B, 64] -> 16 x each lane's fifth bit for k-step `step`'s low (high 0)
    or high (1) nibbles, f32 [B, 64]: lane l's byte is 16 step + 8 high + l // 8, its bit l % 8."""
    spread = _pick((LANES, LANES), lambda j: j, lambda l: 16 * step + 8 * high + lax.div(l, 8))
    byte = _dot(masks, spread).astype(jnp.int32)                        # exact: one nonzero term
    lane = lax.broadcasted_iota(jnp.int32, byte.shape, 1)
    return (lax.shift_right_logical(byte, lane & 7) & 1).astype(jnp.float32) * 16.0


def _five_kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, acc_ref, *, bm: int, b: int):
    del layer_ref
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for t in range(w_ref.shape[0]):
        scale = _dot(s_ref[t], _pick((ROWS, LANES), lambda r: r, lambda c: lax.div(c, 4)))   # [B, 64]: block, lane
        masks = w_ref[t, :, 4, :].astype(jnp.int32).astype(jnp.float32)                      # [B, 64]
        total = acc_ref[t]
        for s in range(4):
            for h, q in enumerate(widen(w_ref[t, :, s, :], 4, signed=False)):   # codes' low 4 bits: phases h * 4 + c
                w = (q + _fifth_bits(masks, s, h) - 16.0) * scale
                total = total + _dot(x_ref[4 * h:4 * h + 4, s].reshape(4 * bm, b), w)
        acc_ref[t] = total

    @pl.when(k == pl.num_programs(2) - 1)
    def _done():
        for t in range(w_ref.shape[0]):
            sums = acc_ref[t]
            o_ref[t] = sum(_dot(sums[c * bm:(c + 1) * bm], _pick((LANES, ROWS), lambda l: l, lambda r, c=c: 4 * r + c))
                           for c in range(4))


def five_linear(x, qweight, scale, min_, layer, *, params: QuantParams, interpret: bool = False):
    """The composite's operands (QUANT_LINEAR_V4: x f32[M, K], qweight u8 [L, N/16, 10 K], scale
    [L, N/16, K/32, 16], min f32[0], layer s32[]) -> f32[M, N]."""
    del min_, params
    M, K = x.shape
    L, NB = qweight.shape[:2]
    nblk = K // 32
    bm = min(128, padded_rows(M, 8))
    T = next(t for t in (8, 4, 2, 1) if NB % t == 0)
    b = FIVE_BLOCKS if nblk > FIVE_BLOCKS and nblk % FIVE_BLOCKS == 0 else nblk
    mp = padded_rows(M, bm)
    at = layer_of(layer, L)
    picked = lax.dynamic_index_in_dim(scale, at[0], 0, False).astype(jnp.float32)   # [N/16, K/32, 16]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(mp // bm, NB // T, nblk // b),
        in_specs=[pl.BlockSpec((8, 4, bm, b), lambda i, j, k, layer: (0, 0, i, k)),
                  pl.BlockSpec((None, T, b, 5, LANES), lambda i, j, k, layer: (layer[0], j, k, 0, 0)),
                  pl.BlockSpec((T, b, ROWS), lambda i, j, k, layer: (j, k, 0))],
        out_specs=pl.BlockSpec((T, bm, ROWS), lambda i, j, k, layer: (j, i, 0)),
        scratch_shapes=[pltpu.VMEM((T, 4 * bm, LANES), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_five_kernel, bm=bm, b=b),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NB, mp, ROWS), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="hloserve_five_linear",
    )(at, five_phases(x, mp), qweight.reshape(L, NB, nblk, 5, LANES), picked)
    return out.transpose(1, 0, 2).reshape(mp, NB * ROWS)[:M]
