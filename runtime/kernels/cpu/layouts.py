"""Weights the CPU kernels read in a layout of their own, laid out once at load.

    layout = B_TILES                                   # a WeightLayout (runtime/kernels/backend.py)
    packed = np.ascontiguousarray(layout.arrange(view)).view(view.dtype).reshape(view.shape)

`B_TILES`: a bf16 stack [L, N, K] (N a multiple of 16, K of 32) as AMX's tile multiply takes its B
operand, for `hloserve_layer_linear_tiles` (linear.cc): per layer, matrix tile t (rows 16t..16t + 15)
and chunk c (elements 32c..32c + 31) as one 1 KiB tile whose row r holds, for each row 16t + n of the
tile, elements 32c + 2r and 32c + 2r + 1. The kernel then reads each tile as it lies, for a decode
row as for a prompt chunk; layer_linear's kernel takes the matrix as the A operand, reads it in
place for decode rows but copies a chunk's rows into tiles on every call and transposes its sums
back (docs/performance.md, "The matrices laid out as B tiles at load"). The same products are
summed in the same order either way: the same bits. Without AMX (AVX512-BF16), a tile row is what
one vdpbf16ps multiplies against a broadcast pair of x (linear.h's b_tiles_pairs): outer products
with the sums in lanes, 0.58x the row routines' time for the default model's linears at 16 rows; with
AVX2 and FMA only, the same outer products widened to f32 (b_tiles_avx2). A mixture of experts' gate_up and down stacks
[L, E, N, K] go the same way, each expert's matrix as a layer, for `hloserve_grouped_experts_tiles`
(experts.cc: AMX tiles for every expert with rows, where grouped_experts leaves experts of fewer
than 16 rows to its row routines, whose sums run in another order). An embedding table [V, H] that an
LM head reads through layer_linear too (tied) goes the same way, and its lookup, a gather of rows,
reads them from the tiles (`tile_row_gather`): the head at 16 decode rows was 13% of a step read in
place (docs/performance.md, "The tied LM head as B tiles").
"""
from __future__ import annotations

import numpy as np

from ..backend import WeightLayout
from ..rewrite import constant, dim_size, element_bits


def _b_tiles(w: np.ndarray) -> np.ndarray:
    """[..., N, K] -> a view whose C order is the B-tile layout, [..., t, c, r, n] = the 32-bit pair of
    w[..., 16 t + n, 32 c + 2 r : 32 c + 2 r + 2] (as int32 pairs: numpy copies 4-byte elements about 10x
    faster than 2-byte ones out of this transpose)."""
    *lead, N, K = w.shape
    d = len(lead)
    return (w.view(np.int32).reshape(*lead, N // 16, 16, K // 32, 16)
            .transpose(*range(d), d, d + 2, d + 3, d + 1))


B_TILES = WeightLayout("amx_b_tiles", _b_tiles)


def row_gather(api, op) -> bool:
    """Whether `op` is a stablehlo.gather of whole rows of a 16-bit matrix [V, H] (an embedding
    lookup: indices [..., 1], the rows' values last), the one form `tile_row_gather` reads B tiles in."""
    ir = api.ir
    if op.operation.name != "stablehlo.gather":
        return False
    table, idx = (ir.RankedTensorType(v.type) for v in op.operands[:2])
    if table.rank != 2 or not table.has_static_shape or not b_tiles_fit((1, *table.shape)):
        return False
    if element_bits(ir, table) != 16:
        return False
    dn = api.hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    r = idx.rank
    return (idx.shape[-1] == 1 and dn.index_vector_dim == r - 1 and list(dn.offset_dims) == [r - 1]
            and list(dn.collapsed_slice_dims) == [0] and list(dn.start_index_map) == [0]
            and not list(dn.operand_batching_dims)
            and list(api.ir.DenseI64ArrayAttr(op.attributes["slice_sizes"])) == [1, table.shape[1]])


def tile_row_gather(api, op):
    """The rows a `row_gather` op takes, read from its matrix laid out as B tiles: row v is, for each
    chunk c and tile row r, the pair [v // 16, c, r, v % 16] (`_b_tiles`), so one gather of the tiles
    viewed as [V/16, H/32, 16, 16, 2] at (v // 16, v % 16) gives its H values in order. The same values
    as the gather of the matrix as the artifact has it, for every index: one outside [0, V) is clamped
    into it first, as the gather clamps its start indices (the step's tokens beyond the vocabulary)."""
    ir, hlo = api.ir, api.hlo
    table, idx = op.operands[:2]
    V, H = ir.RankedTensorType(table.type).shape
    it = ir.RankedTensorType(idx.type)
    r, e = it.rank, it.element_type
    shape = hlo.concatenate([dim_size(api, idx, d) for d in range(r)], 0)     # symbolic or not
    sixteen = hlo.dynamic_broadcast_in_dim(it, constant(api, 16, element=e), shape, [])
    row = hlo.clamp(constant(api, 0, element=e), idx, constant(api, V - 1, element=e))   # as the gather clamps
    at = hlo.concatenate([hlo.divide(row, sixteen), hlo.remainder(row, sixteen)], r - 1)
    elem = ir.RankedTensorType(table.type).element_type
    tiles = hlo.reshape(ir.RankedTensorType.get([V // 16, H // 32, 16, 16, 2], elem), table)
    dn = hlo.GatherDimensionNumbers.get(offset_dims=[r - 1, r, r + 1], collapsed_slice_dims=[0, 3],
                                        operand_batching_dims=[], start_indices_batching_dims=[],
                                        start_index_map=[0, 3], index_vector_dim=r - 1)
    batch = list(it.shape[:-1])
    rows = hlo.gather(tiles, at, dn, [1, H // 32, 16, 1, 2], indices_are_sorted=False,
                      results=[ir.RankedTensorType.get([*batch, H // 32, 16, 2], elem)])
    out = hlo.concatenate([*(dim_size(api, idx, d) for d in range(r - 1)), constant(api, H, (1,))], 0)
    return hlo.dynamic_reshape(op.results[0].type, rows, out).owner


def b_tiles_read(cpu) -> bool:
    """Whether this CPU's kernels (`build.cpu()`) read B tiles faster than the artifact's rows: AMX's
    tile multiply, AVX512-BF16's outer products (linear.h b_tiles_pairs) or, with AVX2 and FMA only,
    the same outer products widened to f32 (b_tiles_avx2: the default model's 16-row decode step 1.86x
    the artifact's layout, whose 16-bit rows run XLA's dot past 4 rows there; docs/performance.md,
    "AVX2 only"). Not on a library built for another -march (cpu.has is then False): b_tiles_portable
    is a correct, slow loop."""
    return cpu.has("amx_bf16") or cpu.has("avx512_bf16") or (cpu.has("avx2") and cpu.has("fma"))


def b_tiles_fit(shape) -> bool:
    """Whether a stack of this shape ([L, N, K] layers or [L, E, N, K] experts) is laid out as B tiles:
    N a multiple of 16 and K of 32. Measured (docs/performance.md, "The matrices laid out as B tiles at
    load" and its sequel of 2026-12-02): steps faster for the SmolLM2-135M, Qwen3-0.6B, Gemma-3-1B and
    (once decode rows prefetched their tiles, linear.h's kDecodeAhead) Llama-3.2-1B shapes."""
    return (len(shape) in (3, 4) and all(isinstance(d, int) for d in shape)
            and shape[-2] % 16 == 0 and shape[-1] % 32 == 0)
