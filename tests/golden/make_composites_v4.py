"""Writes tests/golden/composites_v4/: a stored module of quant_linear version 4 (5-bit values, GGUF
Q5_0 kept: version 2's int4 nibbles with each block's fifth bits beside), its inputs and what its
decomposition computed when written, as make_composites_v1.py does for version 1. Run once, on
2026-12-01 (jax 0.10.2); never regenerate silently: a composite whose meaning changes gets a new
version.

    python -m tests.golden.make_composites_v4
"""
from __future__ import annotations

import os

import numpy as np

from tests.golden.make_composites_v1 import write
from tests.runtime.test_kernels import _quant_exported, five_bit_stack

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v4")


def cases(rng):
    """name -> (jax.export.Exported, inputs)."""
    _, _, qw, sc = five_bit_stack(rng, 3, 48, 96)
    mn = np.zeros((0,), np.float32)
    return {"quant_linear_int5_g32": (_quant_exported({"qweight": qw, "scale": sc, "min": mn}, 5, 32, 4),
                                      [rng.standard_normal((5, 96)).astype(np.float32), qw, sc, mn, np.int32(2)])}


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
