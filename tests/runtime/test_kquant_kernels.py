"""GGUF K-quant blocks kept (`hloserve.quant_linear` version 3): the header decoding against gguf-py's
dequantization, bit for bit, in numpy, the torch op and the jax decomposition; the CPU kernel against
the decomposition and the torch op (the kernel built for a CPU without AVX-512, the portable loop, runs
these in tests/runtime/test_kernel_fallbacks.py's builds).

Blocks are random bytes with realistic f16 d / dmin (tests/support/kquants.py), so every 6-bit
sub-scale, min and quant pattern occurs."""
from __future__ import annotations


import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites import quant_linear as lowering
from hloserve.exporter.gguf import quant as gguf_quant
from hloserve.exporter.gguf.tensor import GGUFTensor
from hloserve.quantization import modules, primitives
from hloserve.quantization.schemes import WeightScheme
from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V3, Block
from tests.runtime.test_kernels import library, max_rows, specialize  # noqa: F401 - the fixture
from tests.support import kquants

KINDS = ("Q4_K", "Q5_K", "Q6_K")


def _tensor(kind: str, raw: np.ndarray, rows: int, cols: int) -> GGUFTensor:
    """A GGUFTensor over `raw` blocks (as exporter/gguf/checkpoint.py makes them from a file)."""
    t = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[t]
    return GGUFTensor(f"w.{kind}", f"blk.0.{kind}", kind, int(t), (rows, cols), block, size, raw, None, 0)


def _stack(kind: str, L: int, N: int, K: int, rng):
    """L random `kind` matrices [N, K] kept as blocks: (qweight [L, ...], blocks [L, ...], gguf's f32
    values [L, N, K], scheme)."""
    parts = [_tensor(kind, kquants.random_blocks(kind, N, K, rng), N, K) for _ in range(L)]
    kept = [gguf_quant.kept_blocks(t) for t in parts]
    q = np.stack([k[0]["qweight"] for k in kept])
    blocks = np.stack([k[0]["scale"] for k in kept])
    return q, blocks, np.stack([t.dequantize() for t in parts]), kept[0][1]


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", KINDS)
def test_kept_blocks_dequantize_as_gguf_does(kind):
    """numpy (primitives.dequantize_blocks), the torch op's and the decomposition's header decoding
    give gguf.quants.dequantize's values bit for bit; the stored tensors are the file's bytes
    repacked (as many quant bytes, Q4_K; header bytes as they are)."""
    rng = np.random.default_rng(len(kind))
    q, blocks, want, scheme = _stack(kind, 1, 40, 512, rng)
    assert scheme == WeightScheme.of_block(kind) and scheme.describe() == kind
    assert blocks.dtype == np.uint8 and blocks.shape == (1, 40, 2 * (18 if kind == "Q6_K" else 16))
    assert q.dtype == (np.uint8 if kind == "Q4_K" else np.int8)
    np.testing.assert_array_equal(_bits(primitives.dequantize_blocks(q[0], blocks[0], scheme)), _bits(want[0]))
    eye = np.eye(512, dtype=np.float32)          # x = I: x8 = I exactly, so the product is W^T itself
    got_t = modules.kquant_linear(torch.from_numpy(eye), torch.from_numpy(q), torch.from_numpy(blocks), None,
                                  torch.tensor(0, dtype=torch.int32), int(Block[kind])).numpy()
    np.testing.assert_array_equal(got_t.T, want[0])     # values (the sums' zeros are +0 where W holds -0)

    def deq(blk):
        scale, mn = primitives.block_scales(blk, kind, xp=jnp)
        return scale, (jnp.zeros(()) if mn is None else mn)
    scale, mn = jax.jit(deq)(blocks[0])
    ref_scale, ref_min = primitives.block_scales(blocks[0], kind)
    np.testing.assert_array_equal(_bits(scale), _bits(ref_scale))
    if ref_min is not None:
        np.testing.assert_array_equal(_bits(mn), _bits(ref_min))
    got_j = jax.jit(lambda q, s, m: lowering.dequantize(q, s, m, scheme.bits, scheme.group))(
        q[0], ref_scale, ref_min)
    np.testing.assert_array_equal(_bits(got_j), _bits(want[0]))


def _exported(kind: str, q, blocks, version: int = 3):
    reference = lowering.quant_linear_v3_reference if version == 3 else lowering.quant_linear_v5_reference

    def f(x, qweight, blk, layer):
        return _private.composite(reference, QUANT_LINEAR_V3.name, version)(x, qweight, blk, layer, kind=int(Block[kind]))
    (m,) = export.symbolic_shape("M")
    K = blocks.shape[2] // (18 if kind == "Q6_K" else 16) * 256
    shapes = [jax.ShapeDtypeStruct((m, K), np.float32), jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct(blocks.shape, blocks.dtype), jax.ShapeDtypeStruct((), np.int32)]
    return export.export(jax.jit(f), platforms=("cpu",))(*shapes)


def interleaved(q, kind: str):
    """A stack's quants (row by row, as kept_blocks stores them) interleaved by 16 rows: version 5's."""
    bits = 4 if kind == "Q4_K" else 8
    return np.stack([primitives.interleave_rows(a, None, None, bits)[0] for a in q])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K,N,version", [(256, 33, 3), (768, 16, 3), (256, 48, 5), (768, 16, 5)])
def test_kquant_kernel_matches_decomposition_and_torch(library, kind, K, N, version):  # noqa: F811 - the fixture
    """The version 3 kernel (below 4 rows each row's sub-block scales decoded from its headers, then
    version 1's integer dot products; from 4 rows, with VNNI, 16 rows at a time copied interleaved
    with their scales decoded into [sub-blocks, 16], then 16-row tiles of up to 6 rows of x, here 7:
    one tile and a tail), the decomposition and the torch op agree on the layer asked for, up to the
    targets table's row limit through the kernel and past it through the decomposition; so does
    version 5's (the quants interleaved at export: the 16-row tiles at every row count, read where
    they lie; without VNNI AVX2's steps, and without AVX2 the portable loop reading the interleaved
    bytes).

    Tolerance as tests/runtime/test_kernels.py derives it: the same f32 terms x8 q s (+ x8 m) in
    another association, plus the kernel's unsigned offset (Q5_K / Q6_K int8: 128 times the scale)."""
    rng = np.random.default_rng(K + N + len(kind))
    q, blocks, want, scheme = _stack(kind, 3, N, K, rng)
    stored = q if version == 3 else interleaved(q, kind)                # version 5: the quants interleaved
    exp = _exported(kind, stored, blocks, version)
    portable_fn, _ = specialize(exp, None)
    kernel_fn, n_kernel = specialize(exp, library)
    target = f"hloserve_quant_linear_v{version}"
    assert n_kernel == 1 and f"custom_call @{target}(" in kernel_fn.mlir_module()
    limit = max_rows(target) or 64
    for rows in (1, 3, 7, limit, limit + 1):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        layer = np.int32(rows % 3)
        kernel = np.asarray(jax.jit(kernel_fn.call)(x, stored, blocks, layer))
        portable = np.asarray(jax.jit(portable_fn.call)(x, stored, blocks, layer))
        ref = modules.kquant_linear(torch.from_numpy(x), torch.from_numpy(stored), torch.from_numpy(blocks), None,
                                    torch.tensor(layer), int(Block[kind]), 0 if version == 3 else 16).numpy()
        x8 = modules.quantize_blocks(torch.from_numpy(x)).numpy()
        scale, mn = primitives.block_scales(blocks[layer], kind)
        s = np.repeat(np.abs(scale), scheme.group, -1)
        m = np.repeat(np.abs(mn), scheme.group, -1) if mn is not None else 0
        ints = np.abs(q[layer].astype(np.float32)) if scheme.bits == 8 else 15.0
        terms = np.abs(want[layer]) + s * (ints + 128) + m
        bound = (K + 4) * 2.0 ** -24 * (np.abs(x8) @ terms.T) + 1e-30
        for got in (kernel, portable):
            assert got.shape == (rows, N)
            assert (np.abs(got - ref) <= bound).all(), (kind, rows, np.abs(got - ref).max(), bound.min())


def test_kquant_kernel_reads_only_its_layer(library):  # noqa: F811 - the fixture
    """Changing another layer's blocks changes nothing; zeroing the used layer's headers zeroes it."""
    rng = np.random.default_rng(7)
    q, blocks, _, _ = _stack("Q4_K", 3, 16, 256, rng)
    fn = jax.jit(specialize(_exported("Q4_K", q, blocks), library)[0].call)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    base = np.asarray(fn(x, q, blocks, np.int32(1)))
    other_q, other_b = q.copy(), blocks.copy()
    other_q[[0, 2]], other_b[[0, 2]] = 0, 0
    np.testing.assert_array_equal(np.asarray(fn(x, other_q, other_b, np.int32(1))), base)
    mine = blocks.copy()
    mine[1] = 0
    assert np.abs(np.asarray(fn(x, q, mine, np.int32(1)))).max() == 0
