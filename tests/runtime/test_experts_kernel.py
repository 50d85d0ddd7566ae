"""The grouped experts kernels (runtime/kernels/cpu/experts.cc) against the composites' portable
decompositions and the torch references (exporter/composites/grouped_experts.py, quant_experts.py).

Tolerance: x and the activation are rounded to the matrices' 16-bit type on every side, so the
products are exact and the sums differ only in order, except that silu is computed by different
code (torch, XLA, the kernel's expf: a few f32 ulps apart), which can move an activation across a
16-bit rounding boundary: one ulp of the 16-bit type (2^-8 relative for bf16, 2^-11 for f16) of
that activation's product. So each output element is bounded by 2^-8 times the sum of its
products' magnitudes, |weights| |down| |a|, plus the f32 summation bound; a wrong expert, slot or
row moves an element by the size of its products (O(1) relative).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites import grouped_experts as ops
from hloserve.exporter.composites import quant_experts as qops
from hloserve.quantization import modules as qmodules
from hloserve.runtime.artifact.kernels import GROUPED_EXPERTS, QUANT_EXPERTS

from .test_kernels import library, specialize  # noqa: F401 - the module's fixture

L, E, D, F = 2, 6, 64, 40          # F: not a whole number of 32-element vectors


def _exported(gate_up, down, k, holds):
    def f(*a):
        return _private.composite(ops.grouped_experts_reference, GROUPED_EXPERTS.name, GROUPED_EXPERTS.version)(
            *a, holds=holds)
    (t,) = export.symbolic_shape("T")
    shapes = [jax.ShapeDtypeStruct((t, D), np.float32), jax.ShapeDtypeStruct((t, k), np.int32),
              jax.ShapeDtypeStruct((t, k), np.float32), jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
              jax.ShapeDtypeStruct(down.shape, down.dtype), jax.ShapeDtypeStruct((), np.int32)]
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


def _stacks(rng, holds, storage):
    dtype = jnp.bfloat16 if holds == 1 else jnp.float16
    values = [jnp.asarray(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1])).astype(dtype)
              for s in ((L, E, 2 * F, D), (L, E, D, F))]
    stored = [np.asarray(v.view(jnp.int16) if storage == "bits" else v) for v in values]
    return stored, [np.asarray(v.astype(jnp.float32)) for v in values]


def _routing(rng, T, k, unused):
    """Each token's k distinct experts among the first E - unused (the others get no rows)."""
    index = np.stack([rng.permutation(E - unused)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return index, weights


def _bound(x, index, weights, gu, dn, layer, holds):
    """Per output element, over each token's slots: |w| |down| . (ulp |a| + 2 da) plus the f32
    summation bound of the down product, where a = silu(g) u and da bounds what the f32 sums of
    the gate_up product move it by (|silu'| <= 1.1, |silu(g)| <= |g|). x is taken as rounded."""
    ulp = 2.0 ** (-8 if holds == 1 else -11)
    F = dn.shape[-1]
    xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16 if holds == 1 else jnp.float16).astype(jnp.float32))
    total = np.zeros_like(x)
    for j in range(index.shape[1]):
        g = gu[layer][index[:, j]]                                          # [T, 2F, D]
        h = np.einsum("tnd,td->tn", g, xr)
        s = D * 2.0 ** -24 * np.einsum("tnd,td->tn", np.abs(g), np.abs(xr))
        a = np.abs(h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:])
        da = 1.1 * np.abs(h[:, F:]) * s[:, :F] + np.abs(h[:, :F]) * s[:, F:]
        total += np.abs(weights[:, [j]]) * np.einsum("tdf,tf->td", np.abs(dn[layer][index[:, j]]),
                                                     (ulp + F * 2.0 ** -24) * a + 2 * da)
    return total + 1e-6


@pytest.mark.parametrize("holds,storage", [(1, "bits"), (1, "float"), (2, "bits")])
@pytest.mark.parametrize("k", [1, 2])
def test_grouped_experts_kernel_matches_decomposition_and_torch(library, holds, storage, k):  # noqa: F811
    """At 1, 16 and 100 tokens (decode rows to a prompt chunk), with experts no token chose, the kernel,
    the decomposition and torch's eager reference agree within the bound above."""
    rng = np.random.default_rng(holds * 10 + k)
    (gate_up, down), (gu32, dn32) = _stacks(rng, holds, storage)
    exp = _exported(gate_up, down, k, holds)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_grouped_experts" in kernel_fn.mlir_module()
    for T, unused in ((1, 0), (16, 2), (100, 3)):
        x = rng.standard_normal((T, D)).astype(np.float32)
        index, weights = _routing(rng, T, k, unused)
        layer = np.int32(T % L)
        args = (x, index, weights, gate_up, down, layer)
        kernel = np.asarray(jax.jit(kernel_fn.call)(*args))
        portable = np.asarray(jax.jit(portable_fn.call)(*args))
        stored = [torch.from_numpy(np.array(w).view(np.int16)) for w in (gate_up, down)]
        stored = stored if storage == "bits" else [w.view(torch.bfloat16) for w in stored]
        ref = ops.grouped_experts(torch.from_numpy(x), torch.from_numpy(index), torch.from_numpy(weights), *stored,
                                  torch.tensor(layer), holds).numpy()
        bound = _bound(x, index, weights, gu32, dn32, layer, holds)
        assert np.abs(ref).max() > 0.1                                      # O(1) outputs: the bound is relative
        for name, got in (("kernel", kernel), ("decomposition", portable)):
            assert got.shape == (T, D)
            assert (np.abs(got - ref) <= bound).all(), (name, T, np.abs(got - ref).max(), bound.min())


def test_grouped_experts_kernel_reads_only_the_chosen_experts_of_its_layer(library):  # noqa: F811
    """Zeroing other layers' experts and the experts no token chose changes nothing; zeroing a chosen
    expert changes exactly the rows routed to it."""
    rng = np.random.default_rng(7)
    (gate_up, down), _ = _stacks(rng, 1, "bits")
    fn = jax.jit(specialize(_exported(gate_up, down, 2, 1), library)[0].call)
    x = rng.standard_normal((5, D)).astype(np.float32)
    index = np.array([[0, 1], [1, 2], [2, 0], [0, 1], [1, 0]], np.int32)
    weights = rng.uniform(0.1, 1.0, (5, 2)).astype(np.float32)
    base = np.asarray(fn(x, index, weights, gate_up, down, np.int32(1)))
    other_gu, other_dn = gate_up.copy(), down.copy()
    other_gu[0], other_dn[0] = 0, 0
    other_gu[1, 3:], other_dn[1, 3:] = 0, 0
    np.testing.assert_array_equal(np.asarray(fn(x, index, weights, other_gu, other_dn, np.int32(1))), base)
    mine = down.copy()
    mine[1, 2] = 0
    changed = np.abs(np.asarray(fn(x, index, weights, gate_up, mine, np.int32(1))) - base).max(-1) > 0
    np.testing.assert_array_equal(changed, (index == 2).any(-1))


def test_grouped_experts_tiles_reads_stacks_laid_out_as_b_tiles(library):  # noqa: F811
    """`hloserve_grouped_experts_tiles` over gate_up and down laid out as B tiles (layouts.py, as
    runtime.load lays them out) agrees with torch within the bound above at 1, 16 and 100 tokens (an
    expert's rows from one to dozens, experts with none), on AMX tiles or, in a library without them,
    AVX512-BF16's or AVX2's outer products, or its portable loop; layouts() offers both stacks where
    the build reads B tiles, and a stack also read otherwise withdraws its
    partner's offer (the kernel reads both as tiles or neither)."""
    from hloserve.runtime.kernels.cpu import build, layouts
    from hloserve.runtime.kernels.cpu.targets import GROUPED_EXPERTS_TILES
    F2 = 64                                                                  # F a multiple of 32
    rng = np.random.default_rng(11)
    values = [jnp.asarray(rng.standard_normal(sh).astype(np.float32) / np.sqrt(sh[-1])).astype(jnp.bfloat16)
              for sh in ((L, E, 2 * F2, D), (L, E, D, F2))]
    gate_up, down = (np.asarray(v.view(jnp.int16)) for v in values)
    gu32, dn32 = (np.asarray(v.astype(jnp.float32)) for v in values)
    tiled = [np.ascontiguousarray(layouts.B_TILES.arrange(w)).view(w.dtype).reshape(w.shape) for w in (gate_up, down)]
    pairs = gate_up.reshape(L, E, 2 * F2 // 16, 16, D // 32, 16, 2)          # [l, e, t, n, c, r, j]
    np.testing.assert_array_equal(tiled[0].reshape(L, E, 2 * F2 // 16, D // 32, 16, 16, 2),
                                  pairs.transpose(0, 1, 2, 4, 5, 3, 6))

    def f(*a):
        return _private.composite(ops.grouped_experts_reference, GROUPED_EXPERTS.name, GROUPED_EXPERTS.version)(
            *a, holds=1)
    (t,) = export.symbolic_shape("T")
    shapes = [jax.ShapeDtypeStruct((t, D), np.float32), jax.ShapeDtypeStruct((t, 2), np.int32),
              jax.ShapeDtypeStruct((t, 2), np.float32), jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
              jax.ShapeDtypeStruct(down.shape, down.dtype), jax.ShapeDtypeStruct((), np.int32)]
    exp = export.export(jax.jit(f), platforms=("cpu",))(*shapes)
    tiled_here = layouts.b_tiles_read(build.cpu())
    assert library.layouts(exp) == ({3: layouts.B_TILES, 4: layouts.B_TILES} if tiled_here else {})
    tiles = library.specialize(exp, laid_out=frozenset({3, 4}))
    assert tiles.kernels == 1 and f"custom_call @{GROUPED_EXPERTS_TILES}" in tiles.exported.mlir_module()
    with pytest.raises(ValueError, match="laid out"):
        library.specialize(exp, laid_out=frozenset({3}))
    call = jax.jit(tiles.exported.call)
    for T, unused in ((1, 0), (16, 2), (100, 3)):
        x = rng.standard_normal((T, D)).astype(np.float32)
        index, weights = _routing(rng, T, 2, unused)
        layer = np.int32(T % L)
        got = np.asarray(call(x, index, weights, *tiled, layer))
        ref = ops.grouped_experts(torch.from_numpy(x), torch.from_numpy(index), torch.from_numpy(weights),
                                  *(torch.from_numpy(w) for w in (gate_up, down)), torch.tensor(layer), 1).numpy()
        bound = _bound(x, index, weights, gu32, dn32, layer, 1)
        assert got.shape == (T, D) and np.abs(ref).max() > 0.1
        assert (np.abs(got - ref) <= bound).all(), (T, np.abs(got - ref).max(), bound.min())

    def shared(x, index, weights, gu, dn, layer):                           # down also summed as it lies
        return f(x, index, weights, gu, dn, layer), dn.astype(jnp.float32).sum()
    if tiled_here:
        assert library.layouts(export.export(jax.jit(shared), platforms=("cpu",))(*shapes)) == {}


# -- the quantized experts (hloserve.quant_experts) ---------------------------------------------------
# Tolerance: kernel, decomposition and torch quantize the rows of x alike (Q8_0, the same f32
# division and rounding), so the gate_up products differ only by the f32 sums (D 2^-24 of the
# products' magnitudes); those few ulps, and silu's, can move an element of the activation across a
# rounding boundary of its own block's quantization: by one step d (its block's max |a| / 127). So
# each output element is bounded by |weights| |down| . (d + 2 da) over each token's slots, plus the
# f32 sums of the down product; a wrong expert, slot, scale or nibble moves it by O(1) relative.
QF = 96    # the experts' inner dim: int8 a 64-byte chunk and a half one, int4 a 3/4 chunk


def _quant_stacks(rng, E, spec):
    """(stored tensors per matrix: qweight, scale [L, E, N, G], min or None), their float values,
    bits, and each matrix's group: gate_up [L, E, 2 QF, D] and down [L, E, D, QF] in --quantize `spec`."""
    from hloserve.quantization import primitives
    from hloserve.quantization.convert import quantize_tensor
    from hloserve.quantization.schemes import QuantConfig

    scheme = QuantConfig.parse(spec).scheme
    stored, values, groups = [], [], []
    for shape in ((L, E, 2 * QF, D), (L, E, D, QF)):
        w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1]))
        t, used = quantize_tensor(w, scheme, "w")
        q, s, m = (None if t.get(r) is None else t[r].numpy() for r in ("qweight", "scale", "min"))
        values.append(primitives.dequantize(primitives.QuantizedArray(q, s, m, used, shape)))
        s, m = (None if a is None else a.reshape(*q.shape[:-1], -1) for a in (s, m))   # per channel: G = 1
        stored.append((q, s, m))
        groups.append(used.group or shape[-1])
    return stored, values, scheme.bits, groups


def _quant_exported(stored, k, bits, groups):
    def f(*a):
        return _private.composite(qops.quant_experts_reference, QUANT_EXPERTS.name, QUANT_EXPERTS.version)(
            *a, bits=bits, gate_up_group=groups[0], down_group=groups[1])
    (t,) = export.symbolic_shape("T")
    none = jax.ShapeDtypeStruct((0,), np.float32)
    mats = [jax.ShapeDtypeStruct(a.shape, a.dtype) if a is not None else none for trio in stored for a in trio]
    shapes = [jax.ShapeDtypeStruct((t, D), np.float32), jax.ShapeDtypeStruct((t, k), np.int32),
              jax.ShapeDtypeStruct((t, k), np.float32), *mats, jax.ShapeDtypeStruct((), np.int32)]
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


def _quant_bound(x, index, weights, gu, dn, layer):
    """Per output element, over each token's slots: |w| |down| . (d + 2 da) plus the f32 sums of the
    down product, where d is the quantization step of the activation's block and da bounds what the
    f32 sums of the gate_up product move the activation by (|silu'| <= 1.1, |silu(g)| <= |g|)."""
    xq = qmodules.quantize_blocks(torch.from_numpy(x)).numpy()
    total = np.zeros_like(x)
    for j in range(index.shape[1]):
        g = gu[layer][index[:, j]]                                          # [T, 2QF, D]
        h = np.einsum("tnd,td->tn", g, xq)
        s = D * 2.0 ** -24 * np.einsum("tnd,td->tn", np.abs(g), np.abs(xq))
        a = h[:, :QF] / (1 + np.exp(-h[:, :QF])) * h[:, QF:]
        step = np.repeat(np.abs(a).reshape(len(a), -1, 32).max(-1) / 127, 32, axis=-1)   # [T, QF]
        da = 1.1 * np.abs(h[:, QF:]) * s[:, :QF] + np.abs(h[:, :QF]) * s[:, QF:]
        total += np.abs(weights[:, [j]]) * np.einsum("tdf,tf->td", np.abs(dn[layer][index[:, j]]),
                                                     step + 2 * da + QF * 2.0 ** -24 * np.abs(a))
    return total + 1e-6


@pytest.mark.parametrize("spec", ["int8", "int8:channel", "int4", "int4:32:sym"])
@pytest.mark.parametrize("E,k", [(6, 1), (6, 2), (16, 4)])
def test_quant_experts_kernel_matches_decomposition_and_torch(library, spec, E, k):  # noqa: F811
    """At 1, 16 and 100 tokens (decode rows to a prompt chunk), 6 or 16 experts with some no token
    chose, int8 (groups of 32, per channel) and int4 (asymmetric, symmetric): the kernel, the
    decomposition and torch's eager reference agree within the bound above."""
    rng = np.random.default_rng(E * 10 + k)
    stored, (gu32, dn32), bits, groups = _quant_stacks(rng, E, spec)
    exp = _quant_exported(stored, k, bits, groups)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_quant_experts" in kernel_fn.mlir_module()
    mats = [a if a is not None else np.zeros((0,), np.float32) for trio in stored for a in trio]
    for T, unused in ((1, 0), (16, 2), (100, 3)):
        x = rng.standard_normal((T, D)).astype(np.float32)
        index = np.stack([rng.permutation(E - unused)[:k] for _ in range(T)]).astype(np.int32)
        weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
        layer = np.int32(T % L)
        args = (x, index, weights, *mats, layer)
        kernel = np.asarray(jax.jit(kernel_fn.call)(*args))
        portable = np.asarray(jax.jit(portable_fn.call)(*args))
        tensors = [None if a is None else torch.from_numpy(a) for trio in stored for a in trio]
        ref = qops.quantized_experts(torch.from_numpy(x), torch.from_numpy(index), torch.from_numpy(weights),
                                     *tensors, torch.tensor(layer), bits, *groups).numpy()
        bound = _quant_bound(x, index, weights, gu32, dn32, layer)
        assert np.abs(ref).max() > 0.1                                      # O(1) outputs: the bound is relative
        for name, got in (("kernel", kernel), ("decomposition", portable)):
            assert got.shape == (T, D)
            assert (np.abs(got - ref) <= bound).all(), (name, T, np.abs(got - ref).max(), bound.min())
