"""Writes tests/golden/composites_v5/: a stored module of quant_linear version 5 (GGUF K-quant blocks
with their quants interleaved by 16 rows as version 2's, the headers row by row), its inputs and what
its decomposition computed when written, as make_composites_v1.py does for version 1. Run once, on
2026-12-01 (jax 0.10.2); never regenerate silently: a composite whose meaning changes gets a new
version.

    python -m tests.golden.make_composites_v5
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites.quant_linear import quant_linear_v5_reference
from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V5, Block
from tests.golden.make_composites_v1 import write
from tests.runtime.test_kquant_kernels import _stack, interleaved

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v5")


def cases(rng):
    """name -> (jax.export.Exported, inputs): a Q4_K and a Q6_K stack of 3 layers [48, 512]."""
    out = {}
    for kind in ("Q4_K", "Q6_K"):
        q, blocks, _, _ = _stack(kind, 3, 48, 512, rng)
        q16 = interleaved(q, kind)

        def f(x, qweight, blk, layer, kind=kind):
            return _private.composite(quant_linear_v5_reference, QUANT_LINEAR_V5.name, QUANT_LINEAR_V5.version)(
                x, qweight, blk, layer, kind=int(Block[kind]))
        (m,) = export.symbolic_shape("M")
        shapes = [jax.ShapeDtypeStruct((m, 512), np.float32), jax.ShapeDtypeStruct(q16.shape, q16.dtype),
                  jax.ShapeDtypeStruct(blocks.shape, blocks.dtype), jax.ShapeDtypeStruct((), np.int32)]
        exp = export.export(jax.jit(f), platforms=("cpu",))(*shapes)
        out[f"quant_linear_{kind.lower()}"] = (exp, [rng.standard_normal((5, 512)).astype(np.float32), q16, blocks,
                                                     np.int32(2)])
    return out


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
