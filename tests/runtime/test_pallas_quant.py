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


@pytest.mark.parametrize("side,layout", [("gpu", "int8-g32"), ("tpu", "int4-g32-asym"), ("gpu", "int4-g64-asym"),
                                         ("tpu", "int8-channel")])
def test_version_6_chunks_round_x_and_the_weights_to_bf16(side, layout):
    """Version 6 at a row count of its bf16_rows or more (QuantParams.bf16): the kernel in interpret
    mode against the version 6 decomposition at 100 rows (bf16_rows 64), both r(x) r(W)^T with exact
    products, summed in f32 in other orders: |error| <= K 2^-23 sum_k |r(x_k) r(w_k)|."""
    from hloserve.exporter.composites.quant_linear import quant_linear_v6_reference
    bits, group, symmetric, sdtype = LAYOUTS[layout]
    qw, s, mn, (q, scale, mins) = _weights(bits, group, symmetric, sdtype, 48, 3)
    group = group or K
    x = np.random.default_rng(6).standard_normal((100, K)).astype(np.float32)
    want = np.asarray(jax.jit(lambda *a: quant_linear_v6_reference(*a, bits=bits, group=group, bf16_rows=64))(
        x, qw, s, mn, np.int32(1)))
    got = np.asarray(jax.jit(lambda *a: KERNELS[side](*a, params=quant.QuantParams(bits, group, bf16=True),
                                                       interpret=True))(x, qw, s, mn, np.int32(1)))
    w = q[1].astype(np.float32) * np.repeat(scale[1].astype(np.float32), group, axis=-1)
    if mins is not None:
        w = w + np.repeat(mins[1].astype(np.float32), group, axis=-1)
    r = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    bound = K * 2.0 ** -23 * (np.abs(r(x)) @ np.abs(r(w)).T) + 1e-30
    assert (np.abs(got.astype(np.float64) - want) <= bound).all()
    assert (np.abs(want - r(x) @ r(w).T) <= bound).all()     # the decomposition is the bf16 product


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_version_6_substituted_at_load_rounds_only_its_chunks(platform):
    """A version 6 composite in an exported function (symbolic rows, as in an artifact's step): the
    placeholder says its version and bf16_rows, so at 9 rows the kernel computes version 2's product
    and at 70 the bf16 one; both equal the decomposition (its conditional on the row count) within
    the f32 bounds above, run in interpret mode here."""
    from jax import export

    from hloserve.exporter import _private
    from hloserve.exporter.composites.quant_linear import quant_linear_v6_reference
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V6
    qw, s, mn, (q, scale, _) = _weights(8, 32, True, np.float16, 48, 2)

    def f(x, qweight, sc, m, layer):
        return _private.composite(quant_linear_v6_reference, QUANT_LINEAR_V6.name, QUANT_LINEAR_V6.version)(
            x, qweight, sc, m, layer, bits=8, group=32, bf16_rows=64)
    (m,) = export.symbolic_shape("M")
    shapes = [jax.ShapeDtypeStruct((m, K), np.float32)] + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (qw, s, mn)]
    exported = export.export(jax.jit(f), platforms=("cpu",))(*shapes, jax.ShapeDtypeStruct((), np.int32))
    [p] = accelerators.plan(exported, platform)
    assert p.kernel is not None and "from 64 rows" in p.why
    backend = accelerators.PallasBackend(platform, interpret=True)
    spec = backend.specialize(exported)
    w = q[1].astype(np.float64) * np.repeat(scale[1].astype(np.float64), 32, axis=-1)
    for rows in (9, 70):
        x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
        args = (x, qw, s, mn, np.int32(1))
        static = spec.per_shape([jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args])
        got = np.asarray(static.call(*args)).astype(np.float64)
        want = np.asarray(jax.jit(lambda *a: quant_linear_v6_reference(*a, bits=8, group=32, bf16_rows=64))(*args))
        xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64) if rows >= 64 else \
            np.asarray(quantize_blocks(jnp.asarray(x)), np.float64)
        bound = K * 2.0 ** -22 * (np.abs(xr) @ np.abs(w).T) + 1e-30
        assert got.shape == (rows, 48) and (np.abs(got - want) <= bound).all(), rows


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
