"""The GPU's `hloserve.layer_linear` kernel (runtime/kernels/pallas/linear_gpu.py) against the
composite's decomposition (exporter/composites/layer_linear.py), in Pallas interpret mode on this
CPU: bf16 and f16 matrices held as int16 bits and as floats, a layer picked from a stack of 3 and a
stack of one; row counts 1, 7, 16 and 64 (the kernel: padded to 16-row tiles) and 65 and 100 (XLA's
dot on the sliced layer); K of 80 (tiles of 16), 256 (one tile) and 2048 (several accumulated),
N of 48 (16-row tiles) and 8192 (32-row tiles). The kernel is also lowered for cuda (Triton) here.

Tolerance: both sides round x to the weights' dtype the same way (to nearest even) and compute the
same products, exact in f32 (8 + 8 or 11 + 11 significant bits), summed in f32 in other orders.
Each sum has K terms; its rounding error is below K * 2^-23 * sum |x16 w| (a loose bound), asserted
element-wise from the operands.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hloserve.exporter.composites.layer_linear import layer_linear_reference
from hloserve.runtime.artifact.kernels import LAYER_LINEAR, Holds
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import linear_gpu


def _operands(m, n, k, layers, holds, bits, seed=0):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(Holds(holds).dtype_name)
    w = jnp.asarray(rng.standard_normal((layers, n, k)).astype(np.float32)).astype(dtype)
    stored = lax.bitcast_convert_type(w, jnp.int16) if bits else w
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, stored, np.asarray(w.astype(jnp.float32)), dtype


def _check(m, n, k, layers, holds, bits, got_fn):
    x, stored, dense, dtype = _operands(m, n, k, layers, holds, bits, seed=m + n + k)
    layer = np.int32(layers - 1)
    want = np.asarray(jax.jit(lambda *a: layer_linear_reference(*a, holds=holds))(x, stored, layer), np.float64)
    got = np.asarray(got_fn(x, stored, layer, dtype), np.float64)
    assert got.shape == (m, n)
    x16 = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
    bound = k * 2.0 ** -23 * (np.abs(x16) @ np.abs(dense[layers - 1].astype(np.float64)).T) + 1e-30
    err = np.abs(got - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}"


def _interpret(x, w, layer, dtype):
    return jax.jit(lambda *a: linear_gpu.layer_linear(*a, dtype=dtype, interpret=True))(x, w, layer)


@pytest.mark.parametrize("m", [1, 7, 16, 64, 65, 100])
@pytest.mark.parametrize("holds,bits", [(1, True), (2, True), (1, False)])
def test_kernel_matches_the_decomposition(m, holds, bits):
    _check(m, 48, 256, 3, holds, bits, _interpret)


@pytest.mark.parametrize("n,k,layers", [(48, 80, 3), (32, 2048, 1), (8192, 32, 2)])
def test_tiles_across_k_and_n(n, k, layers):
    """K in tiles of 16 (80 is no power of two), K in 8 tiles of 256, N in 32-row tiles; a stack of
    one is read at layer 0, as the decomposition reads it."""
    assert linear_gpu.fits(7, n, k)
    _check(7, n, k, layers, 1, True, _interpret)


def test_shapes_the_kernel_leaves_to_xla():
    """N or K off tl.dot's 16 and calls of more than 64 rows take XLA's dot (and still match)."""
    assert not linear_gpu.fits(1, 40, 256) and not linear_gpu.fits(1, 48, 72) and not linear_gpu.fits(65, 48, 256)
    _check(3, 40, 72, 2, 1, True, _interpret)


def test_kernel_lowers_for_cuda():
    """Lowered (not compiled: no GPU here) for cuda: one Triton custom call."""
    from jax import export as jax_export
    fn = jax.jit(lambda x, w, l: linear_gpu.layer_linear(x, w, l, dtype=jnp.bfloat16))
    checks = [jax_export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax_export.export(fn, platforms=("cuda",), disabled_checks=checks)(
        jax.ShapeDtypeStruct((16, 2048), jnp.float32), jax.ShapeDtypeStruct((16, 2048, 2048), jnp.int16),
        jax.ShapeDtypeStruct((), jnp.int32))
    assert exported.mlir_module().count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1


def test_plan_and_switch(monkeypatch):
    """Off by default (unmeasured on a GPU): cuda plans XLA's dot and says how to turn the kernel on;
    with HLOSERVE_GPU_LAYER_LINEAR=1 cuda runs it (its backend serves the composite); TPU never."""
    monkeypatch.delenv(accelerators.LAYER_LINEAR_ENV, raising=False)
    off = accelerators.choose("cuda", LAYER_LINEAR.name, 1, {"holds": 1})
    assert off.kernel is None and f"{accelerators.LAYER_LINEAR_ENV}=1" in off.why
    assert not accelerators.PallasBackend("cuda").runs(LAYER_LINEAR.name, 1)
    monkeypatch.setenv(accelerators.LAYER_LINEAR_ENV, "1")
    p = accelerators.choose("cuda", LAYER_LINEAR.name, 1, {"holds": 1})
    assert p.kernel == linear_gpu.NAME and p.params == {"holds": 1}
    assert accelerators.PallasBackend("cuda").runs(LAYER_LINEAR.name, 1)
    assert accelerators.choose("tpu", LAYER_LINEAR.name, 1, {"holds": 1}).kernel is None
    assert not accelerators.PallasBackend("tpu").runs(LAYER_LINEAR.name, 1)


def test_a_bf16_step_through_the_kernel_in_interpret_mode_matches_the_cpu(tmp_path, monkeypatch):
    """A bf16 tiny Llama's decode step on the cuda path (the kernel for every layer_linear, the LM
    head's included, and Triton's paged attention, in Pallas interpret mode) against the same step on
    the CPU (its C++ kernels): the same contract (x rounded to bf16, exact products, f32 sums), other
    summation orders; logits of magnitude ~1 agree to 1e-4."""
    import torch

    from hloserve.runtime import load
    from hloserve.runtime.model import read_exported
    from hloserve.runtime.kernels.pallas import gpu as pallas_gpu
    from tests.server.conftest import export_tiny_llama
    from tests.server.test_accelerators import _step

    art = export_tiny_llama(tmp_path, "bf16", 256, torch_dtype=torch.bfloat16)[1]
    monkeypatch.setenv(accelerators.LAYER_LINEAR_ENV, "1")
    plans = [p.kernel for p in accelerators.plan(read_exported(art, "decode"), "cuda")]
    assert plans.count(linear_gpu.NAME) >= 5 and pallas_gpu.NAME in plans     # 4 a layer (q/k/v, gate/up fused) + the head
    outs = []
    for how in ({}, {"pallas_interpret": "cuda"}):
        fn = load(art, functions=["decode"], cache_dir=None, **how).functions["decode"]
        outs.append({k: np.asarray(v) for k, v in fn(**_step(art)).items()})
    np.testing.assert_allclose(outs[1]["logits"], outs[0]["logits"], atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 100])
def test_kernel_on_the_gpu_matches_the_decomposition(m):
    """The kernel compiled for the device (benchmarks/gpu_check.sh runs this file) against the
    decomposition on the CPU, under the same f32 bound."""
    cpu = jax.devices("cpu")[0]

    def on_gpu(x, w, layer, dtype):
        return jax.jit(lambda *a: linear_gpu.layer_linear(*a, dtype=dtype))(x, w, layer)

    x, stored, dense, dtype = _operands(m, 64, 512, 3, 1, True, seed=m)
    want = np.asarray(jax.jit(lambda *a: layer_linear_reference(*a, holds=1))(
        *jax.device_put((x, stored, np.int32(2)), cpu)), np.float64)
    got = np.asarray(on_gpu(x, stored, np.int32(2), dtype), np.float64)
    x16 = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
    bound = 512 * 2.0 ** -23 * (np.abs(x16) @ np.abs(dense[2].astype(np.float64)).T) + 1e-30
    assert (np.abs(got - want) <= bound).all()
