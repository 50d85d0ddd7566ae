"""The accelerators' `hloserve.quant_linear` kernels (runtime/kernels/pallas/quant_*.py) against the
composite's decomposition (exporter/composites/quant_linear.py), in Pallas interpret mode on this
CPU, for every layout they serve: version 2 (16-row interleaved) int8 per channel and grouped, int4
grouped symmetric and asymmetric, f16 and f32 scales, a layer picked from a stack of 3 and a stack
of one; row counts 1, 7, 16 and 100 (none a multiple of the 32- and 64-row tiles but 16), output dims
of 48, 64 and 128 rows (the contract's version 2 takes whole 16-row blocks; 48 is no power of two
and 3 blocks, so the TPU kernel's 1, 4 and 8 blocks per program are all run), and rows of 256 and
8192 elements (one tile, or several accumulated).
The GPU kernel is also lowered for cuda (Triton) and the TPU one for tpu (Mosaic) here.

Tolerance: both sides compute the same f32 products (x8 and the dequantized weights are the same f32
values: the activations are quantized by the same operations, each weight is q * scale (+ min) in
f32) and sum them in f32 in other orders. Each sum has K = 256 terms of magnitude up to |x8| |w|; its
rounding error is below K * eps_f32 * sum |x8 w| (a loose bound), so the test asserts
|got - want| <= 256 * 2^-23 * (|x8| . |W|) + 1e-30 element-wise, computed from the operands.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hloserve.exporter.composites.quant_linear import quant_linear_v2_reference, quantize_blocks
from hloserve.quantization import primitives
from hloserve.runtime.artifact.kernels import QUANT_LINEAR
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import quant, quant_gpu, quant_tpu

K = 256
LAYOUTS = {   # name -> (bits, group (None: one per row), symmetric, scale dtype)
    "int8-channel": (8, None, True, np.float32),
    "int8-g32": (8, 32, True, np.float16),
    "int8-g128": (8, 128, True, np.float16),
    "int4-g32-sym": (4, 32, True, np.float16),
    "int4-g32-asym": (4, 32, False, np.float16),
    "int4-g64-asym": (4, 64, False, np.float32),
}
KERNELS = {"gpu": quant_gpu.quant_linear, "tpu": quant_tpu.quant_linear}


def _weights(bits: int, group: int | None, symmetric: bool, sdtype, n: int, layers: int, seed: int = 0,
             k: int = K):
    """Random stored tensors of a stack in version 2's layout (primitives.interleave_rows)."""
    rng = np.random.default_rng(seed)
    lo, hi = (-128, 127) if bits == 8 else ((-8, 7) if symmetric else (0, 15))
    q = rng.integers(lo, hi + 1, (layers, n, k)).astype(np.int8)
    groups = k // (group or k)
    scale = (rng.uniform(0.5, 2.0, (layers, n, groups)) / 64).astype(sdtype)
    mn = None if symmetric else (rng.uniform(-1, 1, (layers, n, groups)) / 8).astype(sdtype)
    stored = q if bits == 8 else primitives.pack_int4(q)
    qw, s, m = primitives.interleave_rows(stored, scale, mn, bits)
    return qw, s, (np.zeros((0,), np.float32) if m is None else m), (q, scale, mn)


def _bound(x, dense, layer):
    """The f32 summation bound of the module docstring, from the operands (dense: q, scale, min)."""
    q, scale, mn = dense
    k = q.shape[-1]
    group = k // scale.shape[-1]
    w = q[layer].astype(np.float64) * np.repeat(scale[layer].astype(np.float64), group, axis=-1)
    if mn is not None:
        w = w + np.repeat(mn[layer].astype(np.float64), group, axis=-1)
    x8 = np.asarray(quantize_blocks(jnp.asarray(x)), np.float64)
    return k * 2.0 ** -23 * (np.abs(x8) @ np.abs(w).T) + 1e-30


ROWS = [1, 7, 16, 100]


def _cases():
    """Every layout at every row count, on one side or the other in turn: every pair of (side, layout,
    row count) occurs (interpret mode runs a kernel at Python speed; the whole product is 48 cases)."""
    cases = [(("gpu", "tpu")[(i + j) % 2], layout, m) for i, layout in enumerate(LAYOUTS) for j, m in enumerate(ROWS)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert len({(c[a], c[b]) for c in cases}) == len({c[a] for c in cases}) * len({c[b] for c in cases})
    return cases


@pytest.mark.parametrize("side,layout,m", _cases())
def test_kernel_matches_the_decomposition(side, layout, m):
    bits, group, symmetric, sdtype = LAYOUTS[layout]
    _check(side, bits, group, symmetric, sdtype, m, n={1: 128, 16: 64}.get(m, 48), k=K)


@pytest.mark.parametrize("side", ["gpu", "tpu"])
@pytest.mark.parametrize("layout", ["int8-channel", "int8-g32", "int4-g32-asym"])
def test_long_rows_take_several_tiles(side, layout):
    """K = 8192: more steps of `a` than one TPU tile takes (several grid steps accumulating in scratch,
    each reading its own group rows), and many GPU loop iterations."""
    bits, group, symmetric, sdtype = LAYOUTS[layout]
    _check(side, bits, group, symmetric, sdtype, 7, n=32, k=8192)


def _check(side, bits, group, symmetric, sdtype, m, n, k):
    """The kernel of `side` in interpret mode against the decomposition, within the f32 bound."""
    layers = 1 if m == 7 else 3                                    # a stack of one is read at layer 0
    qw, s, mn, dense = _weights(bits, group, symmetric, sdtype, n, layers, k=k)
    group = group or k
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    layer = np.int32(layers - 1)
    want = np.asarray(jax.jit(lambda *a: quant_linear_v2_reference(*a, bits=bits, group=group))(x, qw, s, mn, layer))
    params = quant.QuantParams(bits, group)
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=params, interpret=True))(x, qw, s, mn, layer))
    assert got.shape == (m, n)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= _bound(x, dense, layers - 1)).all(), f"max error {err.max():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m", [1, 100])
def test_kernel_on_the_accelerator_matches_the_decomposition(layout, m):
    """The platform's kernel compiled for the device (benchmarks/gpu_check.sh runs this file), against
    the decomposition on the CPU, under the same f32 bound (the kernels' dots are f32, no TF32)."""
    bits, group, symmetric, sdtype = LAYOUTS[layout]
    qw, s, mn, dense = _weights(bits, group, symmetric, sdtype, 48, 3)
    group = group or K
    x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    want = np.asarray(jax.jit(lambda *a: quant_linear_v2_reference(*a, bits=bits, group=group))(
        *jax.device_put((x, qw, s, mn, np.int32(2)), cpu)))
    side = "tpu" if jax.default_backend() == "tpu" else "gpu"
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=quant.QuantParams(bits, group)))(x, qw, s, mn, np.int32(2)))
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= _bound(x, dense, 2)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tiles_lie_in_one_group_or_cover_whole_groups(layout):
    bits, group, _, _ = LAYOUTS[layout]
    p = quant.QuantParams(bits, group or K)
    for cap in (32, 512):
        u = quant.steps(p, K, cap)
        assert (K // p.unit) % u == 0 and (p.per_group % u == 0 or u % p.per_group == 0)


@pytest.mark.parametrize("side,platform,call", [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("layout", ["int8-channel", "int8-g32", "int4-g32-sym", "int4-g32-asym"])
def test_kernel_lowers_for_its_platform(side, platform, call, layout):
    """Lowered (not compiled: no accelerator here) for the platform: Triton's or Mosaic's custom call."""
    from jax import export as jax_export
    bits, group, symmetric, sdtype = LAYOUTS[layout]
    qw, s, mn, _ = _weights(bits, group, symmetric, sdtype, 48, 3)
    params = quant.QuantParams(bits, group or K)
    fn = jax.jit(lambda *a: KERNELS[side](*a, params=params))
    checks = [jax_export.DisabledSafetyCheck.custom_call(call)]
    exported = jax_export.export(fn, platforms=(platform,), disabled_checks=checks)(
        jax.ShapeDtypeStruct((7, K), jnp.float32), qw, s, mn, jax.ShapeDtypeStruct((), jnp.int32))
    assert f"stablehlo.custom_call @{call}" in exported.mlir_module()


def test_plan_names_the_kernel_for_version_2(monkeypatch):
    """Version 2 gets each platform's kernel with bits and group as its static parameters; version 1
    (rows one by one) says why its decomposition runs, as does the switch off (version 3, GGUF
    K-quants: tests/runtime/test_pallas_kquant.py)."""
    for platform, name in (("tpu", quant_tpu.NAME), ("cuda", quant_gpu.NAME)):
        p = accelerators.choose(platform, QUANT_LINEAR.name, 2, {"bits": 4, "group": 64})
        assert p.kernel == name and p.params == {"bits": 4, "group": 64}
        assert accelerators.choose(platform, QUANT_LINEAR.name, 1, {"bits": 8, "group": 32}).why.startswith("version 1")
    monkeypatch.setenv(accelerators.ENV, "0")
    off = accelerators.choose("cuda", QUANT_LINEAR.name, 2, {"bits": 8, "group": 32})
    assert off.kernel is None and off.why == f"{accelerators.ENV}=0"


def test_digest_covers_the_quant_kernels(tmp_path, monkeypatch):
    """The executable-cache key changes when a quant kernel's code does (a copy of the package with
    one byte of quant_gpu.py changed digests differently for cuda, alike for tpu)."""
    import os
    import shutil
    here = os.path.dirname(accelerators.__file__)
    before = {p: accelerators.digest(p) for p in ("tpu", "cuda")}
    copy = tmp_path / "pallas"
    shutil.copytree(here, copy)
    with open(copy / "quant_gpu.py", "a") as f:
        f.write("\n")
    monkeypatch.setattr(accelerators, "__file__", str(copy / "__init__.py"))
    after = {p: accelerators.digest(p) for p in ("tpu", "cuda")}
    assert after["tpu"] == before["tpu"] and after["cuda"] != before["cuda"]
