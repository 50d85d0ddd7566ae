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
with the sums in lanes, 0.58x the row routines' time for the default model's linears at 16 rows. A mixture of experts' gate_up and down stacks
[L, E, N, K] go the same way, each expert's matrix as a layer, for `hloserve_grouped_experts_tiles`
(experts.cc: AMX tiles for every expert with rows, where grouped_experts leaves experts of fewer
than 16 rows to its row routines, whose sums run in another order).
"""
from __future__ import annotations

import numpy as np

from ..backend import WeightLayout


def _b_tiles(w: np.ndarray) -> np.ndarray:
    """[..., N, K] -> a view whose C order is the B-tile layout, [..., t, c, r, n] = the 32-bit pair of
    w[..., 16 t + n, 32 c + 2 r : 32 c + 2 r + 2] (as int32 pairs: numpy copies 4-byte elements about 10x
    faster than 2-byte ones out of this transpose)."""
    *lead, N, K = w.shape
    d = len(lead)
    return (w.view(np.int32).reshape(*lead, N // 16, 16, K // 32, 16)
            .transpose(*range(d), d, d + 2, d + 3, d + 1))


B_TILES = WeightLayout("amx_b_tiles", _b_tiles)


def b_tiles_fit(shape) -> bool:
    """Whether a stack of this shape ([L, N, K] layers or [L, E, N, K] experts) is laid out as B tiles:
    N a multiple of 16 and K of 32. Measured (docs/performance.md, "The matrices laid out as B tiles at
    load" and its sequel of 2026-12-02): steps faster for the SmolLM2-135M, Qwen3-0.6B, Gemma-3-1B and
    (once decode rows prefetched their tiles, linear.h's kDecodeAhead) Llama-3.2-1B shapes."""
    return (len(shape) in (3, 4) and all(isinstance(d, int) for d in shape)
            and shape[-2] % 16 == 0 and shape[-1] % 32 == 0)
