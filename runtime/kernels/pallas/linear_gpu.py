"""The GPU kernel behind `hloserve.layer_linear`: a few rows of activations times one layer of a stack
of 16-bit matrices, read where the layer lies in the stack (Pallas, lowered through Triton).

Why: on GPUs the composite's decomposition slices the layer out of the stacked [L, N, K] weights with
a `dynamic_slice` inside the layer loop, and XLA:GPU hands cuBLAS a copy of that slice: each decode
step wrote and read every layer's matrices once more before the products (on an H200, 2026-11-30,
the 1B step kept the device busy 3.3 ms against a 0.52 ms floor: docs/performance.md). Here each
program reads its tiles of the layer in place, so the matrix crosses memory once.

One program per (16 rows of x, BN rows of the layer's matrix): it loops over K in tiles of BK,
loads x's [16, BK] tile (rounded to the weights' dtype once, outside the kernel, to nearest even, as
the contract asks) and the matrix's [BN, BK] tile (int16 bits reinterpreted as the float they hold),
and adds their `tl.dot` (16-bit operands, products exact in f32, f32 sums) to a [16, BN] f32
accumulator. Only decode-sized calls take it (M <= MAX_ROWS): above that the rows amortize the copy
and cuBLAS's tiles beat these, so the kernel module runs XLA's dot on the sliced layer (the
decomposition's arithmetic). A matrix whose N or K is not a multiple of 16 (tl.dot's minimum) takes
XLA's dot too. Runs in Pallas interpret mode on any platform (`interpret=True`, the tests).

Written in a session whose device time was spent: no GPU has compiled or timed it yet, so the runtime
runs it only with HLOSERVE_GPU_LAYER_LINEAR=1 (pallas/__init__.py); benchmarks/gpu_check.sh times it
against the decomposition.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NAME = "pallas_triton.layer_linear"
MAX_ROWS = 64       # decode-sized calls; above, XLA's dot on the sliced layer
BM = 16             # rows of x per program: tl.dot's minimum
MAX_BK = 256        # elements of K per tile
DOT_MIN = 16


def tiles(n: int, k: int) -> tuple[int, int] | None:
    """(BN, BK) for an [N, K] matrix, or None when its shape takes XLA's dot: BN 16 rows of the
    matrix (enough programs to stream a 2048-row matrix over 128 multiprocessors), 32 for 8192 rows
    and more; BK the largest power of two up to MAX_BK dividing K."""
    if n % DOT_MIN or k % DOT_MIN:
        return None
    bn = 32 if n >= 8192 else 16
    bk = MAX_BK
    while k % bk:
        bk //= 2
    return bn, bk


def fits(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] x [n, k]^T call runs the Triton kernel (else XLA's dot)."""
    return m <= MAX_ROWS and tiles(n, k) is not None


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, bn: int, bk: int, steps: int, dtype):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def body(t, acc):
        x = x_ref[pl.ds(i * BM, BM), pl.ds(t * bk, bk)]                            # [BM, BK] 16-bit
        w = w_ref[layer, pl.ds(j * bn, bn), pl.ds(t * bk, bk)]                    # [BN, BK] bits or floats
        if w.dtype != dtype:
            w = lax.bitcast_convert_type(w, dtype)
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((BM, bn), jnp.float32))


def layer_linear(x, weights, layer, *, dtype, interpret: bool = False, num_warps: int = 4, num_stages: int = 3):
    """The composite's operands (LAYER_LINEAR: x f32[M, K], weights [L, N, K] 16-bit floats or their
    int16 bits, layer s32[]) -> f32[M, N]; `dtype` the float the weights hold."""
    M, K = x.shape
    L, N, _ = weights.shape
    dtype = jnp.dtype(dtype)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(()), 0, L - 1)
    x16 = x.astype(dtype)                                                   # rounded to nearest even
    if not fits(M, N, K):
        w = weights[0] if L == 1 else lax.dynamic_index_in_dim(weights, layer, 0, keepdims=False)
        if w.dtype != dtype:
            w = lax.bitcast_convert_type(w, dtype)
        return lax.dot_general(x16, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    bn, bk = tiles(N, K)
    mp = -(-M // BM) * BM
    if mp != M:
        x16 = jnp.pad(x16, ((0, mp - M), (0, 0)))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, bn=bn, bk=bk, steps=K // bk, dtype=dtype),
        grid=(mp // BM, N // bn),
        in_specs=[any_spec] * 3,
        out_specs=pl.BlockSpec((BM, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hloserve_layer_linear",
    )(layer.reshape(1), x16, weights)
    return out[:M]
