"""The accelerators' kernels for `hloserve.quant_linear` version 4 (5-bit values, GGUF Q5_0 kept:
runtime/kernels/pallas/quant_tpu.py and quant_gpu.py `five_linear`) against the composite's
decomposition, in Pallas interpret mode on this CPU: a layer of a stack of 3 and a stack of one,
f16 and f32 scales, rows 1, 7, 16 and 40, K of 32 (one block), 576 (SmolLM2's rows) and 8192 (several
TPU tiles, many GPU loop iterations); lowered for cuda (Triton) and tpu (Mosaic); the plan names the
kernels; a gpu-marked test for benchmarks/gpu_check.sh.

Tolerance: both sides compute the same f32 products (x8 quantized by the same operations, each weight
(u - 16) * scale exact in f32) and sum them in f32 in other orders: |got - want| <= K 2^-23
(|x8| . |W|) + 1e-30 element-wise, computed from the operands.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hloserve.exporter.composites.quant_linear import quant_linear_v2_reference, quantize_blocks
from hloserve.runtime.artifact.kernels import QUANT_LINEAR
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import quant, quant_gpu, quant_tpu
from tests.runtime.test_kernels import five_bit_stack

KERNELS = {"gpu": quant_gpu.five_linear, "tpu": quant_tpu.five_linear}
PARAMS = quant.QuantParams(5, 32)
MIN = np.zeros((0,), np.float32)


def _check(side, m, n, k, layers, f16=True, interpret=True):
    rng = np.random.default_rng(m + n + k)
    q, scale, qw, sc = five_bit_stack(rng, layers, n, k, f16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    layer = np.int32(layers - 1)
    cpu = jax.devices("cpu")[0]
    want = np.asarray(jax.jit(lambda *a: quant_linear_v2_reference(*a, bits=5, group=32))(
        *jax.device_put((x, qw, sc, MIN, layer), cpu)))
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=PARAMS, interpret=interpret))(x, qw, sc, MIN, layer))
    w = q[layers - 1].astype(np.float64) * np.repeat(scale[layers - 1].astype(np.float64), 32, axis=-1)
    x8 = np.asarray(quantize_blocks(jnp.asarray(x)), np.float64)
    bound = k * 2.0 ** -23 * (np.abs(x8) @ np.abs(w).T) + 1e-30
    assert got.shape == (m, n)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("side", ["gpu", "tpu"])
@pytest.mark.parametrize("m,n,k,layers,f16", [(1, 16, 32, 1, True), (7, 48, 576, 3, False), (16, 64, 576, 3, True),
                                              (40, 128, 96, 1, True)])
def test_kernel_matches_the_decomposition(side, m, n, k, layers, f16):
    _check(side, m, n, k, layers, f16)


@pytest.mark.parametrize("side", ["gpu", "tpu"])
def test_long_rows_take_several_tiles(side):
    """K = 8192: 256 blocks, two TPU tiles of 128 accumulating in scratch, 16 GPU loop iterations."""
    _check(side, 7, 32, 8192, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100])
def test_kernel_on_the_accelerator_matches_the_decomposition(m):
    """The platform's kernel compiled for the device (benchmarks/gpu_check.sh runs this file), against
    the decomposition on the CPU, under the same f32 bound."""
    _check("tpu" if jax.default_backend() == "tpu" else "gpu", m, 48, 576, 3, interpret=False)


@pytest.mark.parametrize("side,platform,call", [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
def test_kernel_lowers_for_its_platform(side, platform, call):
    """Lowered (not compiled: no accelerator here) for the platform: Triton's or Mosaic's custom call."""
    from jax import export as jax_export
    _, _, qw, sc = five_bit_stack(np.random.default_rng(0), 3, 48, 576)
    fn = jax.jit(lambda *a: KERNELS[side](*a, params=PARAMS))
    checks = [jax_export.DisabledSafetyCheck.custom_call(call)]
    exported = jax_export.export(fn, platforms=(platform,), disabled_checks=checks)(
        jax.ShapeDtypeStruct((7, 576), jnp.float32), qw, sc, MIN, jax.ShapeDtypeStruct((), jnp.int32))
    assert f"stablehlo.custom_call @{call}" in exported.mlir_module()


def test_plan_names_the_kernel_for_version_4():
    """Version 4 with bits 5 in groups of 32 gets each platform's five_linear; other attributes say why
    the decomposition runs."""
    for platform, name in (("tpu", quant_tpu.FIVE_NAME), ("cuda", quant_gpu.FIVE_NAME)):
        p = accelerators.choose(platform, QUANT_LINEAR.name, 4, {"bits": 5, "group": 32})
        assert p.kernel == name and p.params == {"bits": 5, "group": 32}
        bad = accelerators.choose(platform, QUANT_LINEAR.name, 4, {"bits": 5, "group": 64})
        assert bad.kernel is None and "groups of 32" in bad.why
