"""The TPU (Mosaic) and GPU (Triton) Pallas kernels behind `hloserve.paged_attention`
(runtime/kernels/pallas/tpu.py, gpu.py), run in Pallas interpret mode on this CPU against the
composite's decomposition, and lowered for their platforms without the device.

Tolerance: as tests/runtime/test_kernels.py (softmax-weighted averages of O(1) values, f32 sums in
another order): 1e-5 absolute; a wrong block, position or mask moves outputs by O(0.1).
Shapes are tiny: interpret mode runs every grid step as XLA ops.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites.paged_attention import paged_attention_reference, paged_attention_reference_v2
from hloserve.exporter.composites.layer_linear import layer_linear_reference
from hloserve.exporter.composites.quant_linear import quant_linear_reference
from hloserve.runtime.artifact.kernels import LAYER_LINEAR, PAGED_ATTENTION, PAGED_ATTENTION_V2, QUANT_LINEAR
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import gpu as pallas_gpu
from hloserve.runtime.kernels.pallas import tpu as pallas_tpu
from hloserve.runtime.kernels.pallas.paged import PagedParams
from tests.runtime.test_kernels import _case

KERNELS = {"tpu": pallas_tpu, "cuda": pallas_gpu}


def _reference(args, params):
    return np.asarray(paged_attention_reference(*map(jnp.asarray, args), window=params.window, holds=params.holds,
                                                scale=np.float32(params.scale), softcap=np.float32(params.softcap)))


# (G, D, holds, window, scale, softcap, chunk): decode rows of 4 sequences (one block, a partial one,
# full, two) plus either 3 tokens of one sequence's prompt or a 37-token chunk across 5 block edges,
# and a padding token
CASES = [(3, 16, 0, 0, None, 0.0, False),
         (2, 32, 1, 5, None, 0.0, True),       # bf16 bits in s16, sliding window, chunk across blocks
         (4, 16, 2, 0, 0.3, 2.0, True),        # f16 bits, soft-capping, another scale
         (2, 32, 3, 5, None, 0.0, True),       # int8 rows with their scales (artifacts before 2026-11-28)
         (3, 32, 4, 0, None, 0.0, True),       # int8 rows with scales and zero points (--kv-cache-dtype int8)
         (2, 16, 5, 5, 0.3, 2.0, True)]        # fp8 e4m3 rows with their scales (--kv-cache-dtype fp8_e4m3)


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("G,D,holds,window,scale,softcap,chunk", CASES)
def test_kernel_matches_the_decomposition_in_interpret_mode(platform, G, D, holds, window, scale, softcap, chunk):
    args, pad = _case(np.random.default_rng(G * 10 + holds), G, D, holds, chunk=chunk)
    params = PagedParams(window=window, holds=holds, scale=D ** -0.5 if scale is None else scale, softcap=softcap)
    got = np.asarray(KERNELS[platform].paged_attention(*map(jnp.asarray, args), params=params, interpret=True))
    want = _reference(args, params)
    assert got.shape == want.shape == (len(args[4]), 2, G, D)
    np.testing.assert_allclose(got[:pad], want[:pad], atol=1e-5, rtol=0)
    assert np.isfinite(got[pad]).all()            # the padding token sees nothing: finite, unspecified


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,holds,window,scale,softcap,chunk", CASES)
def test_gpu_kernel_compiled_by_triton_matches_the_decomposition(G, D, holds, window, scale, softcap, chunk):
    """The same cases compiled by Triton and run on the GPU (exact f32 products and sums, as in
    interpret mode; the GPU's exp differs from the CPU's by a few ulps, far inside 1e-5)."""
    if jax.default_backend() != "gpu":
        pytest.skip("the Triton kernel needs a GPU")
    args, pad = _case(np.random.default_rng(G * 10 + holds), G, D, holds, chunk=chunk)
    params = PagedParams(window=window, holds=holds, scale=D ** -0.5 if scale is None else scale, softcap=softcap)
    fn = jax.jit(functools.partial(pallas_gpu.paged_attention, params=params))
    got = np.asarray(fn(*map(jnp.asarray, args)))
    with jax.default_device(jax.devices("cpu")[0]):     # on the GPU its f32 einsums would take TF32
        want = _reference(args, params)
    np.testing.assert_allclose(got[:pad], want[:pad], atol=1e-5, rtol=0)
    assert np.isfinite(got[pad]).all()


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_version_2_window_operand_through_the_load_time_substitution(platform):
    """Paged attention version 2 (the window an s32[] operand): exported as the exporter writes it,
    planned onto the platform's kernel, substituted at static shapes (accelerators.for_shapes, the
    kernel in interpret mode) and called with several windows: each equals version 1's
    decomposition with that window as its attribute."""
    from hloserve.runtime.kernels import pallas as acc
    args, pad = _case(np.random.default_rng(3), 2, 16, 1, chunk=True)
    kw = dict(holds=1, scale=np.float32(0.25), softcap=np.float32(0))
    composite = _private.composite(paged_attention_reference_v2, PAGED_ATTENTION_V2.name, PAGED_ATTENTION_V2.version)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in (*args, np.int32(0))]
    # lowered for every platform, as the exporter writes it: interpret mode runs where jax runs
    exp = export.export(jax.jit(lambda *a: composite(*a, **kw)), platforms=("cpu", "cuda", "tpu"))(*avals)
    pending, plans = acc.specialize(exp, platform)
    assert [(p.version, p.kernel, p.params["window"]) for p in plans] == [(2, KERNELS[platform].NAME, None)]
    fn = jax.jit(acc.for_shapes(pending, platform, avals, interpret=True).call)
    for window in (0, 5, 30):
        params = PagedParams(window=window, holds=1, scale=0.25, softcap=0.0)
        got = np.asarray(fn(*args, np.int32(window)))
        with jax.default_device(jax.devices("cpu")[0]):  # on a GPU its f32 einsums would take TF32
            want = _reference(args, params)
        np.testing.assert_allclose(got[:pad], want[:pad], atol=1e-5, rtol=0, err_msg=f"window {window}")


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_kernel_reads_only_its_sequences_blocks(platform):
    """Poisoning every cache block no sequence owns (and the other layers) changes nothing."""
    args, pad = _case(np.random.default_rng(7), 3, 16, 0)
    params = PagedParams(window=0, holds=0, scale=0.25, softcap=0.0)
    fn = KERNELS[platform].paged_attention
    clean = np.asarray(fn(*map(jnp.asarray, args), params=params, interpret=True))
    cache = args[1].copy()
    owned = set(args[3][args[3] > 0].ravel().tolist())
    for n in range(cache.shape[3]):
        if n not in owned:
            cache[:, :, :, n] = 1e6
    cache[0], cache[2] = 1e6, 1e6                   # layer 1 is the one read
    poisoned = np.asarray(fn(*map(jnp.asarray, [args[0], cache, *args[2:]]), params=params, interpret=True))
    np.testing.assert_array_equal(poisoned[:pad], clean[:pad])


@pytest.mark.parametrize("platform,custom_call,holds", [("tpu", "tpu_custom_call", 1), ("cuda", "__gpu$xla.gpu.triton", 1),
                                                        ("tpu", "tpu_custom_call", 3), ("tpu", "tpu_custom_call", 4),
                                                        ("tpu", "tpu_custom_call", 5)])
def test_kernel_lowers_for_its_platform_without_the_device(platform, custom_call, holds):
    """jax lowers the Pallas kernel for its platform on a CPU-only jaxlib: Mosaic MLIR in a
    tpu_custom_call, Triton IR in a Triton custom call (compiling them needs the device). An int8 or
    fp8 cache (holds 3, 4 or 5) only on TPU: its rows of D + 2 or D + 3 are no Triton tile, so a GPU
    runs the decomposition."""
    args, _ = _case(np.random.default_rng(0), 2, 32, holds)
    params = PagedParams(window=5, holds=holds, scale=0.2, softcap=2.0)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(lambda *a: KERNELS[platform].paged_attention(*a, params=params)),
                        platforms=(platform,), disabled_checks=checks)(*avals)
    assert accelerators.kernels_in(exp) == {custom_call: 1}


def test_plan_per_platform():
    """Paged attention gets each platform's kernel with the composite's attributes as its static
    parameters; layer_linear and quant_linear version 1 stay on XLA's dot (version 2's kernels:
    tests/runtime/test_pallas_quant.py); Triton refuses tiles that are not powers of two."""
    attrs = {"window": 4, "holds": 1, "scale": 0.125, "softcap": 0.0}
    tpu = accelerators.choose("tpu", PAGED_ATTENTION.name, 1, attrs, (2, 2, 2, "N", 16, 64))
    assert tpu.kernel == pallas_tpu.NAME and tpu.params == {"window": 4, "holds": 1, "scale": 0.125, "softcap": 0.0}
    assert accelerators.choose("cuda", PAGED_ATTENTION.name, 1, attrs, (2, 2, 2, "N", 16, 64)).kernel == pallas_gpu.NAME
    odd = accelerators.choose("cuda", PAGED_ATTENTION.name, 1, attrs, (2, 2, 2, "N", 16, 80))
    assert odd.kernel is None and "powers of two" in odd.why
    for name in (LAYER_LINEAR.name, QUANT_LINEAR.name):
        assert accelerators.choose("tpu", name, 1, {}).kernel is None
    v2 = accelerators.choose("tpu", PAGED_ATTENTION.name, 2, {k: v for k, v in attrs.items() if k != "window"})
    assert v2.kernel == pallas_tpu.NAME and v2.params["window"] is None        # the window is an operand
    assert accelerators.choose("tpu", PAGED_ATTENTION.name, 3, attrs).kernel is None   # unknown version
    with pytest.raises(ValueError, match="use one of tpu, cuda"):
        accelerators.choose("rocm", PAGED_ATTENTION.name, 1, attrs)


def _composite_exports(platforms):
    """Each composite of runtime/artifact/kernels.py, exported through the exporter's composite
    helper with a symbolic row count, for `platforms`."""
    (t,) = export.symbolic_shape("T")
    args, _ = _case(np.random.default_rng(1), 3, 16, 1)
    attn = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    for i in (0, 4, 5):
        attn[i] = jax.ShapeDtypeStruct((t, *np.shape(args[i])[1:]), np.asarray(args[i]).dtype)
    i32 = jax.ShapeDtypeStruct((), np.int32)
    x = jax.ShapeDtypeStruct((t, 64), np.float32)
    composites = {
        PAGED_ATTENTION.name: (_private.composite(paged_attention_reference, PAGED_ATTENTION.name, 1),
                               dict(window=0, holds=1, scale=np.float32(0.25), softcap=np.float32(0)), attn),
        LAYER_LINEAR.name: (_private.composite(layer_linear_reference, LAYER_LINEAR.name, 1), dict(holds=1),
                            [x, jax.ShapeDtypeStruct((2, 32, 64), np.int16), i32]),
        QUANT_LINEAR.name: (_private.composite(quant_linear_reference, QUANT_LINEAR.name, 1), dict(bits=8, group=32),
                            [x, jax.ShapeDtypeStruct((2, 32, 64), np.int8), jax.ShapeDtypeStruct((2, 32, 2), np.float32),
                             jax.ShapeDtypeStruct((0,), np.float32), i32]),
    }
    return {name: export.export(jax.jit(lambda *a, f=f, kw=kw: f(*a, **kw)), platforms=platforms)(*avals)
            for name, (f, kw, avals) in composites.items()}


def test_every_composite_lowers_for_every_platform_and_keeps_its_kernel_on_cpu():
    """The three composites lower for cpu, cuda and tpu in one module; each platform's plan reads
    them from it (a kernel for paged attention on both; layer_linear's GPU kernel is opt-in), and the
    multi-platform paged attention still runs its decomposition on CPU."""
    exports = _composite_exports(("cpu", "cuda", "tpu"))
    for name, exp in exports.items():
        assert exp.platforms == ("cpu", "cuda", "tpu")
        for platform in ("tpu", "cuda"):
            (p,) = accelerators.plan(exp, platform)
            assert p.composite == name and (p.kernel is not None) == (name == PAGED_ATTENTION.name)
    args, pad = _case(np.random.default_rng(1), 3, 16, 1)
    from hloserve.runtime.kernels import Decompositions
    fn = Decompositions().specialize(exports[PAGED_ATTENTION.name]).exported
    params = PagedParams(window=0, holds=1, scale=0.25, softcap=0.0)
    np.testing.assert_allclose(np.asarray(fn.call(*map(jnp.asarray, args)))[:pad], _reference(args, params)[:pad],
                               atol=1e-6, rtol=0)
