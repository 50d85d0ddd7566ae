"""Writes tests/golden/composites_v2/: a stored module of each composite version 2 (paged attention
with the window an operand; quant_linear with its matrix interleaved by 16 rows), its inputs and
what its decomposition computed when written, as make_composites_v1.py does for version 1. Run
once, on 2026-11-26 (jax 0.10.2); never regenerate silently: a composite whose meaning changes
gets a new version.

    python -m tests.golden.make_composites_v2
"""
from __future__ import annotations

import os

import numpy as np

from tests.golden.make_composites_v1 import write
from hloserve.quantization import primitives
from tests.runtime.test_kernels import _case, _exported_v2, _quant_exported, _quantized_stack

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v2")


def cases(rng):
    """name -> (jax.export.Exported, inputs): the window is the last input."""
    out = {}
    args, _ = _case(rng, 2, 64, 1, chunk=True)                     # bf16 cache, decode rows and a 37-token chunk
    out["paged_attention_window_bf16"] = (_exported_v2(args, 1), [*args, np.int32(16)])
    args, _ = _case(rng, 2, 64, 0)                                  # f32 cache, no window (0), soft-capping
    out["paged_attention_nowindow_softcap"] = (_exported_v2(args, 0, softcap=30.0), [*args, np.int32(0)])
    for spec in ("int8", "int4:32"):                                # quant_linear v2: 16 interleaved rows
        q, scheme, group = _quantized_stack(rng, spec, 3, 48, 64)
        qw, sc, mn = primitives.interleave_rows(q["qweight"], q["scale"], q["min"] if q["min"].size else None, scheme.bits)
        mn = q["min"] if mn is None else mn
        out[f"quant_linear_{spec.replace(':', '_g')}"] = (
            _quant_exported({"qweight": qw, "scale": sc, "min": mn}, scheme.bits, group, 2),
            [rng.standard_normal((5, 64)).astype(np.float32), qw, sc, mn, np.int32(1)])
    return out


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
