"""The accelerators' kernels for GGUF K-quant blocks (`hloserve.quant_linear` version 3:
runtime/kernels/pallas/quant_tpu.py and quant_gpu.py `kquant_linear`) against the composite's
decomposition (exporter/composites/quant_linear.py), in Pallas interpret mode on this CPU: Q4_K,
Q5_K and Q6_K blocks (random bytes with realistic f16 d / dmin, tests/support/kquants.py, so every
6-bit sub-scale, min and quant occurs), a layer picked from a stack of 3 and a stack of one, row
counts 1, 7, 16 and 100, output dims of 48 (no power of two: the GPU's 16-row programs, the TPU's
whole-N block), 256 (the TPU's 256-row and the GPU's 64-row programs) and 40 (the GPU's 8-row
programs), and rows of 512 elements (several GPU loop steps) and 8192 (several TPU grid steps
accumulating in scratch). Both kernels are lowered for their platforms too, and the load-time
substitution runs them inside an exported function.

Tolerance: both sides compute the same f32 weights (q * (d sc) exact, plus the min: one rounding,
possibly fused) times the same x8 (the activations quantized by the same operations), summed in f32
in other orders: below K * 2^-23 * (|x8| . |W|) element-wise (a loose bound on a K-term sum's
rounding), computed from the operands.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites.quant_linear import (quant_linear_v3_reference, quant_linear_v5_reference,
                                                       quantize_blocks)
from hloserve.runtime.artifact.kernels import QUANT_LINEAR, QUANT_LINEAR_V3, Block
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import quant, quant_gpu, quant_tpu
from tests.runtime.test_kquant_kernels import _stack, interleaved

KINDS = ("Q4_K", "Q5_K", "Q6_K")
KERNELS = {"gpu": quant_gpu.kquant_linear, "tpu": quant_tpu.kquant_linear}
KERNELS16 = {"gpu": quant_gpu.kquant16_linear, "tpu": quant_tpu.kquant16_linear}   # version 5


def _bound(x, dense):
    """The module docstring's bound from x and the layer's f32 weights [N, K]."""
    x8 = np.asarray(quantize_blocks(jnp.asarray(x)), np.float64)
    return x.shape[1] * 2.0 ** -23 * (np.abs(x8) @ np.abs(dense.astype(np.float64)).T) + 1e-30


def _check(side: str, kind: str, m: int, n: int, k: int, layers: int):
    rng = np.random.default_rng(m * 131 + n + k)
    q, blocks, dense, _ = _stack(kind, layers, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    layer = np.int32(layers - 1)
    want = np.asarray(jax.jit(lambda *a: quant_linear_v3_reference(*a, kind=int(Block[kind])))(x, q, blocks, layer))
    params = quant.KQuantParams(int(Block[kind]))
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=params, interpret=True))(x, q, blocks, layer))
    assert got.shape == (m, n)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= _bound(x, dense[layers - 1])).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("side", ["gpu", "tpu"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k,layers", [(1, 512, 3), (16, 256, 1), (7, 8192, 1)])
def test_version_5_runs_version_2s_kernel_on_the_interleaved_quants(side, kind, m, k, layers):
    """Version 5 (the quants interleaved by 16 rows at export): version 2's kernel reads them in place,
    the layer's headers decoded in the graph into its scale and min rows; against the decomposition
    under the same bound (K 8192: several TPU grid steps, many GPU loop steps; Q6_K's groups of 16)."""
    rng = np.random.default_rng(m * 7 + k + len(kind))
    q, blocks, dense, _ = _stack(kind, layers, 48, k, rng)
    q16 = interleaved(q, kind)
    x = rng.standard_normal((m, k)).astype(np.float32)
    layer = np.int32(layers - 1)
    want = np.asarray(jax.jit(lambda *a: quant_linear_v5_reference(*a, kind=int(Block[kind])))(x, q16, blocks, layer))
    ref3 = np.asarray(jax.jit(lambda *a: quant_linear_v3_reference(*a, kind=int(Block[kind])))(x, q, blocks, layer))
    assert (np.abs(want - ref3) <= _bound(x, dense[layers - 1])).all()   # version 3's values, summed in another order
    params = quant.KQuantParams(int(Block[kind]))
    got = np.asarray(jax.jit(lambda *a: KERNELS16[side](*a, params=params, interpret=True))(x, q16, blocks, layer))
    assert got.shape == (m, 48)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= _bound(x, dense[layers - 1])).all(), f"max error {err.max():.3g}"


def _cases():
    """Every kind at every row count, on one side or the other in turn (every pair of side, kind and
    row count occurs once or more)."""
    cases = [(("gpu", "tpu")[(i + j) % 2], kind, m) for i, kind in enumerate(KINDS) for j, m in enumerate((1, 7, 16, 100))]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert len({(c[a], c[b]) for c in cases}) == len({c[a] for c in cases}) * len({c[b] for c in cases})
    return cases


@pytest.mark.parametrize("side,kind,m", _cases())
def test_kernel_matches_the_decomposition(side, kind, m):
    _check(side, kind, m, n={1: 256, 16: 40}.get(m, 48), k=512, layers=1 if m == 7 else 3)


@pytest.mark.parametrize("side", ["gpu", "tpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_long_rows_take_several_tiles(side, kind):
    """K = 8192: several TPU grid steps along the row (each with its own scale blocks), many GPU loop
    steps."""
    _check(side, kind, 5, n=32, k=8192, layers=2)


def test_tiles():
    """The tiles each kernel takes: TPU rows of more than 2,048 bytes in whole lane tiles of scales,
    GPU tiles in powers of two dividing the shapes."""
    q4, q5 = quant.KQuantParams(int(Block.Q4_K)), quant.KQuantParams(int(Block.Q5_K))
    assert quant_tpu._kquant_tiles(q4, 7, 48, 288) == (8, 48, 288)        # whole N, whole row
    assert quant_tpu._kquant_tiles(q4, 300, 512, 4096) == (128, 256, 2048)
    assert quant_tpu._kquant_tiles(q5, 1, 2048, 8192) == (8, 256, 4096)   # 128 scale lanes are 4,096 bytes
    assert quant_gpu.kquant_tiles(q4, 1, 48, 128) == (16, 16, 128)
    assert quant_gpu.kquant_tiles(q5, 100, 2048, 8192) == (64, 64, 256)
    assert quant_gpu.kquant_tiles(q5, 1, 40, 256) == (16, 8, 256)


@pytest.mark.parametrize("side,platform,call", [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_lowers_for_its_platform(side, platform, call, kind):
    """Lowered (not compiled: no accelerator here) for the platform: Triton's or Mosaic's custom call."""
    q, blocks, _, _ = _stack(kind, 3, 256, 4096, np.random.default_rng(1))
    params = quant.KQuantParams(int(Block[kind]))
    checks = [export.DisabledSafetyCheck.custom_call(call)]
    exported = export.export(jax.jit(lambda *a: KERNELS[side](*a, params=params)), platforms=(platform,),
                             disabled_checks=checks)(
        jax.ShapeDtypeStruct((16, 4096), jnp.float32), q, blocks, jax.ShapeDtypeStruct((), jnp.int32))
    assert accelerators.kernels_in(exported) == {call: 1}


def test_plan_names_the_kernel():
    for platform, side in (("tpu", quant_tpu), ("cuda", quant_gpu)):
        for kind in KINDS:
            p = accelerators.choose(platform, QUANT_LINEAR.name, 3, {"kind": int(Block[kind])})
            assert p.kernel == side.KQUANT_NAME and p.params == {"kind": int(Block[kind])}
        assert accelerators.choose(platform, QUANT_LINEAR.name, 3, {"kind": 2}).kernel is None   # Q4_0 is no K-quant
        p = accelerators.choose(platform, QUANT_LINEAR.name, 5, {"kind": int(Block.Q6_K)})
        assert p.kernel == side.NAME and p.params == {"kind": int(Block.Q6_K)}           # version 2's, interleaved


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("version", [3, 5])
def test_substituted_at_load_in_an_exported_function(platform, version):
    """An exported function holding the composite (symbolic rows, as an artifact's step): specialized
    for the platform, the kernel linked in at static shapes, run in interpret mode here, equal to the
    decomposition on the CPU (version 5: the placeholder says its version, so version 2's kernel runs)."""
    kind = "Q4_K"
    q, blocks, dense, _ = _stack(kind, 2, 48, 512, np.random.default_rng(2))
    reference = quant_linear_v3_reference
    if version == 5:
        q, reference = interleaved(q, kind), quant_linear_v5_reference

    def f(x, qweight, blk, layer):
        return _private.composite(reference, QUANT_LINEAR_V3.name, version)(x, qweight, blk, layer, kind=int(Block[kind]))
    (m,) = export.symbolic_shape("M")
    shapes = [jax.ShapeDtypeStruct((m, 512), np.float32), jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct(blocks.shape, blocks.dtype), jax.ShapeDtypeStruct((), np.int32)]
    exported = export.export(jax.jit(f), platforms=("cpu",))(*shapes)
    backend = accelerators.PallasBackend(platform, interpret=True)
    assert [p.kernel for p in accelerators.plan(exported, platform)] == [_kernel_name(platform, version)]
    s = backend.specialize(exported)
    x = np.random.default_rng(3).standard_normal((9, 512)).astype(np.float32)
    args = (x, q, blocks, np.int32(1))
    static = s.per_shape([jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args])
    got = np.asarray(static.call(*args))
    want = np.asarray(jax.jit(lambda *a: reference(*a, kind=int(Block[kind])))(*args))
    assert got.shape == (9, 48)
    assert (np.abs(got.astype(np.float64) - want) <= _bound(x, dense[1])).all()


def _kernel_name(platform: str, version: int = 3) -> str:
    side = quant_tpu if platform == "tpu" else quant_gpu
    return side.KQUANT_NAME if version == 3 else side.NAME


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 100])
def test_kernel_on_the_accelerator_matches_the_decomposition(kind, m):
    """The platform's kernel compiled for the device (benchmarks/gpu_check.sh runs the gpu-marked
    tests), against the decomposition on the CPU, under the same f32 bound (f32 dots, no TF32)."""
    rng = np.random.default_rng(m)
    q, blocks, dense, _ = _stack(kind, 3, 256, 2048, rng)
    x = rng.standard_normal((m, 2048)).astype(np.float32)
    ref = jax.jit(lambda *a: quant_linear_v3_reference(*a, kind=int(Block[kind])))
    want = np.asarray(ref(*jax.device_put((x, q, blocks, np.int32(2)), jax.devices("cpu")[0])))
    side = "tpu" if jax.default_backend() == "tpu" else "gpu"
    params = quant.KQuantParams(int(Block[kind]))
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=params))(x, q, blocks, np.int32(2)))
    assert (np.abs(got.astype(np.float64) - want) <= _bound(x, dense[2])).all()
