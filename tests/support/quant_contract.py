"""What a torch reference of `hloserve.quant_linear` version 6 emulates on this machine.

Version 6 multiplies calls of `bf16_rows` rows and more (the exporter writes 64) as bf16 products
of x and the dequantized weights, fewer rows as version 2 (x quantized per 32-element block); a
platform may raise bf16_rows, and the CPU kernels do where the CPU has no AMX
(runtime/kernels/cpu/targets.py: there version 2's integer product is the faster at every row
count). A test comparing a step against an eager reference asks here which arithmetic that step's
row count gets.
"""
from __future__ import annotations


def step_rows(rows: int) -> int:
    """The step size to give `quantization.modules.as_step_of` for a step of `rows` rows: `rows`, or 0
    (version 2's product) where this machine's CPU kernels raise bf16_rows past it."""
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V6
    from hloserve.runtime.kernels.cpu import build
    from hloserve.runtime.kernels.cpu.targets import TARGETS
    if build.library() is None:          # the decompositions: the artifact's bf16_rows
        return rows
    raised = TARGETS[QUANT_LINEAR_V6.key].attributes_for(build.cpu(), {}).get("bf16_rows", 0)
    return 0 if raised > rows else rows
