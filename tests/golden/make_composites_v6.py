"""Writes tests/golden/composites_v6/: stored modules of quant_linear version 6 (version 2's layout;
from bf16_rows rows x and the dequantized weights rounded to bf16), their inputs and what their
decomposition computed when written, as make_composites_v1.py does for version 1: an int8 (group 32)
and an asymmetric int4 stack, each called below bf16_rows (5 rows: version 2's product) and at it and
past it (70 rows: the bf16 product). Run once, on 2026-12-01 (jax 0.10.2); never regenerate silently:
a composite whose meaning changes gets a new version.

    python -m tests.golden.make_composites_v6
"""
from __future__ import annotations

import os

import numpy as np

from hloserve.quantization import primitives
from tests.golden.make_composites_v1 import write
from tests.runtime.test_kernels import _quant_exported, _quantized_stack

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v6")


def cases(rng):
    """name -> (jax.export.Exported, inputs)."""
    out = {}
    for spec in ("int8", "int4:32"):
        q, scheme, group = _quantized_stack(rng, spec, 3, 48, 96)
        qw, sc, mn = primitives.interleave_rows(q["qweight"], q["scale"], q["min"] if q["min"].size else None,
                                                scheme.bits)
        mn = q["min"] if mn is None else mn
        exp = _quant_exported({"qweight": qw, "scale": sc, "min": mn}, scheme.bits, group, 6, bf16_rows=64)
        for rows in (5, 70):
            name = f"quant_linear_{spec.replace(':', '_g')}_{rows}rows"
            out[name] = (exp, [rng.standard_normal((rows, 96)).astype(np.float32), qw, sc, mn, np.int32(2)])
    return out


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
