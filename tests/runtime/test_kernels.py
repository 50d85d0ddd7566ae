"""The CPU kernels (runtime/kernels/) against the portable decompositions they replace.

Tolerances: outputs are softmax-weighted averages of O(1) values (standard normal K/V), summed
in f32 in a different order (and with a polynomial exp of relative error < 2e-7), so both sides
agree to a few f32 ulps of O(1): 1e-5 absolute leaves room for sums over up to a few hundred
positions without hiding a wrong position or mask (which moves outputs by O(0.1)).
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites import layer_linear as layer_linear_ops
from hloserve.exporter.composites import paged_attention as paged_attention_ops
from hloserve.exporter.composites.paged_attention import paged_attention_reference, paged_attention_reference_v2
from hloserve.runtime import kernels
from hloserve.runtime.kernels.cpu import build
from hloserve.runtime.kernels.cpu.targets import TARGETS
from hloserve.runtime.paths import kernel_dir
from hloserve.runtime.artifact.kernels import PAGED_ATTENTION, PAGED_ATTENTION_V2, Holds

BS = 8


def _case(rng, G, D, holds, L=3, KV=2, S=4, B=6, chunk=False):
    N = S * B + 1
    lens = np.array([1, 9, B * BS, 20], np.int32)[:S]               # one block, a partial one, full, two
    tables = np.zeros((S, B), np.int32)
    for s in range(S):
        used = -(-lens[s] // BS)
        tables[s, :used] = 1 + rng.permutation(N - 1)[:used]        # blocks anywhere in the cache
    cache = rng.standard_normal((L, 2, KV, N, BS, D)).astype(np.float32)
    if holds == Holds.INT8_ROWS:     # int8 rows [.., D + 2], each with its scale
        cache = paged_attention_ops.quantize_int8_rows(torch.from_numpy(cache)).numpy()
    elif holds == Holds.INT8_ZP_ROWS:    # int8 rows [.., D + 3]: scale and zero point; rows of one sign too
        cache[..., ::3, :] = np.abs(cache[..., ::3, :]) + 0.5
        cache = paged_attention_ops.quantize_int8_zp_rows(torch.from_numpy(cache)).numpy()
    elif holds == Holds.FP8_E4M3_ROWS:   # fp8 rows [.., D + 2]; tiny channels reach e4m3's subnormals
        cache[..., 1::7] *= 1e-4
        cache = paged_attention_ops.quantize_fp8_e4m3_rows(torch.from_numpy(cache)).numpy()
    elif holds:
        cache = np.asarray(jnp.asarray(cache).astype(jnp.bfloat16 if holds == 1 else jnp.float16).view(jnp.int16))
    # decode tokens, a prefill chunk of sequence 2, and one padding token (context 0); with
    # `chunk`, sequence 2's chunk is 37 tokens (positions 11..47: three tiles of the kernel)
    seq = np.array([0, 1, 3, 2, 2, 2, 0], np.int32)
    pos = np.array([0, 8, 19, 40, 41, 47, 0], np.int32)
    if chunk:
        seq = np.array([0, 1, 3] + [2] * 37 + [0], np.int32)
        pos = np.array([0, 8, 19] + list(range(11, 48)) + [0], np.int32)
    ctx = lens.copy()
    pad = len(seq) - 1
    T = len(seq)
    q = rng.standard_normal((T, KV, G, D)).astype(np.float32)
    return [q, cache, np.int32(1), tables, seq, pos, ctx], pad


def _exported(args, window, holds, scale=None, softcap=0.0):
    D = np.shape(args[0])[-1]

    def f(*a):
        return _private.composite(paged_attention_reference, PAGED_ATTENTION.name, PAGED_ATTENTION.version)(
            *a, window=window, holds=holds, scale=np.float32(D ** -0.5 if scale is None else scale),
            softcap=np.float32(softcap))
    (t,) = export.symbolic_shape("T")
    shapes = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    for i in (0, 4, 5):
        shapes[i] = jax.ShapeDtypeStruct((t, *np.shape(args[i])[1:]), np.asarray(args[i]).dtype)
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


def _exported_v2(args, holds, scale=None, softcap=0.0):
    """Version 2 of paged attention (the window the last operand, s32[]) over `args` and a window,
    T symbolic."""
    D = np.shape(args[0])[-1]

    def f(*a):
        return _private.composite(paged_attention_reference_v2, PAGED_ATTENTION_V2.name, PAGED_ATTENTION_V2.version)(
            *a, holds=holds, scale=np.float32(D ** -0.5 if scale is None else scale), softcap=np.float32(softcap))
    (t,) = export.symbolic_shape("T")
    shapes = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in (*args, np.int32(0))]
    for i in (0, 4, 5):
        shapes[i] = jax.ShapeDtypeStruct((t, *np.shape(args[i])[1:]), np.asarray(args[i]).dtype)
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


@pytest.fixture(scope="module")
def library():
    """The CPU backend (its library built for this machine)."""
    lib = build.library()
    if lib is None:
        pytest.skip("no C++ compiler here: the CPU kernels are off (the portable path is tested elsewhere)")
    return kernels.CpuBackend(lib)


def specialize(exp, backend):
    """(function, composites run as kernels) through `backend` (None: every decomposition)."""
    s = (backend or kernels.Decompositions()).specialize(exp)
    return s.exported, s.kernels


def max_rows(symbol: str, attrs: dict | None = None, shapes: tuple = ()) -> int | None:
    """The row limit this CPU's row of the targets table gives the kernel `symbol` (for a call with
    these attributes and operand shapes)."""
    return next(t for t in TARGETS.values() if t.symbol == symbol).limit(build.cpu(), attrs or {}, shapes)


def kernel_at_every_row_count(monkeypatch, contract):
    """The targets table's row for `contract` (a composite's name and version) without a row limit, for
    this test: every call runs the kernel."""
    monkeypatch.setitem(TARGETS, contract.key,
                        dataclasses.replace(TARGETS[contract.key], max_rows_for=lambda cpu, attrs, shapes: None))


# (G, D): specialized x4 (the fallback builds specialize these alone: paged_attention.h), generic
HEADS = [(3, 64), (4, 128), (4, 256), (1, 96), (5, 32)]
HOLDS = [0, 1, 2, 3, 4, 5]                                            # every cache element kind
SCORES = [(0, None, 0.0), (5, None, 0.0), (0, 0.3, 2.0)]             # (window, scale, softcap)


def _attention_cases():
    """Not the whole product (150 cases, each two XLA compiles), but every pair of values the code
    branches on: the short path is compiled per (cache kind, G, D), so every such triple, with the
    window/soft-cap cases spread over them; the 37-token chunk's tile is compiled per cache kind, so
    every kind with every window/soft-cap case, the head shapes spread over them. All pairs of the
    four parameters occur (checked below)."""
    short = [(gd, h, SCORES[(i + 2 * j) % 3], False) for i, gd in enumerate(HEADS) for j, h in enumerate(HOLDS)]
    chunk = [(HEADS[(j + k) % len(HEADS)], h, sc, True) for j, h in enumerate(HOLDS) for k, sc in enumerate(SCORES)]
    cases = short + chunk
    for a, b in itertools.combinations(range(4), 2):
        values = [sorted({repr(c[i]) for c in cases}) for i in (a, b)]
        assert {(repr(c[a]), repr(c[b])) for c in cases} == set(itertools.product(*values)), (a, b)
    return [pytest.param(gd[0], gd[1], h, *sc, ch, id=f"{'chunk37' if ch else 'short'}-{sc[0]}-{sc[1]}-{sc[2]}-{h}-"
                         f"{gd[0]}-{gd[1]}") for gd, h, sc, ch in cases]


@pytest.mark.parametrize("G,D,holds,window,scale,softcap,chunk", _attention_cases())
def test_paged_attention_kernel_matches_decomposition_and_torch(library, G, D, holds, window, scale, softcap, chunk):
    args, pad = _case(np.random.default_rng(G * 10 + holds), G, D, holds, chunk=chunk)
    exp = _exported(args, window, holds, scale, softcap)
    portable_fn, n_portable = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert (n_portable, n_kernel) == (0, 1)
    assert "custom_call @hloserve_paged_attention" in kernel_fn.mlir_module()
    assert "stablehlo.composite" in exp.mlir_module() and "stablehlo.composite" not in kernel_fn.mlir_module()
    portable = np.asarray(jax.jit(portable_fn.call)(*args))
    kernel = np.asarray(jax.jit(kernel_fn.call)(*args))
    ref = paged_attention_ops.paged_attention(*[torch.from_numpy(np.array(a)) for a in args], window, holds,
                                     D ** -0.5 if scale is None else scale, softcap).numpy()
    real = np.arange(len(args[4])) != pad                             # padding rows are unspecified
    np.testing.assert_allclose(portable[real], ref[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(kernel[real], ref[real], atol=1e-5, rtol=0)
    assert np.isfinite(kernel).all() and np.isfinite(portable).all()


@pytest.mark.parametrize("holds", [0, 1, 3, 4, 5])
@pytest.mark.parametrize("chunk", [False, True], ids=["short", "chunk37"])
def test_paged_attention_v2_reads_its_window_as_data(library, holds, chunk):
    """Version 2 (the window an s32[] operand): one compiled function, kernel and decomposition,
    for every window a layer may have (0: none, one inside a block, one past a block edge, one
    wider than every context), each equal to the torch reference with that window."""
    args, pad = _case(np.random.default_rng(7 + holds), 4, 64, holds, chunk=chunk)
    D = 64
    exp = _exported_v2(args, holds)
    portable_fn, n_portable = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert (n_portable, n_kernel) == (0, 1)
    assert "custom_call @hloserve_paged_attention_v2" in kernel_fn.mlir_module()
    portable, kernel = jax.jit(portable_fn.call), jax.jit(kernel_fn.call)
    real = np.arange(len(args[4])) != pad
    for window in (0, 5, 8, 100):
        ref = paged_attention_ops.paged_attention_windowed(*[torch.from_numpy(np.array(a)) for a in args],
                                                  torch.tensor(window, dtype=torch.int32), holds, D ** -0.5, 0.0)
        want = paged_attention_ops.paged_attention(*[torch.from_numpy(np.array(a)) for a in args], window, holds, D ** -0.5,
                                          0.0).numpy()
        np.testing.assert_array_equal(ref.numpy(), want)                 # the two torch forms agree
        np.testing.assert_allclose(np.asarray(portable(*args, np.int32(window)))[real], want[real], atol=1e-5,
                                   rtol=0, err_msg=f"window {window}")
        np.testing.assert_allclose(np.asarray(kernel(*args, np.int32(window)))[real], want[real], atol=1e-5, rtol=0,
                                   err_msg=f"kernel, window {window}")


@pytest.mark.parametrize("G,D", [(3, 64), (5, 32)])
def test_bf16_cache_token_computes_the_same_in_a_chunk_or_alone(library, G, D):
    """A bf16 cache: a prompt chunk's tokens (a 37-token chunk: on an AMX CPU a 32-token tile on AMX
    tiles and a 5-token tile on the f32 path) compute what each computes alone as a decode token
    (G = 3, D = 64: the specialized decode path; G = 5, D = 32: the generic one), within the f32
    sums' reordering (1e-5 for these O(1) softmax averages): every path computes in f32, so how a
    sequence is chunked moves no result by more (paged_attention_amx.h: a bf16 rounding there once
    moved every chunk token by ~1e-3 and changed greedy text across the prefix tiers)."""
    args, pad = _case(np.random.default_rng(11), G, D, Holds.BF16, chunk=True)
    fn = jax.jit(specialize(_exported(args, 0, Holds.BF16), library)[0].call)
    chunk = np.flatnonzero(args[4] == 2)                               # sequence 2's 37 tokens
    together = np.asarray(fn(*args))[chunk]
    alone = np.concatenate([np.asarray(fn(args[0][i:i + 1], *args[1:4], args[4][i:i + 1], args[5][i:i + 1],
                                          args[6]))[:1] for i in chunk])
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)


def test_kernel_sees_only_its_sequence(library):
    """Changing a block another sequence owns changes nothing; changing one of its own does."""
    args, pad = _case(np.random.default_rng(1), 3, 64, 0)
    fn = jax.jit(specialize(_exported(args, 0, 0), library)[0].call)
    base = np.asarray(fn(*args))
    cache = args[1].copy()
    cache[1, :, :, args[3][1, 0]] += 1.0                              # sequence 1's first block, layer 1
    moved = np.asarray(fn(args[0], cache, *args[2:]))
    rows_of_1 = args[4] == 1
    assert np.abs(moved[rows_of_1] - base[rows_of_1]).max() > 1e-2
    np.testing.assert_array_equal(moved[~rows_of_1 & (np.arange(len(args[4])) != pad)],
                                  base[~rows_of_1 & (np.arange(len(args[4])) != pad)])


def test_no_compiler_means_portable_path(tmp_path):
    """A machine without a working C++ compiler runs the decompositions, with one warning."""
    code = ("from hloserve.runtime.kernels.cpu import build; import logging; logging.basicConfig(); "
            "print('LIB', build.library())")
    env = {**os.environ, "HLOSERVE_CACHE": str(tmp_path), "HLOSERVE_KERNEL_CACHE": str(tmp_path / "kernels"),
           "CXX": "/bin/false"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LIB None" in out.stdout
    assert "could not be built" in out.stderr and "portable formulation" in out.stderr
    assert not list(tmp_path.rglob("*.so"))
    env["HLOSERVE_CPU_KERNELS"] = "0"
    env.pop("CXX")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "LIB None" in out.stdout and out.stderr == ""


def _linear_exported(weights, holds):
    from hloserve.exporter.composites.layer_linear import layer_linear_reference
    from hloserve.runtime.artifact.kernels import LAYER_LINEAR

    def f(x, w, layer):
        return _private.composite(layer_linear_reference, LAYER_LINEAR.name, LAYER_LINEAR.version)(x, w, layer,
                                                                                                      holds=holds)
    (m,) = export.symbolic_shape("M")
    shapes = [jax.ShapeDtypeStruct((m, weights.shape[2]), np.float32),
              jax.ShapeDtypeStruct(weights.shape, weights.dtype), jax.ShapeDtypeStruct((), np.int32)]
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


@pytest.mark.parametrize("holds,storage", [(1, "bits"), (1, "float"), (2, "bits")])
@pytest.mark.parametrize("K,N", [(64, 70), (72, 33)])               # K a whole vector or not; N % 4 != 0
def test_layer_linear_kernel_matches_decomposition_and_torch(library, holds, storage, K, N):
    """Up to the targets table's max_rows rows run the kernel, more rows the decomposition (one exported
    function, the branch chosen per compiled shape); both agree with torch's mixed_linear.

    Tolerance: x is rounded to the weights' 16-bit type on every side (exactly), so each product
    is exact in f32 and only the summation order differs: |error| <= K * 2^-24 * sum_k |x_k w_k|."""
    rng = np.random.default_rng(K + N + holds)
    dtype = jnp.bfloat16 if holds == 1 else jnp.float16
    values = jnp.asarray(rng.standard_normal((3, N, K)).astype(np.float32)).astype(dtype)
    weights = np.asarray(values.view(jnp.int16) if storage == "bits" else values)
    exp = _linear_exported(weights, holds)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_layer_linear" in kernel_fn.mlir_module()
    w32 = np.asarray(values.astype(jnp.float32))
    limit = max_rows("hloserve_layer_linear", {"holds": holds}, ((None, K), weights.shape, ()))
    for rows in (1, 3, 5, limit, limit + 1, 2 * limit + 3):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        layer = np.int32(rows % 3)
        kernel = np.asarray(jax.jit(kernel_fn.call)(x, weights, layer))
        portable = np.asarray(jax.jit(portable_fn.call)(x, weights, layer))
        wt = torch.from_numpy(np.array(weights).view(np.int16))
        wt = wt if storage == "bits" else wt.view(torch.bfloat16)
        ref = layer_linear_ops.layer_linear(torch.from_numpy(x), wt, torch.tensor(layer), holds).numpy()
        xr = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
        bound = K * 2.0 ** -24 * (np.abs(xr) @ np.abs(w32[layer]).T) + 1e-30
        for got in (kernel, portable):
            assert got.shape == (rows, N)
            assert (np.abs(got - ref) <= bound).all(), (rows, np.abs(got - ref).max(), bound.min())


@pytest.mark.parametrize("K,N", [(1000, 70), (2080, 40)])
def test_layer_linear_kernel_matches_at_prompt_chunk_rows(library, monkeypatch, K, N):
    """Prompt-chunk row counts, 128 to 2,048, through the kernel whatever the targets table's limit
    (on AMX: K in two and three runs of chunks with partial sums, a K that is no whole chunk, an
    odd last 16-row block; 4 whole 16-row matrix tiles and 6 rows past them, or 2 and 8); the same
    tolerance as above."""
    from hloserve.runtime.artifact.kernels import LAYER_LINEAR
    kernel_at_every_row_count(monkeypatch, LAYER_LINEAR)
    rng = np.random.default_rng(K + N)
    values = jnp.asarray(rng.standard_normal((2, N, K)).astype(np.float32)).astype(jnp.bfloat16)
    weights = np.asarray(values.view(jnp.int16))
    exp = _linear_exported(weights, 1)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_layer_linear" in kernel_fn.mlir_module()
    kernel_call, portable_call = jax.jit(kernel_fn.call), jax.jit(specialize(exp, None)[0].call)
    w32 = np.asarray(values.astype(jnp.float32))
    for rows in (128, 130, 300, 1000, 2048):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        layer = np.int32(rows % 2)
        kernel = np.asarray(kernel_call(x, weights, layer))
        portable = np.asarray(portable_call(x, weights, layer))
        xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
        bound = K * 2.0 ** -24 * (np.abs(xr) @ np.abs(w32[layer]).T) + 1e-30
        assert kernel.shape == (rows, N)
        assert (np.abs(kernel - portable) <= bound).all(), (rows, np.abs(kernel - portable).max(), bound.min())


@pytest.mark.parametrize("holds", [Holds.BF16, Holds.F16])
def test_layer_linear_kernel_gives_a_row_the_same_bits_alone_and_in_a_batch(library, holds):
    """Every path sums a row's products in one order whatever the row count: f16 matrices the widened
    path (AVX-512 tiles of 4 x 4 or the AVX2 loop), bf16 ones AMX tiles (each x row its own tile row),
    AVX512-BF16 tiles (4 x 4 or fewer rows, reduced in sum16's order: reduce16) or the widened path. So
    a row's outputs do not depend on the rows beside it (a batch-invariant step, where speculative
    decoding and batching pick the same greedy tokens whatever the step's size)."""
    rng = np.random.default_rng(7)
    K, N = 72, 37
    dtype = jnp.bfloat16 if holds == Holds.BF16 else jnp.float16
    values = jnp.asarray(rng.standard_normal((2, N, K)).astype(np.float32)).astype(dtype)
    weights = np.asarray(values.view(jnp.int16))
    kernel_fn, n_kernel = specialize(_linear_exported(weights, int(holds)), library)
    assert n_kernel == 1
    call = jax.jit(kernel_fn.call)
    limit = max_rows("hloserve_layer_linear", {"holds": int(holds)}, ((None, K), weights.shape, ()))
    x = rng.standard_normal((min(limit or 64, 64), K)).astype(np.float32)
    batch = np.asarray(call(x, weights, np.int32(1)))
    for rows in (1, 2, 3, 5):
        np.testing.assert_array_equal(np.asarray(call(x[:rows], weights, np.int32(1))), batch[:rows])


def test_a_batch_invariant_load_runs_the_kernel_past_its_row_limit(library):
    """Past the targets table's row limit a call runs XLA's dot, which sums in other orders than the
    kernel: `every_row_count` (runtime.load of a batch-invariant artifact) keeps the kernel there, so
    the rows of a long prompt chunk get the bits they get alone."""
    rng = np.random.default_rng(11)
    K, N = 72, 37
    values = jnp.asarray(rng.standard_normal((2, N, K)).astype(np.float32)).astype(jnp.bfloat16)
    weights = np.asarray(values.view(jnp.int16))
    exp = _linear_exported(weights, int(Holds.BF16))
    limit = max_rows("hloserve_layer_linear", {"holds": int(Holds.BF16)}, ((None, K), weights.shape, ()))
    if limit is None:
        pytest.skip("this CPU's layer_linear has no row limit for this shape")
    x = rng.standard_normal((limit + 9, K)).astype(np.float32)
    every = library.specialize(exp, every_row_count=True)
    assert every.kernels == 1 and every.digest != library.specialize(exp).digest
    call = jax.jit(every.exported.call)
    batch = np.asarray(call(x, weights, np.int32(1)))
    for r in (0, limit, limit + 8):
        np.testing.assert_array_equal(np.asarray(call(x[r:r + 1], weights, np.int32(1)))[0], batch[r])


def test_layer_linear_kernel_reads_only_its_layer(library):
    """Changing another layer's matrix changes nothing; changing the used one does."""
    rng = np.random.default_rng(3)
    weights = np.asarray(jnp.asarray(rng.standard_normal((3, 8, 64)).astype(np.float32)).astype(jnp.bfloat16)
                         .view(jnp.int16))
    fn = jax.jit(specialize(_linear_exported(weights, 1), library)[0].call)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    base = np.asarray(fn(x, weights, np.int32(1)))
    other = weights.copy()
    other[[0, 2]] = 0
    np.testing.assert_array_equal(np.asarray(fn(x, other, np.int32(1))), base)
    mine = weights.copy()
    mine[1] = 0
    assert np.abs(np.asarray(fn(x, mine, np.int32(1)))).max() == 0


# one run of chunks, three (partial sums); 13 tiles: decode rows' several tiles side by side and the rest
@pytest.mark.parametrize("K,N", [(64, 48), (1600, 32), (96, 208)])
def test_layer_linear_tiles_reads_b_tiles_as_layer_linear_reads_rows(library, monkeypatch, K, N):
    """`hloserve_layer_linear_tiles` over a stack laid out as B tiles (runtime/kernels/cpu/layouts.py,
    as runtime.load lays it out) gives layer_linear's kernel's bits at every row count where that
    kernel is AMX (decode rows and chunks: each output the same products summed in the same order;
    odd rows and blocks past M included), and elsewhere (AVX512-BF16's outer products, AVX2's widened
    ones, or a library without any: its portable loop) agrees with the decomposition within the summation bound of the
    tests above, each row's bits whatever the row count (each output summed in k's order)."""
    from hloserve.runtime.artifact.kernels import LAYER_LINEAR
    from hloserve.runtime.kernels.cpu import layouts
    from hloserve.runtime.kernels.cpu.targets import LAYER_LINEAR_TILES
    kernel_at_every_row_count(monkeypatch, LAYER_LINEAR)
    rng = np.random.default_rng(K + N)
    values = jnp.asarray(rng.standard_normal((2, N, K)).astype(np.float32)).astype(jnp.bfloat16)
    weights = np.asarray(values.view(jnp.int16))
    tiled = np.ascontiguousarray(layouts.B_TILES.arrange(weights)).view(weights.dtype).reshape(weights.shape)
    pairs = weights.reshape(2, N // 16, 16, K // 32, 16, 2)                  # [l, t, n, c, r, j]
    np.testing.assert_array_equal(tiled.reshape(2, N // 16, K // 32, 16, 16, 2), pairs.transpose(0, 1, 3, 4, 2, 5))
    assert not np.array_equal(tiled, weights) and np.array_equal(np.sort(tiled, None), np.sort(weights, None))
    exp = _linear_exported(weights, 1)
    tiles = library.specialize(exp, laid_out=frozenset({1}))
    assert tiles.kernels == 1 and f"custom_call @{LAYER_LINEAR_TILES}" in tiles.exported.mlir_module()
    assert tiles.digest != library.specialize(exp).digest
    amx = build.cpu().has("amx_bf16")
    offered = layouts.b_tiles_read(build.cpu())
    assert library.layouts(exp) == ({1: layouts.B_TILES} if offered else {})   # the stack: read by the composite only
    tiles_call = jax.jit(tiles.exported.call)
    rows_call = jax.jit(specialize(exp, library if amx else None)[0].call)
    w32 = np.asarray(values.astype(jnp.float32))
    x_all = rng.standard_normal((130, K)).astype(np.float32)
    for rows in (1, 2, 4, 5, 8, 12, 16, 17, 130):
        x = x_all[:rows]
        layer = np.int32(1)
        got = np.asarray(tiles_call(x, tiled, layer))
        np.testing.assert_array_equal(got[:1], np.asarray(tiles_call(x_all[:1], tiled, layer)), err_msg=f"{rows} rows")
        want = np.asarray(rows_call(x, weights, layer))
        assert got.shape == (rows, N)
        if amx:
            np.testing.assert_array_equal(got, want, err_msg=f"{rows} rows")
        else:
            xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
            bound = K * 2.0 ** -24 * (np.abs(xr) @ np.abs(w32[layer]).T) + 1e-30
            assert (np.abs(got - want) <= bound).all(), (rows, np.abs(got - want).max())


def test_a_stack_anything_else_reads_is_not_offered_a_layout(library):
    """layouts() offers a stack only where every reader is a layer_linear composite, followed through
    a loop over the layers (jax.lax.fori_loop: a while loop passing the stack on) and calls; a stack
    also read as it lies (here summed) keeps the artifact's layout, and so does an f16 one."""
    from hloserve.exporter.composites.layer_linear import layer_linear_reference
    from hloserve.runtime.artifact.kernels import LAYER_LINEAR
    from hloserve.runtime.kernels.cpu import layouts
    if not layouts.b_tiles_read(build.cpu()):
        pytest.skip("layouts are offered on CPUs with AMX, AVX512-BF16 or AVX2 and FMA only")
    linear = _private.composite(layer_linear_reference, LAYER_LINEAR.name, LAYER_LINEAR.version)

    def loop(x, w, v):          # w: every layer in a loop; v: the same, and summed
        def body(i, h):
            return linear(h, w, i, holds=1) + linear(h, v, i, holds=1)
        return jax.lax.fori_loop(0, w.shape[0], body, x), v.astype(jnp.float32).sum()

    stack = jax.ShapeDtypeStruct((3, 64, 64), np.int16)
    exp = export.export(jax.jit(loop), platforms=("cpu",))(jax.ShapeDtypeStruct((4, 64), np.float32), stack, stack)
    offered = library.layouts(exp)
    assert set(offered) == {1}, offered
    f16 = export.export(jax.jit(lambda x, w: _private.composite(layer_linear_reference, LAYER_LINEAR.name,
                                                                LAYER_LINEAR.version)(x, w, 0, holds=2)),
                        platforms=("cpu",))(jax.ShapeDtypeStruct((4, 64), np.float32), stack)
    assert library.layouts(f16) == {}


def _quant_exported(q, bits, group, version=1, **attrs):
    from hloserve.exporter.composites.quant_linear import (quant_linear_reference, quant_linear_v2_reference,
                                                           quant_linear_v6_reference)
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR

    reference = {1: quant_linear_reference, 6: quant_linear_v6_reference}.get(version, quant_linear_v2_reference)

    def f(x, qweight, scale, mn, layer):
        return _private.composite(reference, QUANT_LINEAR.name, version)(
            x, qweight, scale, mn, layer, bits=bits, group=group, **attrs)
    (m,) = export.symbolic_shape("M")
    K = q["scale"].shape[2] * group
    shapes = [jax.ShapeDtypeStruct((m, K), np.float32)] + [jax.ShapeDtypeStruct(q[r].shape, q[r].dtype)
                                                          for r in ("qweight", "scale", "min")]
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes, jax.ShapeDtypeStruct((), np.int32))


def _quantized_stack(rng, spec, L, N, K):
    """A stack of L random matrices [N, K] quantized with `spec` (schemes.QuantConfig): its stored
    tensors [L, ...] (scale [L, N, G]; min f32[0] when symmetric) and the scheme."""
    from hloserve.quantization import primitives
    from hloserve.quantization.schemes import QuantConfig
    scheme = QuantConfig.parse(spec).scheme.fitted(K)
    qa = primitives.quantize(rng.standard_normal((L, N, K)).astype(np.float32) * 0.1, scheme)
    group = scheme.group or K
    q = {"qweight": qa.qweight, "scale": qa.scale.reshape(L, N, K // group),
         "min": np.zeros((0,), np.float32) if qa.min is None else qa.min.reshape(L, N, K // group)}
    return q, scheme, group


QUANT_SPECS = ["int8:channel", "int8", "int4:32:sym", "int4:32", "int4:64"]   # per-channel f32; Q8_0; Q4_0; Q4_1


def test_quant_linear_v2_kernel_takes_int8_weights_at_both_ends_of_their_range(library, monkeypatch):
    """A checkpoint's int8 weights may hold -128 (compressed-tensors' symmetric int8 does; hloserve's
    own quantizer stops at -127), which a product that moves the weights' signs onto x (AVX2's
    vpmaddubsw path) must still multiply as -128: the kernel at every row count class (tiles of 3 and
    6 rows and their rests) against a float64 product of the same quantized x and weights, within the
    f32 bound of the test above."""
    from hloserve.quantization import primitives
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V2, quantize_blocks
    kernel_at_every_row_count(monkeypatch, QUANT_LINEAR_V2)
    rng = np.random.default_rng(128)
    L, N, K, group = 2, 32, 128, 32
    qint = rng.integers(-128, 128, (L, N, K)).astype(np.int8)
    qint[:, :, ::3] = -128                                       # every third weight at the bottom end
    qint[:, :, 1::7] = 127
    scale = (rng.random((L, N, K // group)) * 0.01 + 0.001).astype(np.float32)
    qw, sc, _ = primitives.interleave_rows(qint, scale, None, 8)
    exp = _quant_exported({"qweight": qw, "scale": sc, "min": np.zeros((0,), np.float32)}, 8, group, 2)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_quant_linear_v2(" in kernel_fn.mlir_module()
    call = jax.jit(kernel_fn.call)
    w = qint[1].astype(np.float64) * np.repeat(scale[1], group, axis=1)          # [N, K]
    for rows in (1, 2, 3, 4, 7, 16):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x8 = quantize_blocks(x, np).astype(np.float64)
        got = np.asarray(call(x, qw, sc, np.zeros((0,), np.float32), np.int32(1)))
        want = x8 @ w.T
        bound = (K + 4 + 128) * 2.0 ** -24 * (np.abs(x8) @ np.abs(w).T) + 1e-30
        assert (np.abs(got - want) <= bound).all(), (rows, np.abs(got - want).max())


@pytest.mark.parametrize("spec", QUANT_SPECS)
@pytest.mark.parametrize("K,N,version", [(64, 70, 1), (96, 33, 1), (576, 17, 1),   # half chunks of 64 bytes; odd N
                                         (64, 48, 2), (96, 16, 2), (576, 64, 2)])  # 16 interleaved rows
def test_quant_linear_kernel_matches_decomposition_and_torch(library, spec, K, N, version):
    """The quantized linear kernel, the decomposition and the torch op (dequantize in f32, then a
    matmul with x quantized to int8 per block of 32) agree, up to the targets table's max_rows rows through the
    kernel and past it through the decomposition, on the layer asked for.

    Tolerance: every side quantizes x identically (the same f32 divisions and rounding) and the
    weights are the same f32 values; the kernel sums x8 q exactly per block as integers and then
    scales (sum_b d_b s_b sum_k xq_k q_k + sum_g c_g sum_k x8_k) where the others sum x8 (q s + m):
    the same terms in another association, so |error| <= (K + 4) 2^-24 sum_k |x8_k| (|q_k s_g| + |m_g|)
    (the kernel's unsigned offsets, 128 or 8 times the scale, add that many times |s| to the terms)."""
    from hloserve.quantization.modules import quantize_blocks, quantized_linear
    rng = np.random.default_rng(K + N + len(spec))
    q, scheme, group = _quantized_stack(rng, spec, 3, N, K)
    from hloserve.quantization import primitives
    stored = q
    if version == 2:
        qw, sc, mn = primitives.interleave_rows(q["qweight"], q["scale"], q["min"] if q["min"].size else None, scheme.bits)
        stored = {"qweight": qw, "scale": sc, "min": q["min"] if mn is None else mn}
    exp = _quant_exported(stored, scheme.bits, group, version)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    target = "hloserve_quant_linear" if version == 1 else "hloserve_quant_linear_v2"
    assert n_kernel == 1 and f"custom_call @{target}(" in kernel_fn.mlir_module()
    ints = (primitives.unpack_int4(q["qweight"], signed=scheme.symmetric) if scheme.bits == 4
            else q["qweight"]).astype(np.float32)                                       # [L, N, K]
    s = np.repeat(q["scale"].astype(np.float32), group, axis=2)                         # [L, N, K]
    m = np.repeat(q["min"].astype(np.float32), group, axis=2) if q["min"].size else np.zeros_like(s)
    limit = max_rows(target) or 64
    args = [stored["qweight"], stored["scale"], stored["min"]]
    # version 2 with AMX-INT8 (quant_linear.cc amx_rows): one tile of 16 rows (16; int4 widened block
    # by block), int8 a padded last tile (30), int4 one tile then VNNI rows (30), tiles then VNNI rows
    # (65, 131; int4 widened once per group); VNNI alone (1, 5)
    x_all = rng.standard_normal((131, K)).astype(np.float32)
    for rows in (1, 3, 5, limit, limit + 1, 2 * limit + 3) if version == 1 else (1, 5, 16, 30, 65, 131):
        x = rng.standard_normal((rows, K)).astype(np.float32) if version == 1 else x_all[:rows]
        layer = np.int32(rows % 3)
        kernel = np.asarray(jax.jit(kernel_fn.call)(x, *args, layer))
        if version == 2 and rows > 5 and max_rows(target) is None:
            # each row of x is quantized and summed on its own, and the AMX tiles sum the same integers
            # as the VNNI tiles and scale them alike: the rows the tiles take (16 and more) equal bit
            # for bit what a call of 5 rows (VNNI alone) gives them
            few = np.asarray(jax.jit(kernel_fn.call)(x[:5], *args, layer))
            np.testing.assert_array_equal(kernel[:5], few)
        portable = np.asarray(jax.jit(portable_fn.call)(x, *args, layer))
        t = [torch.from_numpy(np.ascontiguousarray(a)) for a in args]
        if version == 1:
            ref = quantized_linear(torch.from_numpy(x), t[0], t[1].reshape(3, N, -1) if group != K else t[1][..., 0],
                                   t[2] if q["min"].size else None, None, torch.tensor(layer), scheme.bits,
                                   scheme.group or 0).numpy()
        else:
            ref = quantized_linear(torch.from_numpy(x), t[0], t[1], t[2] if q["min"].size else None, None,
                                   torch.tensor(layer), scheme.bits, scheme.group or 0, 16).numpy()
        x8 = quantize_blocks(torch.from_numpy(x)).numpy()
        offset = 0 if q["min"].size else 128 if scheme.bits == 8 else 8
        terms = np.abs(ints[layer] * s[layer]) + np.abs(m[layer]) + offset * np.abs(s[layer])
        bound = (K + 4) * 2.0 ** -24 * (np.abs(x8) @ terms.T) + 1e-30
        for got in (kernel, portable):
            assert got.shape == (rows, N)
            assert (np.abs(got - ref) <= bound).all(), (rows, np.abs(got - ref).max(), bound.min())


def bf16_values(a):
    """f32 a rounded to bfloat16 (to nearest even), as float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)).astype(np.float64)


@pytest.mark.parametrize("spec", QUANT_SPECS)
@pytest.mark.parametrize("K,N", [(64, 48), (96, 16), (576, 64), (1536, 32)])   # 1536: two runs of K's chunks
def test_quant_linear_v6_kernel_rounds_chunks_to_bf16(library, monkeypatch, spec, K, N):
    """Version 6 (version 2's layout; from bf16_rows rows x and W = q * scale + min rounded to bf16):
    below bf16_rows rows the kernel and the decomposition compute version 2's product (x quantized per
    block of 32, version 2's bound); from there both compute r(x) r(W)^T, products exact in f32 and
    summed in f32 in any order: |error| <= K 2^-24 sum_k |r(x_k) r(w_k)| against a float64 product of
    the same rounded values. 63 / 64 rows are the boundary (a symbolic row count: the decomposition's
    conditional); 131 rows are whole and partial 16-row tiles, and each of their rows is computed on
    its own (its first 64 equal a 64-row call's bit for bit). Every row count runs the kernel, whatever
    the targets table's limit (the fallback builds' table stops at 4 rows: their chunk paths, the
    row routines, are tested here too), with the artifact's bf16_rows; and with this CPU's (targets.py:
    raised past every call without AMX), where chunks get version 2's product."""
    from hloserve.quantization import primitives
    from hloserve.quantization.modules import quantize_blocks
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V6
    kernel_at_every_row_count(monkeypatch, QUANT_LINEAR_V6)
    rng = np.random.default_rng(K + N + len(spec) + 6)
    q, scheme, group = _quantized_stack(rng, spec, 3, N, K)
    qw, sc, mn = primitives.interleave_rows(q["qweight"], q["scale"], q["min"] if q["min"].size else None, scheme.bits)
    args = [qw, sc, q["min"] if mn is None else mn]
    exp = _quant_exported(dict(zip(("qweight", "scale", "min"), args)), scheme.bits, group, version=6, bf16_rows=64)
    portable_fn, _ = specialize(exp, None)
    this_cpu_fn, _ = specialize(exp, library)
    raised = "bf16_rows" in TARGETS[QUANT_LINEAR_V6.key].attributes_for(build.cpu(), {})
    cpu = build.cpu()
    assert raised == (not cpu.has("amx_bf16") and (cpu.has("avx512_vnni") or cpu.has("avx2")))
    monkeypatch.setitem(TARGETS, QUANT_LINEAR_V6.key,
                        dataclasses.replace(TARGETS[QUANT_LINEAR_V6.key], attributes_for=lambda cpu, attrs: {}))
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_quant_linear_v6(" in kernel_fn.mlir_module()
    ints = (primitives.unpack_int4(q["qweight"], signed=scheme.symmetric) if scheme.bits == 4
            else q["qweight"]).astype(np.float32)                                       # [L, N, K]
    s = np.repeat(q["scale"].astype(np.float32), group, axis=2)
    m = np.repeat(q["min"].astype(np.float32), group, axis=2) if q["min"].size else np.zeros_like(s)

    def expected(x, layer, bf16: bool):
        """(the product, its bound): version 2's, or from bf16_rows rows r(x) r(W)^T"""
        if not bf16:
            x8 = quantize_blocks(torch.from_numpy(x)).numpy().astype(np.float64)
            offset = 0 if q["min"].size else 128 if scheme.bits == 8 else 8
            terms = np.abs(ints[layer] * s[layer]) + np.abs(m[layer]) + offset * np.abs(s[layer])
            return (x8 @ (ints[layer] * s[layer] + m[layer]).astype(np.float64).T,
                    (K + 4) * 2.0 ** -24 * (np.abs(x8) @ terms.T) + 1e-30)
        xr, wr = bf16_values(x), bf16_values(ints[layer] * s[layer] + m[layer])        # W in f32, then rounded
        return xr @ wr.T, K * 2.0 ** -24 * (np.abs(xr) @ np.abs(wr).T) + 1e-30

    x_all = rng.standard_normal((131, K)).astype(np.float32)
    results = {}
    for rows in (1, 16, 63, 64, 131):
        x, layer = x_all[:rows], np.int32(rows % 3)
        for name, fn, bf16 in (("kernel", kernel_fn, rows >= 64), ("decomposition", portable_fn, rows >= 64),
                               ("this CPU's kernel", this_cpu_fn, rows >= 64 and not raised)):
            want, bound = expected(x, layer, bf16)
            got = np.asarray(jax.jit(fn.call)(x, *args, layer))
            assert got.shape == (rows, N)
            assert (np.abs(got - want) <= bound).all(), (name, rows, np.abs(got - want).max(), bound.min())
            results[name, rows] = got
    # the chunk path's rows do not depend on how many there are (131 rows at layer 2, 64 at layer 1)
    again = np.asarray(jax.jit(kernel_fn.call)(x_all, *args, np.int32(1)))
    np.testing.assert_array_equal(again[:64], results["kernel", 64])


def five_bit_stack(rng, L, N, K, f16=True):
    """A stack of L random [N, K] matrices of 5-bit values (GGUF Q5_0's: q in [-16, 15], a scale per 32
    elements, f16 as the file's d or f32): (q int8 [L, N, K], scale [L, N, K/32], version 4's stored
    qweight [L, N/16, 10 K] and scale [L, N/16, K/32, 16])."""
    from hloserve.quantization import primitives
    q = rng.integers(-16, 16, (L, N, K)).astype(np.int8)
    q[:, :, :32] = rng.choice([-16, 15], (L, N, 32))                                   # both extremes' bits
    scale = (rng.uniform(0.002, 0.02, (L, N, K // 32)) * rng.choice([-1, 1], (L, N, K // 32)))
    scale = scale.astype(np.float16 if f16 else np.float32)
    qw, sc, _ = primitives.interleave_rows(q, scale, None, 5)
    return q, scale, qw, sc


@pytest.mark.parametrize("K,N,f16", [(32, 16, True), (96, 48, False), (576, 64, True)])
def test_quant_linear_v4_kernel_matches_decomposition_and_torch(library, K, N, f16):
    """Version 4 (5-bit values, GGUF Q5_0 kept): the kernel, the decomposition and the torch op agree
    with a float64 product of the same values at every row count class (VNNI tiles of 6 rows and the
    rests; the portable loop on builds without VNNI), on the layer asked for. Bound as version 2's:
    the same integer block sums (here of u = q + 16 with the offset -16 sum(xq) started in) scaled in
    another association, |error| <= (K + 4) 2^-24 sum_k |x8_k| (|q_k s| + 16 |s|)."""
    from hloserve.quantization.modules import quantize_blocks, quantized_linear
    rng = np.random.default_rng(K + N)
    q, scale, qw, sc = five_bit_stack(rng, 3, N, K, f16)
    mn = np.zeros((0,), np.float32)
    exp = _quant_exported({"qweight": qw, "scale": sc, "min": mn}, 5, 32, version=4)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    assert n_kernel == 1 and "custom_call @hloserve_quant_linear_v4(" in kernel_fn.mlir_module()
    s = np.repeat(scale.astype(np.float64), 32, axis=2)                                 # [L, N, K]
    for rows in (1, 2, 5, 6, 13, 40):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        layer = np.int32(rows % 3)
        x8 = quantize_blocks(torch.from_numpy(x)).numpy().astype(np.float64)
        want = x8 @ (q[layer] * s[layer]).T
        bound = (K + 4) * 2.0 ** -24 * (np.abs(x8) @ ((np.abs(q[layer]) + 16) * np.abs(s[layer])).T) + 1e-30
        ref = quantized_linear(torch.from_numpy(x), torch.from_numpy(qw), torch.from_numpy(sc), None, None,
                               torch.tensor(layer), 5, 32, 16).numpy()
        for name, fn in (("kernel", kernel_fn), ("decomposition", portable_fn)):
            got = np.asarray(jax.jit(fn.call)(x, qw, sc, mn, layer))
            assert got.shape == (rows, N)
            assert (np.abs(got - want) <= bound).all(), (name, rows, np.abs(got - want).max(), bound.min())
        assert (np.abs(ref - want) <= bound).all(), (rows, np.abs(ref - want).max())


def test_quant_linear_kernel_reads_only_its_layer_and_needs_whole_vectors(library):
    """Changing another layer's weights changes nothing, changing the used one does; groups that
    are not a multiple of 32 elements run the decomposition."""
    rng = np.random.default_rng(4)
    q, scheme, group = _quantized_stack(rng, "int4:32", 3, 8, 64)
    fn = jax.jit(specialize(_quant_exported(q, scheme.bits, group), library)[0].call)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    base = np.asarray(fn(x, q["qweight"], q["scale"], q["min"], np.int32(1)))
    other = {r: a.copy() for r, a in q.items()}
    for r in other:
        other[r][[0, 2]] = 0
    np.testing.assert_array_equal(np.asarray(fn(x, other["qweight"], other["scale"], other["min"], np.int32(1))), base)
    mine = {r: a.copy() for r, a in q.items()}
    mine["scale"][1], mine["min"][1] = 0, 0
    assert np.abs(np.asarray(fn(x, mine["qweight"], mine["scale"], mine["min"], np.int32(1)))).max() == 0
    q16, scheme16, _ = _quantized_stack(rng, "int4:16", 3, 8, 64)
    assert specialize(_quant_exported(q16, 4, 16), library)[1] == 0


def test_the_cache_key_names_what_each_composite_runs(library, monkeypatch):
    """The executable-cache key's kernel part (Specialized.digest) follows which kernels the
    composites call up to how many rows, not only the kernels' code: an executable compiled before a
    row limit or an `accepts` changed in targets.py is not found again (it would keep the old choice)."""
    from hloserve.runtime.artifact.kernels import QUANT_LINEAR
    q, scheme, group = _quantized_stack(np.random.default_rng(5), "int4:32", 3, 8, 64)
    exp = _quant_exported(q, scheme.bits, group)
    first = library.specialize(exp).digest
    assert first is not None and library.specialize(exp).digest == first
    row = TARGETS[QUANT_LINEAR.key]
    monkeypatch.setitem(TARGETS, QUANT_LINEAR.key, dataclasses.replace(row, max_rows=lambda cpu: 7))
    limited = library.specialize(exp)
    assert limited.kernels == 1 and limited.digest not in (first, None)
    monkeypatch.setitem(TARGETS, QUANT_LINEAR.key, dataclasses.replace(row, accepts=lambda attrs: False))
    assert library.specialize(exp).digest is None


def test_block_table_entries_outside_the_cache_are_an_error_not_a_read(library):
    """A table entry >= the cache's block count (or negative) in a block a token reads answers an
    error naming it; the same entry in a block no token reads (past its context) is not read."""
    args, _ = _case(np.random.default_rng(2), 3, 64, 0)
    fn = jax.jit(specialize(_exported(args, 0, 0), library)[0].call)
    N = args[1].shape[3]
    tables = args[3].copy()
    tables[0, 1:] = N + 5                        # sequence 0 has one block in use: the rest are never read
    np.asarray(fn(*args[:3], tables, *args[4:]))
    for bad in (N, -1, 1 << 30):
        tables = args[3].copy()
        tables[1, 1] = bad                       # sequence 1's second block (its context is 9 > BS tokens)
        with pytest.raises(Exception, match=f"block table entry {bad} .*outside the cache's {N} blocks"):
            np.asarray(fn(*args[:3], tables, *args[4:]))


LOAD_LIBRARY = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from hloserve.runtime import kernels
from hloserve.runtime.kernels.cpu import build
from hloserve.runtime.kernels.cpu.targets import TARGETS
lib = build.library()
print("LOADED", lib.path if lib else None)
"""


def test_the_kernel_library_is_loaded_only_as_built(tmp_path):
    """The library runs in the process: its bytes are checked against the record written when it
    was built; a replaced library, or one without its record, is rebuilt (with one warning), and a
    cache directory others may write is not loaded from at all."""
    from tests.runtime.conftest import run_python
    env = {"HLOSERVE_CACHE": str(tmp_path / "cache"), "HLOSERVE_KERNEL_CACHE": str(tmp_path / "cache" / "kernels")}
    built = build.library()       # this run's build, placed where a fresh cache root keeps it
    if built is None:
        pytest.skip("no C++ compiler here")
    own = tmp_path / "cache" / "kernels" / os.path.relpath(built.path, kernel_dir())
    own.parent.mkdir(parents=True)
    for suffix in ("", ".json"):
        shutil.copyfile(built.path + suffix, str(own) + suffix)
    # the objects the build kept: the rebuilds below link them (the next test compiles)
    if os.path.isdir(os.path.join(kernel_dir(), "objects")):
        shutil.copytree(os.path.join(kernel_dir(), "objects"), tmp_path / "cache" / "kernels" / "objects")
    first = run_python(LOAD_LIBRARY, env=env)
    path = first.split("LOADED ")[-1].strip()
    assert path == str(own) and "rebuilding" not in first, first
    good = open(path, "rb").read()
    noise = os.urandom(4096)
    with open(path, "wb") as f:   # replaced (noise here; anything written with the right owner)
        f.write(noise)
    out = run_python(LOAD_LIBRARY, env=env)
    assert "sha256 mismatch" in out and f"LOADED {path}" in out, out
    rebuilt = open(path, "rb").read()
    assert rebuilt != noise and len(rebuilt) > 0.5 * len(good)   # rebuilt, and its record names these bytes
    assert build._check_built(path, json.load(open(path + ".json"))["key"]) is None
    key = json.load(open(path + ".json"))["key"]
    os.remove(path + ".json")    # refused the same way, so rebuilt as above (not run again)
    assert build._check_built(path, key) == "its build record is unreadable (FileNotFoundError)"
    os.chmod(tmp_path / "cache" / "kernels", 0o777)
    out = run_python(LOAD_LIBRARY, env=env)
    assert "writable by group or others" in out and "LOADED None" in out, out


CHANGED_SOURCES = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from hloserve.runtime.kernels.cpu import build
build.HERE = {here!r}
lib = build.library()
print("LOADED", lib.path if lib else None)
"""


def test_a_changed_kernel_file_alone_is_compiled_again(tmp_path):
    """Each .cc's object is kept beside the libraries, keyed by that file, the headers and the
    toolchain, with a record of its bytes: a build after one file changed (row_sum.cc, a comment
    added, in a copy of the sources) with one kept object damaged compiles those two files, links
    the objects this run's build kept, and loads."""
    from tests.runtime.conftest import run_python
    if build.library() is None:
        pytest.skip("no C++ compiler here")
    if not os.path.isdir(os.path.join(kernel_dir(), "objects")):
        pytest.skip("this test cache's library was built before objects were kept (a fresh HLOSERVE_TEST_CACHE runs it)")
    here = tmp_path / "src"
    shutil.copytree(build.HERE, here, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    with open(here / "row_sum.cc", "a") as f:
        f.write("\n// changed\n")
    root = tmp_path / "cache" / "kernels"
    root.mkdir(parents=True)
    shutil.copytree(os.path.join(kernel_dir(), "objects"), root / "objects")
    kept = sorted((root / "objects").glob("*.o"))
    names = build.object_names(build.find_compiler())      # this build's (not earlier sources') objects
    current = [p for p in kept if p.name in {v for k, v in names.items() if k != "row_sum.cc"}]
    current[0].write_bytes(os.urandom(4096))    # its record names other bytes: compiled again
    out = run_python(CHANGED_SOURCES.format(here=str(here)),
                     env={"HLOSERVE_CACHE": str(tmp_path / "cache"), "HLOSERVE_KERNEL_CACHE": str(root)})
    files = len(glob.glob(os.path.join(here, "*.cc")))
    assert f"compiling 2 of {files} files" in out and "LOADED None" not in out, out
    assert str(root) in out.split("LOADED ")[-1]
    assert len(list((root / "objects").glob("*.o"))) == len(kept) + 1    # the changed file's object kept too
    assert build._check_built(str(current[0]), json.load(open(f"{current[0]}.json"))["key"]) is None   # rewritten


WAIT_THEN_LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from hloserve.runtime.kernels.cpu import build
print("START", flush=True)
lib = build.library()
print("LOADED", lib.path if lib else None)
"""


def test_processes_starting_together_build_the_library_once(tmp_path, monkeypatch):
    """Two processes that need the library while neither finds it built (replicas starting on one
    cache, the suite's workers): one builds it (here only a link: every object is kept), the other
    waits on the build's lock and loads what the first built. The test holds that lock until both
    have started asking, so neither can finish before the other begins."""
    import time
    from hloserve.runtime.paths import made_once
    from tests.runtime.conftest import REPO
    if build.library() is None:
        pytest.skip("no C++ compiler here")
    if not os.path.isdir(os.path.join(kernel_dir(), "objects")):
        pytest.skip("this test cache's library was built before objects were kept (a fresh HLOSERVE_TEST_CACHE runs it)")
    root = tmp_path / "cache" / "kernels"
    root.mkdir(parents=True)
    shutil.copytree(os.path.join(kernel_dir(), "objects"), root / "objects")
    env = dict(os.environ, HLOSERVE_CACHE=str(tmp_path / "cache"), HLOSERVE_KERNEL_CACHE=str(root),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    key = build._key(build.find_compiler())
    path = str(root / key[:24] / "libhloserve_cpu.so")
    monkeypatch.setenv("HLOSERVE_CACHE", str(tmp_path / "cache"))     # the lock the children take
    with made_once(path):
        procs = [subprocess.Popen([sys.executable, "-c", WAIT_THEN_LOAD], stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=REPO) for _ in range(2)]
        for proc in procs:
            assert proc.stdout.readline().strip() == "START"
        time.sleep(3.0)     # both are in library() by now, waiting on the lock this test holds
        assert all(proc.poll() is None for proc in procs) and not os.path.exists(path)
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    assert sum("CPU kernels: compiling 0 of" in out for out in outs) == 1, outs    # one linked it
    assert all(out.split("LOADED ")[-1].strip() == path for out in outs), outs
