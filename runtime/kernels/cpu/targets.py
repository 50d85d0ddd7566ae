"""The CPU kernels' table: one row per composite (name, version) they serve.

Adding a CPU kernel = its .cc file here (or a handler in its composite's file) + one row below.
A row names the FFI symbol, which attributes the kernel accepts (the others run the
decomposition), up to how many rows it beats XLA on this CPU (above it the decomposition runs)
and where a result's dims come from when they are not the first operand's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hloserve.runtime.artifact.kernels import (GROUPED_EXPERTS, LAYER_LINEAR, PAGED_ATTENTION, PAGED_ATTENTION_V2,
                                               PRODUCT_SUM, QUANT_EXPERTS, ROW_SUM, QUANT_LINEAR, QUANT_LINEAR_V2,
                                               QUANT_LINEAR_V3, QUANT_LINEAR_V4, QUANT_LINEAR_V5,
                                               QUANT_LINEAR_V6)


@dataclasses.dataclass(frozen=True)
class Cpu:
    """What a row's limits depend on: the code was built for this CPU (-march=native) and its flags."""
    native: bool
    flags: frozenset[str]

    def has(self, flag: str) -> bool:
        return self.native and flag in self.flags


@dataclasses.dataclass(frozen=True)
class Target:
    symbol: str                                        # the XLA_FFI_DEFINE_HANDLER_SYMBOL name
    accepts: Callable[[dict[str, Any]], bool] = lambda attrs: True
    max_rows: Callable[[Cpu], int | None] = lambda cpu: None   # None: every row count
    result_dims: tuple | None = None                   # (operand, dim) per result dim; None: the first operand's
    # where the limit depends on the call too (attributes, operand shapes: a symbolic dim is None): used
    # instead of max_rows
    max_rows_for: Callable[[Cpu, dict[str, Any], tuple], int | None] | None = None
    # attribute values the kernel's call gets on this CPU instead of the artifact's, where the contract
    # leaves a choice to the platform ({}: the artifact's)
    attributes_for: Callable[[Cpu, dict[str, Any]], dict[str, int]] = lambda cpu, attrs: {}

    def limit(self, cpu: Cpu, attrs: dict[str, Any], shapes: tuple) -> int | None:
        """Up to how many rows this call runs the kernel (None: every row count)."""
        return self.max_rows(cpu) if self.max_rows_for is None else self.max_rows_for(cpu, attrs, shapes)


def _whole_vectors(attrs: dict[str, Any]) -> bool:
    return attrs["group"] % 32 == 0


def _whole_expert_groups(attrs: dict[str, Any]) -> bool:
    return attrs["gate_up_group"] % 32 == 0 and attrs["down_group"] % 32 == 0


# layer_linear reads each weight once where XLA's dot copies and packs the layer, which pays off
# once enough rows share the packed copy. Measured (AMD EPYC, AVX512-BF16, docs/performance.md):
# the kernel is 2.8x faster at 1 row, 1.3x at 32, even from 128 on. With AMX (bf16 matrices; a
# Sapphire Rapids Xeon, 2 cores, 2026-11-29, later, docs/performance.md "AMX tiles on whole lines",
# benchmarks/layer_linear.py; medians, kernel / XLA's dot, two runs): with its tiles on whole
# 64-byte lines the kernel is the faster on every shape measured (SmolLM2-135M's, a 1B Llama's) at
# 128-512 rows in both runs (1.0-3.3x); at 1,024-2,048 rows some shape goes to XLA's dot in each
# run (576 x 576 0.93x, 512 x 2048 0.84x, 1536 x 576 0.78x, 2048 x 2048 0.78x), so smaller
# matrices stop at 512 rows. On matrices of 8M elements and more (a 1B Llama's MLP: 8192 x 2048,
# 2048 x 8192) it is 1.15-3.3x faster at every row count from 128 to 2,048, so it runs every row
# count there. Without AVX512-BF16 it widens
# the products to f32: with AVX-512 in 4 x 4 tiles, 1.4-2.5x XLA's dot from 8 to 32 rows and slower
# from 48 (SmolLM2 MLP shape, Xeon without AVX512-BF16, 2026-11-28, docs/performance.md); with AVX2
# only one output at a time, so only decode-sized row counts stay with it (a stack laid out as B tiles
# runs every row count on AVX2 too: layouts.b_tiles_read, docs/performance.md "AVX2 only").
_AMX_EVERY_ROW_COUNT = 8 << 20     # matrix elements from which AMX runs every row count
_AMX_ROWS = 512                    # the limit below that


def _layer_linear_rows(cpu: Cpu, attrs: dict[str, Any], shapes: tuple) -> int | None:
    if cpu.has("amx_bf16") and attrs.get("holds") == 1:
        _, n, k = shapes[1]
        return None if n is not None and k is not None and n * k >= _AMX_EVERY_ROW_COUNT else _AMX_ROWS
    if cpu.has("avx512_bf16"):
        return 64
    return 32 if cpu.has("avx512f") and cpu.has("avx512bw") else 4


# int8 x int8 (VNNI) against XLA dequantizing the layer to f32 for its dot: the kernel is the faster
# to 64 rows and even at 256 (1B Llama MLP shape, 2026-11-25, docs/quantization.md); the portable
# integer loop only at decode-sized row counts
def _quant_linear_rows(cpu: Cpu) -> int:
    return 64 if cpu.has("avx512_vnni") else 4


# 16 interleaved rows per vpdpbusd: 4-5x XLA's dequantize-then-dot at 256 rows and more
# (docs/quantization.md, "Version 2"), so every row count runs it; with AMX-INT8 the kernel itself
# hands its tiles of 16 rows (int8 from 12 rows, int4 from 16) to tdpbssd (Xeon with AMX,
# 2026-11-29, docs/quantization.md "AMX-INT8 tiles")
def _quant_linear_v2_rows(cpu: Cpu) -> int | None:
    return None if cpu.has("avx512_vnni") else 4


# Versions 2, 4 and 6 (int8, 5-bit and int4) and 5 (K-quants interleaved): with AVX2 the tiles'
# product by vpmaddubsw / vpmaddwd (quant_linear.cc quant2_avx2, quant_blocks.cc kquant_tile_avx2,
# the VNNI path's integer sums) at every row count too (docs/performance.md, "AVX2 only")
def _quant2_rows(cpu: Cpu) -> int | None:
    return None if cpu.has("avx512_vnni") or cpu.has("avx2") else 4


# Version 6's prompt chunks (bf16_rows rows and more) are bf16 products of x and the dequantized
# matrix: on AMX the bf16 tiles beat version 2's int8 tiles, which rescale every 32-element block
# (256-token chunk 0.97x bf16's time against version 2's 1.33x; Xeon, 2026-12-01). Without AMX it is
# the other way round: vpdpbusd does twice vdpbf16ps's products, and the chunks' bf16 path (each group
# dequantized into rows for linear.h's row routines) took 1.41x bf16's time for the default model's
# 256-token chunk where version 2's product took 0.77x (int4: 1.25x and 0.81x; AMD EPYC, 2026-12-02,
# docs/quantization.md), so there the kernel computes version 2's product at every row count, as the
# contract allows.
_NEVER = (1 << 63) - 1


# Without VNNI or AVX2 the kernel runs only decode-sized row counts (_quant2_rows), the decomposition
# the chunks, with the artifact's bf16_rows: raising it there would make the kernel's rows and the
# decomposition's disagree about which product a call of that many rows gets.
def _quant_linear_v6_attributes(cpu: Cpu, attrs: dict[str, Any]) -> dict[str, int]:
    return {} if cpu.has("amx_bf16") or _quant2_rows(cpu) is not None else {"bf16_rows": _NEVER}


# layer_linear over a stack the runtime laid out as B tiles at load (layouts.py, linear.cc): every row
# count, since nothing else can read that layout
LAYER_LINEAR_TILES = "hloserve_layer_linear_tiles"
# grouped_experts over gate_up and down stacks laid out as B tiles (experts.cc): likewise every row count
GROUPED_EXPERTS_TILES = "hloserve_grouped_experts_tiles"

TARGETS = {
    PAGED_ATTENTION.key: Target("hloserve_paged_attention"),
    PAGED_ATTENTION_V2.key: Target("hloserve_paged_attention_v2"),
    LAYER_LINEAR.key: Target("hloserve_layer_linear", max_rows_for=_layer_linear_rows, result_dims=((0, 0), (1, 1))),
    QUANT_LINEAR.key: Target("hloserve_quant_linear", accepts=_whole_vectors, max_rows=_quant_linear_rows,
                             result_dims=((0, 0), (1, 1))),
    QUANT_LINEAR_V2.key: Target("hloserve_quant_linear_v2", accepts=_whole_vectors, max_rows=_quant2_rows,
                                result_dims=((0, 0), None)),
    # version 2's below bf16_rows rows; chunks in bf16 on AMX-BF16 tiles (elsewhere version 2's product)
    QUANT_LINEAR_V6.key: Target("hloserve_quant_linear_v6", accepts=_whole_vectors, max_rows=_quant2_rows,
                                result_dims=((0, 0), None), attributes_for=_quant_linear_v6_attributes),
    # 5-bit values (GGUF Q5_0 kept): version 2's int4 tiles with the fifth bits or'd in by mask (no AMX
    # tiles yet: VNNI, or AVX2's steps, at every row count)
    QUANT_LINEAR_V4.key: Target("hloserve_quant_linear_v4", accepts=_whole_vectors, max_rows=_quant2_rows,
                                result_dims=((0, 0), None)),
    # K-quant blocks: 16 rows at a time copied interleaved per call, then version 2's VNNI tiles
    # (quant_blocks.cc), so version 2's rows: every row count with VNNI (a 256-token prompt chunk of
    # SmolLM2's Q4_K_M: 259 ms against 546 with its 30 down matrices dequantized for XLA's dot above
    # 64 rows, docs/performance.md 2026-11-29, later); version 1's row loops without VNNI
    QUANT_LINEAR_V3.key: Target("hloserve_quant_linear_v3", max_rows=_quant_linear_v2_rows, result_dims=((0, 0), (1, 1))),
    # the same with the quants interleaved at export: the tiles at every row count, no per-call copy
    # (with AVX2 too: kquant_tile_avx2)
    QUANT_LINEAR_V5.key: Target("hloserve_quant_linear_v5", max_rows=_quant2_rows, result_dims=((0, 0), None)),
    # every row count: the kernel computes T k rows' products where the decomposition computes T per
    # expert taken (up to E/k times as many), reading each matrix once either way
    GROUPED_EXPERTS.key: Target("hloserve_grouped_experts"),
    # the same grouping over int8 / int4 stacks, each product quant_linear version 1's row routines
    QUANT_EXPERTS.key: Target("hloserve_quant_experts", accepts=_whole_expert_groups),
    # not for speed: XLA fuses one of the two products into a multiply-add, which one depending on the
    # shapes (exporter/composites/product_sum.py); the kernel rounds both, at every size
    PRODUCT_SUM.key: Target("hloserve_product_sum"),
    # not for speed either: XLA's row reduce sums in another order from 8 rows up (half the rows of
    # [T, 576] came out differently at T = 8 than at T = 1); the kernel sums a row one way at every T
    ROW_SUM.key: Target("hloserve_row_sum", result_dims=((0, 0),)),
}

# every FFI symbol the library defines (build.py registers them)
SYMBOLS = (*(t.symbol for t in TARGETS.values()), LAYER_LINEAR_TILES, GROUPED_EXPERTS_TILES)
