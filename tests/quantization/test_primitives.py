"""quantize / dequantize / pack against a NumPy reference written independently here (loops over
groups, no shared helpers), plus the torch (eager op) and jax (lowering) dequantizers against
primitives.dequantize, bit for bit. Property tests draw shapes, groups and value ranges."""
from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from hloserve.exporter.composites import quant_linear as lowering
from hloserve.quantization import modules, primitives
from hloserve.quantization.schemes import INT8, QuantConfig, QuantizationError, WeightScheme

SCHEMES = [INT8, WeightScheme(8, 32, True, "f16"), WeightScheme(4, 32, True, "f16"),
           WeightScheme(4, 64, False, "f16"), WeightScheme(4, 128, True, "f32"), WeightScheme(4, 32, False, "f32")]


def _out(value, sdt, down=False):
    """Scalar outward rounding to the storage dtype: magnitude up (mins: toward -inf)."""
    value = np.float32(value)
    r = sdt(value)
    if down and np.float32(r) > value:
        r = np.nextafter(r, sdt(-np.inf))
    if not down and abs(np.float32(r)) < abs(value):
        r = np.nextafter(r, sdt(np.inf) if value > 0 else sdt(-np.inf))
    return sdt(r)


def _reference(w: np.ndarray, s: WeightScheme):
    """Row by row, group by group: (q int values [out, in], scale [out, G], min [out, G] or None)."""
    sdt = np.float16 if s.scale_dtype == "f16" else np.float32
    out, n = w.shape
    g = s.group or n
    q = np.zeros((out, n), np.int64)
    scale = np.zeros((out, n // g), sdt)
    mins = np.zeros((out, n // g), sdt)
    for r in range(out):
        for k in range(n // g):
            blk = w[r, k * g:(k + 1) * g].astype(np.float32)
            if s.symmetric and s.bits == 8:
                sc = _out(np.abs(blk).max() / np.float32(127), sdt)
                lo, hi, off = -127, 127, np.float32(0)
            elif s.symmetric:
                m = blk[np.abs(blk).argmax()]
                sc = _out(m / np.float32(-8), sdt)
                lo, hi, off = -8, 7, np.float32(0)
            else:
                mins[r, k] = _out(blk.min(), sdt, down=True)
                off = np.float32(mins[r, k])
                sc = _out((blk.max() - off) / np.float32(15), sdt)
                lo, hi = 0, 15
            scale[r, k] = sc
            sc32 = np.float32(sc)
            vals = np.round((blk - off) / sc32) if sc32 != 0 else np.zeros_like(blk)
            q[r, k * g:(k + 1) * g] = np.clip(vals, lo, hi)
    return q, scale, (None if s.symmetric else mins)


@st.composite
def weights(draw, scheme: WeightScheme):
    g = scheme.group or draw(st.sampled_from([2, 6, 16]))
    out = draw(st.integers(1, 4))
    n = g * draw(st.integers(1, 3))
    mag = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    elems = st.floats(-1, 1, width=32, allow_nan=False)
    w = draw(hnp.arrays(np.float32, (out, n), elements=elems)) * np.float32(mag)
    w[np.abs(w) < 1e-30] = 0.0   # float32 subnormals: amax / 127 would underflow to a zero scale
    if draw(st.booleans()):
        w[0, :g] = 0.0   # an all-zero group: scale 0, q 0
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.describe()}-{s.scale_dtype}")
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_quantize_matches_reference(scheme, data):
    w = data.draw(weights(scheme))
    qa = primitives.quantize(w, scheme)
    q_ref, scale_ref, min_ref = _reference(w, scheme)
    np.testing.assert_array_equal(primitives.int_values(qa), q_ref)
    scale = qa.scale if scheme.group else qa.scale[:, None]
    np.testing.assert_array_equal(scale, scale_ref)
    if min_ref is not None:
        np.testing.assert_array_equal(qa.min, min_ref)
    # dequantized = q * scale (+ min), f32; within scale / 2 of w (int4 symmetric: within one scale,
    # the +8 side clips to 7)
    g = scheme.group or w.shape[1]
    deq = primitives.dequantize(qa)
    expect = q_ref.astype(np.float32) * np.repeat(scale_ref.astype(np.float32), g, axis=1)
    if min_ref is not None:
        expect = expect + np.repeat(min_ref.astype(np.float32), g, axis=1)
    np.testing.assert_array_equal(deq, expect)
    step = np.repeat(np.abs(scale_ref.astype(np.float32)), g, axis=1)
    bound = step * (1.0 if scheme.bits == 4 and scheme.symmetric else 0.5)
    assert np.all(np.abs(deq - w) <= bound * 1.001 + 1e-6 * np.abs(w).max())


@pytest.mark.parametrize("scale_dtype", ["f16", "f32"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mse_rounding_never_worse_than_minmax(scale_dtype, data):
    """int4 sym "mse": per group, squared error <= the minmax (Q4_0) rule's, q in [-8, 7], and what is
    stored is what dequantizes (q * scale); on Gaussian weights it is strictly better overall."""
    minmax = WeightScheme(4, 32, True, scale_dtype, "minmax")
    mse = WeightScheme(4, 32, True, scale_dtype, "mse")
    w = data.draw(weights(mse))
    a, b = primitives.quantize(w, minmax), primitives.quantize(w, mse)
    qb = primitives.int_values(b)
    assert qb.min() >= -8 and qb.max() <= 7
    deq_b = primitives.dequantize(b)
    np.testing.assert_array_equal(deq_b, qb.astype(np.float32) * np.repeat(b.scale.astype(np.float32), 32, axis=1))
    err = lambda d: np.square((d - w).astype(np.float64)).reshape(w.shape[0], -1, 32).sum(-1)   # noqa: E731
    e_a, e_b = err(primitives.dequantize(a)), err(deq_b)
    assert np.all(e_b <= e_a * (1 + 1e-5) + 1e-12), (e_a, e_b)


def test_mse_rounding_reduces_gaussian_error():
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    errs = {r: float(np.square(primitives.dequantize(primitives.quantize(w, WeightScheme(4, 32, True, "f16", r))) - w).sum())
            for r in ("minmax", "mse")}
    assert errs["mse"] < 0.92 * errs["minmax"], errs   # measured: 0.885x


@settings(max_examples=60, deadline=None)
@given(q=hnp.arrays(np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6).map(lambda s: (*s[:-1], 2 * s[-1])),
                    elements=st.integers(-8, 7)))
def test_pack_roundtrip_and_nibble_order(q):
    p = primitives.pack_int4(q)
    assert p.dtype == np.uint8 and p.shape == (*q.shape[:-1], q.shape[-1] // 2)
    np.testing.assert_array_equal(p & 0xF, q[..., 0::2].astype(np.int16) & 0xF)   # element 2k: low nibble
    np.testing.assert_array_equal(p >> 4, q[..., 1::2].astype(np.int16) & 0xF)     # element 2k+1: high nibble
    np.testing.assert_array_equal(primitives.unpack_int4(p, signed=True), q)
    u = (q.astype(np.int16) + 8).astype(np.int8)      # [0, 15]
    np.testing.assert_array_equal(primitives.unpack_int4(primitives.pack_int4(u), signed=False), u)
    # the torch (eager op) and jax (lowering) unpackers agree with NumPy
    np.testing.assert_array_equal(modules.unpack_int4(torch.from_numpy(p), signed=True).numpy(), q)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: lowering.unpack_int4(a, True))(p)), q)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: lowering.unpack_int4(a, False))(
        primitives.pack_int4(u))), u)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.describe()}-{s.scale_dtype}")
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_torch_and_jax_dequantize_bit_exact(scheme, data):
    w = data.draw(weights(scheme))
    qa = primitives.quantize(np.stack([w, -w]), scheme)        # a stacked [2, out, in] weight
    ref = primitives.dequantize(qa)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in qa.tensors().items()}
    got_t = modules.dequantize(t["qweight"], t["scale"], t.get("min"), scheme.bits, scheme.group or 0).numpy()
    got_j = np.asarray(jax.jit(lambda q, s, m: lowering.dequantize(q, s, m, scheme.bits, scheme.group or 0))(
        qa.qweight, qa.scale, qa.min))
    np.testing.assert_array_equal(got_t.view(np.uint32), ref.view(np.uint32))
    if scheme.symmetric or scheme.scale_dtype == "f16":
        np.testing.assert_array_equal(got_j.view(np.uint32), ref.view(np.uint32))
    else:   # XLA may fuse q * scale + min into an FMA: q * scale (< 16 * scale) is not exact with f32 scales
        np.testing.assert_allclose(got_j, ref, rtol=0, atol=16 * 2.0 ** -23 * float(np.abs(qa.scale).max()))


@pytest.mark.parametrize("scheme", [WeightScheme(8, 32, True, "f16"), WeightScheme(4, 32, True, "f16"),
                                    WeightScheme(4, 64, False, "f32")], ids=lambda s: s.describe())
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_interleaved_rows_come_back_in_order_from_numpy_jax_and_torch(scheme, data):
    """rows_in_order undoes interleave_rows, one definition three ways: run by numpy, traced by jax
    (the version 2 composite's decomposition) and run by the torch op (modules.rows_in_order): each
    gives every row's integer values (int4: signed, or unsigned with a min) and scales, exactly."""
    shape = (16 * data.draw(st.integers(1, 3)), scheme.group * data.draw(st.integers(1, 3)))
    w = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    qa = primitives.quantize(w, scheme)
    stored = primitives.interleave_rows(qa.qweight, qa.scale, qa.min, scheme.bits)
    assert stored[0].shape == (shape[0] // 16, 16 * shape[1] * scheme.bits // 8)
    want = (primitives.int_values(qa), qa.scale, qa.min)
    traced = jax.jit(lambda q, s, m: primitives.rows_in_order(q, s, m, scheme.bits, xp=jax.numpy))
    ways = {"numpy": primitives.rows_in_order(*stored, scheme.bits),
            "jax": traced(*stored),
            "torch": modules.rows_in_order(*(None if a is None else torch.from_numpy(a) for a in stored), scheme.bits)}
    for way, got in ways.items():
        for g, x in zip(got, want):
            assert (g is None) == (x is None), way
            if x is not None:
                np.testing.assert_array_equal(np.asarray(g), x, err_msg=way)
        assert np.asarray(got[0]).dtype == np.int8, way


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_five_bit_rows_come_back_in_order_and_each_bit_where_the_contract_says(data):
    """Version 4's layout (5-bit values, GGUF Q5_0): rows_in_order undoes interleave_rows run by numpy,
    traced by jax and run by the torch op, and each value's nibble and fifth bit lie at the bytes and
    bits runtime/artifact/kernels.py QUANT_LINEAR_V4 names (read here one element at a time)."""
    n, k = 16 * data.draw(st.integers(1, 3)), 32 * data.draw(st.integers(1, 3))
    q = data.draw(hnp.arrays(np.int8, (n, k), elements=st.integers(-16, 15)))
    scale = data.draw(hnp.arrays(np.float16, (n, k // 32), elements=st.floats(-1, 1, width=16)))
    qw, sc, mn = primitives.interleave_rows(q, scale, None, 5)
    assert qw.shape == (n // 16, 10 * k) and qw.dtype == np.uint8 and sc.shape == (n // 16, k // 32, 16) and mn is None
    for r, c in [(0, 0), (n - 1, k - 1), (data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, k - 1)))]:
        block = qw[r // 16, 320 * (c // 32):320 * (c // 32 + 1)]
        step, lane, second = c // 8 % 4, 4 * (r % 16) + c % 4, c % 8 >= 4
        byte = block[64 * step + lane]
        low = int(byte >> 4 if second else byte & 0xF)
        mask = int.from_bytes(block[256 + 16 * step + 8 * second:256 + 16 * step + 8 * second + 8].tobytes(), "little")
        assert low + 16 * ((mask >> lane) & 1) - 16 == q[r, c], (r, c)
    traced = jax.jit(lambda a, b: primitives.rows_in_order(a, b, None, 5, xp=jax.numpy))
    ways = {"numpy": primitives.rows_in_order(qw, sc, None, 5), "jax": traced(qw, sc),
            "torch": modules.rows_in_order(torch.from_numpy(qw), torch.from_numpy(sc), None, 5)}
    for way, (got_q, got_s, got_m) in ways.items():
        np.testing.assert_array_equal(np.asarray(got_q), q, err_msg=way)
        np.testing.assert_array_equal(np.asarray(got_s), scale, err_msg=way)
        assert got_m is None and np.asarray(got_q).dtype == np.int8, way


def test_five_bit_values_are_gguf_q5_0s_and_stored_as_int8_row_by_row():
    """bits 5 is Q5_0's layout only (group 32, symmetric); a linear weight whose rows are not a
    multiple of 16 (or an embedding table) stores the same values as int8."""
    five = WeightScheme(5, 32, True, "f16")
    assert five.for_linear((64, 96)) == WeightScheme(5, 32, True, "f16", rows=16)
    assert five.for_linear((40, 96)) == WeightScheme(8, 32, True, "f16")
    assert five.row_by_row() == WeightScheme(8, 32, True, "f16")
    assert five.for_linear((64, 96)).stored_shapes((64, 96)) == {"qweight": (4, 960), "scale": (4, 3, 16)}
    for bad in (dict(group=64), dict(symmetric=False)):
        with pytest.raises(QuantizationError, match="Q5_0"):
            WeightScheme(**{**dict(bits=5, group=32, symmetric=True, scale_dtype="f16"), **bad})


@pytest.mark.parametrize("spec, want", [
    ("int8", WeightScheme(8, 32, True, "f16")),
    ("int8:channel", WeightScheme(8, None, True, "f32")),
    ("int8:32", WeightScheme(8, 32, True, "f16")),
    ("int4", WeightScheme(4, 32, False, "f16")),
    ("int4:128", WeightScheme(4, 128, False, "f16")),
    ("INT4:64:asym", WeightScheme(4, 64, False, "f16")),
    ("int4:32:sym", WeightScheme(4, 32, True, "f16", "mse")),
    ("int4:64:sym:minmax", WeightScheme(4, 64, True, "f16", "minmax")),
])
def test_parse(spec, want):
    assert QuantConfig.parse(spec).scheme == want


@pytest.mark.parametrize("spec, match", [
    ("int3", "not a quantization spec"),
    ("int4:abc", "is not a number"),
    ("int4:32:wide", "must be asym or sym"),
    ("int4:32:asym:mse", "must be mse or minmax, after int4 sym"),
    ("int4:32:sym:best", "must be mse or minmax"),
    ("int8:32:asym", "asymmetric int8 is not supported"),
    ("int4:0", "even number"),
])
def test_parse_errors_say_what_to_use(spec, match):
    with pytest.raises(QuantizationError, match=match):
        QuantConfig.parse(spec)


def test_scheme_json_round_trip_and_older_manifests():
    for s in SCHEMES + [WeightScheme(4, 32, True, "f16", "mse")]:
        assert WeightScheme.from_json(s.to_json()) == s
    # manifests written before `rounding` existed read as minmax (what they were quantized with)
    old = {"scheme": "int4", "group": 32, "symmetric": True, "scale_dtype": "f16"}
    assert WeightScheme.from_json(old).rounding == "minmax"
    with pytest.raises(QuantizationError, match="int4 symmetric only"):
        WeightScheme(8, None, True, "f32", "mse")


def test_group_fits_the_input_dim():
    s = WeightScheme(4, 128)
    assert s.fitted(1536) is s
    assert s.fitted(576).group == 64        # SmolLM2's hidden size: 576 = 9 * 64
    assert s.fitted(100).group == 128       # nothing fits: left for check_shape to refuse


def test_shape_errors_name_the_weight():
    with pytest.raises(QuantizationError, match=r"blk\.0: input dim 48 is not a multiple of group 32"):
        primitives.quantize(np.zeros((4, 48), np.float32), WeightScheme(4, 32), where="blk.0")
    with pytest.raises(QuantizationError, match="int4 needs a group size"):
        WeightScheme(4, None)
