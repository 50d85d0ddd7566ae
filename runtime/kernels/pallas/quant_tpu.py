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
Runs in Pallas interpret mode on any platform (`interpret=True`, the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .quant import ROWS, QuantParams, layer_of, padded_rows, phases, steps

NAME = "pallas_tpu.quant_linear"
LANES = 4 * ROWS    # bytes of one step of `a` in a 16-row block
WHOLE_K = 512       # steps of `a` up to which one tile takes the whole row (else tiles of 128 lanes' multiples)


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


def _widen(b, params: QuantParams, symmetric: bool):
    """Stored bytes -> their f32 values: int8 as they are, int4 as (low, high) nibbles."""
    v = b.astype(jnp.int32)
    if params.bits == 8:
        return (v.astype(jnp.float32),)
    lo, hi = v & 15, (v >> 4) & 15
    if symmetric:   # two's complement nibbles
        lo, hi = jnp.where(lo >= 8, lo - 16, lo), jnp.where(hi >= 8, hi - 16, hi)
    return lo.astype(jnp.float32), hi.astype(jnp.float32)


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
        for h, q in enumerate(_widen(w_ref[t], params, symmetric)):         # int4: high nibbles are phases 4..7
            w = q * s if symmetric else q * s + mn
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


def quant_linear(x, qweight, scale, min_, layer, *, params: QuantParams, interpret: bool = False):
    """The composite's operands (QUANT_LINEAR_V2: x f32[M, K], qweight [L, N/16, 16 K | 8 K], scale and
    min [L, N/16, K/group, 16] or min f32[0], layer s32[]) -> f32[M, N]."""
    M, K = x.shape
    L, NB = qweight.shape[:2]
    G = scale.shape[2]
    symmetric = min_.size == 0
    bm, T, u = _tiles(params, M, K, NB)
    ka = K // params.unit
    mp = padded_rows(M, bm)
    at = layer_of(layer, L)
    picked = [lax.dynamic_index_in_dim(a, at[0], 0, False).astype(jnp.float32)
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
