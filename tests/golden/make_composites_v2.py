"""Writes tests/golden/composites_v2/: a stored module of each composite version 2 (paged attention
with the window an operand), its inputs and what its decomposition computed when written, as
make_composites_v1.py does for version 1. Run once, on 2026-11-26 (jax 0.10.2); never regenerate
silently: a composite whose meaning changes gets a new version.

    python -m tests.golden.make_composites_v2
"""
from __future__ import annotations

import os

import numpy as np

from tests.golden.make_composites_v1 import write
from tests.runtime.test_kernels import _case, _exported_v2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v2")


def cases(rng):
    """name -> (jax.export.Exported, inputs): the window is the last input."""
    out = {}
    args, _ = _case(rng, 2, 64, 1, chunk=True)                     # bf16 cache, decode rows and a 37-token chunk
    out["paged_attention_window_bf16"] = (_exported_v2(args, 1), [*args, np.int32(16)])
    args, _ = _case(rng, 2, 64, 0)                                  # f32 cache, no window (0), soft-capping
    out["paged_attention_nowindow_softcap"] = (_exported_v2(args, 0, softcap=30.0), [*args, np.int32(0)])
    return out


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
