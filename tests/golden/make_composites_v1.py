"""Writes tests/golden/composites_v1/: one stored module per composite (name, version) the CPU kernels
replace, with its inputs and what its decomposition computed when written. Run once, on 2026-11-26
(hloserve after the accelerator kernels, jax 0.10.2); never regenerate silently: a composite whose
meaning changes gets a new version, and the stored v1 modules must keep computing what they did.

    python -m tests.golden.make_composites_v1
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from hloserve.runtime import kernels
from tests.runtime.test_kernels import _case, _exported, _linear_exported, _quant_exported, _quantized_stack

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "composites_v1")


def cases(rng):
    """name -> (jax.export.Exported, inputs)."""
    out = {}
    args, _ = _case(rng, 2, 64, 1, chunk=True)                     # bf16 cache, decode rows and a 37-token chunk
    out["paged_attention_bf16"] = (_exported(args, 0, 1), args)
    args, _ = _case(rng, 2, 64, 0)                                  # f32 cache, sliding window, soft-capping
    out["paged_attention_window_softcap"] = (_exported(args, 16, 0, softcap=30.0), args)
    w = np.asarray(jnp.asarray(rng.standard_normal((3, 40, 64)).astype(np.float32)).astype(jnp.bfloat16)
                   .view(jnp.int16))
    out["layer_linear_bf16"] = (_linear_exported(w, 1), [rng.standard_normal((5, 64)).astype(np.float32), w,
                                                         np.int32(2)])
    for spec in ("int8", "int4:32"):                                # Q8_0's and Q4_1's layouts
        q, scheme, group = _quantized_stack(rng, spec, 3, 40, 64)
        out[f"quant_linear_{spec.replace(':', '_g')}"] = (
            _quant_exported(q, scheme.bits, group),
            [rng.standard_normal((5, 64)).astype(np.float32), q["qweight"], q["scale"], q["min"], np.int32(1)])
    return out


def write(out: str, stored: dict) -> None:
    """Each case's module, inputs and decomposition outputs into directory `out`."""
    os.makedirs(out, exist_ok=True)
    for name, (exp, args) in stored.items():
        portable = kernels.Decompositions().specialize(exp).exported
        want = np.asarray(jax.jit(portable.call)(*args))
        with open(os.path.join(out, f"{name}.jax_exported"), "wb") as f:
            f.write(bytes(exp.serialize()))
        np.savez(os.path.join(out, f"{name}.npz"), want=want, **{f"arg{i}": np.asarray(a) for i, a in enumerate(args)})
        print(name, want.shape)


if __name__ == "__main__":
    write(OUT, cases(np.random.default_rng(0)))
