"""The accelerator kernels' tile paths for prompt chunks (runtime/kernels/pallas/gpu.py and tpu.py
`tiled`): tiles of TILE_ROWS rows of one sequence x G heads scored against each K/V block with a
matrix product, decode rows and chunks in one call, run in Pallas interpret mode on this CPU against
the composite's decomposition, and lowered for their platforms without the device (Triton IR; Mosaic
MLIR in a tpu_custom_call; compiling them needs the device).

Tolerance: as tests/runtime/test_accelerator_kernels.py, 1e-5 absolute (softmax-weighted averages of
O(1) values, f32 sums in another order); a wrong block, row or mask moves outputs by O(0.1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from hloserve.exporter.composites.paged_attention import paged_attention_reference
from hloserve.runtime.artifact.kernels import Holds
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import gpu as pallas_gpu
from hloserve.runtime.kernels.pallas import tpu as pallas_tpu
from hloserve.runtime.kernels.pallas.paged import PagedParams

BS = 16   # the Triton tile path's matrix products need 16 or more per dimension
KERNELS = {"tpu": pallas_tpu, "cuda": pallas_gpu}


def _mixed_step(rng, G, D, holds, KV=2, S=4, B=5):
    """One step mixing prompt chunks and decode rows of 4 sequences, rows interleaved (the contract
    does not order them): a 37-token chunk of sequence 2 across three block edges (positions 11..47),
    a 20-token chunk of sequence 0 (positions 44..63, its context 64 = 4 full blocks), decode rows of
    sequences 1 and 3, and a row of sequence 3 at position 0."""
    N = S * B + 1
    lens = np.array([64, 9, 48, 20], np.int32)
    tables = np.zeros((S, B), np.int32)
    for s in range(S):
        used = -(-lens[s] // BS)
        tables[s, :used] = 1 + rng.permutation(N - 1)[:used]
    cache = rng.standard_normal((3, 2, KV, N, BS, D)).astype(np.float32)
    if holds:
        cache = np.asarray(jnp.asarray(cache).astype(jnp.bfloat16 if holds == Holds.BF16 else jnp.float16)
                           .view(jnp.int16))
    rows = [(2, p) for p in range(11, 48)] + [(0, p) for p in range(44, 64)] + [(1, 8), (3, 19)]
    order = rng.permutation(len(rows))
    seq = np.array([rows[i][0] for i in order] + [3], np.int32)
    pos = np.array([rows[i][1] for i in order] + [0], np.int32)
    q = rng.standard_normal((len(seq), KV, G, D)).astype(np.float32)
    return [q, cache, np.int32(1), tables, seq, pos, lens], len(seq)


def _reference(args, params):
    return np.asarray(paged_attention_reference(*map(jnp.asarray, args), window=params.window, holds=params.holds,
                                                scale=np.float32(params.scale), softcap=np.float32(params.softcap)))


# (G, D, holds, window, softcap): GQA groups of 1, 3 (padded to 4) and 4; f32, bf16 and f16 caches;
# sliding windows inside and across blocks; soft-capping
CASES = [(1, 16, 0, 0, 0.0), (3, 32, 1, 5, 0.0), (4, 16, 2, 0, 2.0), (2, 32, 1, 20, 1.5)]


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("G,D,holds,window,softcap", CASES)
def test_tile_path_matches_the_decomposition_in_interpret_mode(platform, G, D, holds, window, softcap):
    args, pad = _mixed_step(np.random.default_rng(G * 10 + holds), G, D, holds)
    params = PagedParams(window=window, holds=holds, scale=D ** -0.5, softcap=softcap)
    got = np.asarray(KERNELS[platform].tiled(*map(jnp.asarray, args), params=params, interpret=True))
    want = _reference(args, params)
    assert got.shape == want.shape == (len(args[4]), 2, G, D)
    np.testing.assert_allclose(got[:pad], want[:pad], atol=1e-5, rtol=0)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_steps_with_more_rows_than_sequences_take_the_tile_path(platform):
    """paged_attention dispatches on static shapes: rows > sequences (and, for Triton, 16-wide
    tiles) -> tiles; a decode step keeps the per-row grid."""
    kernel = KERNELS[platform]
    args, pad = _mixed_step(np.random.default_rng(5), 2, 16, 0)
    params = PagedParams(window=0, holds=0, scale=0.25, softcap=0.0)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    text = jax.jit(lambda *a: kernel.paged_attention(*a, params=params, interpret=True)).trace(*avals).jaxpr
    assert "hloserve_paged_attention_tiles" in str(text)
    decode = [args[0][:4], args[1], args[2], args[3], np.array([0, 1, 2, 3], np.int32),
              np.array([63, 8, 47, 19], np.int32), args[6]]
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in decode]
    text = jax.jit(lambda *a: kernel.paged_attention(*a, params=params, interpret=True)).trace(*avals).jaxpr
    assert "hloserve_paged_attention_tiles" not in str(text)
    got = np.asarray(kernel.paged_attention(*map(jnp.asarray, decode), params=params, interpret=True))
    np.testing.assert_allclose(got, _reference(decode, params), atol=1e-5, rtol=0)


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_tile_path_with_tiles_of_more_rows_than_a_chunk(platform):
    """Tiles larger than any sequence's rows (64): each sequence is one tile, padding tiles do nothing."""
    args, pad = _mixed_step(np.random.default_rng(9), 2, 16, 1)
    params = PagedParams(window=7, holds=1, scale=0.25, softcap=0.0)
    got = np.asarray(KERNELS[platform].tiled(*map(jnp.asarray, args), params=params, interpret=True, tile_rows=64))
    np.testing.assert_allclose(got[:pad], _reference(args, params)[:pad], atol=1e-5, rtol=0)


def test_tile_path_lowers_for_cuda_without_the_device():
    """jax lowers the tile kernel to Triton IR on a CPU-only jaxlib (Pallas's Triton lowering runs
    here): one Triton custom call."""
    args, _ = _mixed_step(np.random.default_rng(0), 4, 64, 1)
    params = PagedParams(window=5, holds=1, scale=0.125, softcap=2.0)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(lambda *a: pallas_gpu.tiled(*a, params=params)),
                        platforms=("cuda",), disabled_checks=checks)(*avals)
    assert accelerators.kernels_in(exp) == {"__gpu$xla.gpu.triton": 1}


@pytest.mark.parametrize("holds", [1, 4, 5])
def test_tile_path_lowers_for_tpu_without_the_device(holds):
    """jax lowers the TPU tile kernel to Mosaic on a CPU-only jaxlib (Pallas's Mosaic lowering runs
    here; compiling it needs a TPU): one tpu_custom_call, for a bf16 cache and for int8 (zero point)
    and fp8 rows, whose D + 3 / D + 2 columns a Mosaic block takes whole."""
    args, _ = _mixed_step(np.random.default_rng(0), 4, 64, 1 if holds == 1 else 0)
    if holds != 1:   # the rows' bytes: values and the scale's bits; what they hold does not matter to lowering
        args[1] = np.zeros((*args[1].shape[:-1], 64 + (3 if holds == Holds.INT8_ZP_ROWS else 2)), np.int8)
    params = PagedParams(window=5, holds=holds, scale=0.125, softcap=2.0)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    exp = export.export(jax.jit(lambda *a: pallas_tpu.tiled(*a, params=params)), platforms=("tpu",))(*avals)
    assert accelerators.kernels_in(exp) == {"tpu_custom_call": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,holds,window,softcap", CASES)
def test_tile_path_compiled_by_triton_matches_the_decomposition(G, D, holds, window, softcap):
    """The same steps compiled by Triton on a GPU (f32 products at highest precision, no TF32)."""
    if jax.default_backend() != "gpu":
        pytest.skip("the Triton kernel needs a GPU")
    args, pad = _mixed_step(np.random.default_rng(G * 10 + holds), G, D, holds)
    params = PagedParams(window=window, holds=holds, scale=D ** -0.5, softcap=softcap)
    got = np.asarray(jax.jit(lambda *a: pallas_gpu.tiled(*a, params=params))(*map(jnp.asarray, args)))
    with jax.default_device(jax.devices("cpu")[0]):     # on the GPU its f32 einsums would take TF32
        want = _reference(args, params)
    np.testing.assert_allclose(got[:pad], want[:pad], atol=1e-5, rtol=0)
