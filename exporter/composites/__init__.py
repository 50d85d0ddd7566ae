"""The composites' export side, one module per composite: its torch op(s) with their fakes and eager
references, its portable decomposition in jax, and the lowering that wraps the decomposition in a
`stablehlo.composite` (the contract: runtime/artifact/kernels.py; the kernels: runtime/kernels/).

    paged_attention   hloserve.paged_attention v1, v2 (+ hloserve::gather_blocks)
    layer_linear      hloserve.layer_linear v1 (+ hloserve::mixed_linear)
    quant_linear      hloserve.quant_linear v1, v2 (its torch op lives in quantization/modules.py)
    grouped_experts   hloserve.grouped_experts v1 (a mixture-of-experts layer's experts)
    quant_experts     hloserve.quant_experts v1 (the same over int8 / int4 stacks)
    product_sum       hloserve.product_sum v1 (a*b + c*d, both products rounded: emitted by the
                      lowering of aten.add / aten.sub, exporter/lowerings/elementwise.py; no torch op)
    row_sum           hloserve.row_sum v1 (each row's sum in one order at any row count: emitted by
                      the reductions' lowerings in a batch-invariant export; no torch op)

Adding a composite: a module here, its contract in runtime/artifact/kernels.py, and its row in
MODULES below (the registry collects the lowerings from it); a kernel is then one module per
platform under runtime/kernels/ plus one row in its backend's table (docs/architecture.md).
"""
from __future__ import annotations

from . import grouped_experts, layer_linear, paged_attention, quant_experts, quant_linear

MODULES = (paged_attention, layer_linear, quant_linear, grouped_experts, quant_experts)
