"""Batch-invariant steps (`hloserve export --batch-invariant`) and their composites, hloserve.product_sum
and hloserve.row_sum.

product_sum's kernel computes a*b + c*d with both products rounded (numpy's elementwise arithmetic,
which never fuses a multiply-add), bit for bit; row_sum's sums a row in one order (its 16 lanes, then
pairwise) at every row count; each decomposition stays within the rounding of its sum. A
batch-invariant export of the default model (SmolLM2-135M-Instruct, bf16 weights and KV cache) gives a
decode row the same logits, bit for bit, in steps of 1 to 16 rows, and a speculative verifying step
(a row per proposed token of one sequence) gives each row the logits sequential decodes give: what
makes speculative decoding's greedy text plain decoding's (docs/api.md, "Speculative decoding")."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites.product_sum import product_sum_reference
from hloserve.exporter.composites.row_sum import row_sum_reference
from hloserve.runtime import kernels
from hloserve.runtime.artifact.kernels import PRODUCT_SUM, ROW_SUM

from .test_kernels import library  # noqa: F401 - the module's fixture


def _exported():
    (n,) = export.symbolic_shape("N")
    spec = jax.ShapeDtypeStruct((n,), np.float32)
    f = _private.composite(product_sum_reference, PRODUCT_SUM.name, PRODUCT_SUM.version)
    return export.export(jax.jit(f), platforms=("cpu",))(spec, spec, spec, spec)


def _exported_row_sum(n: int):
    (r,) = export.symbolic_shape("R")
    f = _private.composite(row_sum_reference, ROW_SUM.name, ROW_SUM.version)
    return export.export(jax.jit(f), platforms=("cpu",))(jax.ShapeDtypeStruct((r, n), np.float32))


def _lanes_then_pairs(x: np.ndarray) -> np.ndarray:
    """Each row of f32 x summed as row_sum.cc says: 16 running lanes (lane j: elements j, j + 16, ...),
    then the lanes pairwise, 8, 4, 2, 1 (numpy's f32 adds, one rounding each)."""
    rows, n = x.shape
    lanes = np.zeros((rows, 16), np.float32)
    for i in range(0, n, 16):
        part = x[:, i:i + 16]
        lanes[:, :part.shape[1]] += part
    w = 8
    while w:
        lanes[:, :w] += lanes[:, w:2 * w]
        w //= 2
    return lanes[:, 0]


@pytest.mark.parametrize("n", [5, 576, 1000])        # a tail only, whole lanes, lanes and a tail
def test_row_sum_kernel_sums_a_row_one_way_at_any_row_count(library, n):  # noqa: F811
    """Bit for bit the lanes-then-pairs order, for 1, 7 and 3,000 rows (several tasks of the pool):
    so a row's sum is the same in a step of any size; the decomposition (XLA's reduce, whose order
    changes with the row count) within the f32 rounding of a sum of n terms."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3000, n)) * np.exp(rng.standard_normal((3000, 1)))).astype(np.float32)
    want = _lanes_then_pairs(x)
    s = library.specialize(_exported_row_sum(n))
    assert s.kernels
    call = jax.jit(s.exported.call)
    for rows in (1, 7, 3000):
        np.testing.assert_array_equal(np.asarray(call(x[:rows])), want[:rows], err_msg=f"{rows} rows")
    portable = np.asarray(jax.jit(kernels.Decompositions().specialize(_exported_row_sum(n)).exported.call)(x))
    bound = n * 2.0 ** -24 * np.abs(x).sum(axis=1)
    assert (np.abs(portable - want) <= bound).all()


@pytest.mark.parametrize("n", [1, 17, 100_003])    # one vector's tail, several, several tasks of the pool
def test_kernel_rounds_both_products(library, n):  # noqa: F811
    """Bit for bit numpy's f32(a*b) + f32(c*d); the decomposition within one f32 rounding of the sum's
    terms (XLA may fuse one product into a multiply-add); a*b and c*d nearly cancelling, where a fused
    multiply-add and two roundings differ most."""
    rng = np.random.default_rng(n)
    a, b, c = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    d = (-(a * b) / c * (1 + rng.standard_normal(n).astype(np.float32) * 1e-3)).astype(np.float32)
    want = (a * b) + (c * d)
    s = library.specialize(_exported())
    assert s.kernels
    got = np.asarray(jax.jit(s.exported.call)(a, b, c, d))
    np.testing.assert_array_equal(got, want)
    portable = np.asarray(jax.jit(kernels.Decompositions().specialize(_exported()).exported.call)(a, b, c, d))
    bound = 2.0 ** -24 * (np.abs(a * b) + np.abs(c * d)) * 2
    assert (np.abs(portable - want) <= bound).all()


@pytest.fixture(scope="module")
def invariant_artifact():
    """The default model exported batch-invariant (what `hloserve serve --speculative-config` serves)."""
    from hloserve.server.serve import DEFAULT_PRESET, SERVE_QUANTIZE, default_artifact
    return default_artifact(DEFAULT_PRESET, SERVE_QUANTIZE, batch_invariant=True)


def test_a_decode_row_has_the_same_logits_in_steps_of_any_size(library, invariant_artifact):  # noqa: F811
    """One sequence's decode token, padded to steps of 1, 2, 4, 8 and 16 rows (padding rows see
    nothing), over a random bf16 cache of 300 positions: the same logits, bit for bit, through the CPU
    kernels (each gives a row the same bits at any row count; XLA's own dot does not, so the
    decompositions alone are not batch-invariant); and the rotary embedding's sums did go through the
    composite (without it, this machine gave the one-row step logits up to 0.15 apart)."""
    import jax.numpy as jnp

    from hloserve import runtime
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.runtime.artifact.llm import pack_step

    art = LLMArtifact.read(invariant_artifact)
    assert art.manifest.model.get("batch_invariant") is True
    with open(f"{invariant_artifact}/functions/decode.mlir") as f:
        text = f.read()
    assert f'"{PRODUCT_SUM.name}"' in text and f'"{ROW_SUM.name}"' in text
    llm, pads, context = art.llm, (1, 2, 4, 8, 16), 300
    blocks = -(-(context + 1) // llm.block_size)
    model = runtime.load(invariant_artifact, buckets={"num_tokens": list(pads), "num_seqs": list(pads),
                                                      "max_blocks": [blocks]})
    kv = llm.kv_cache
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.standard_normal(kv.concrete_shape(1 + blocks)).astype(np.float32) * 0.5)
    cache = np.asarray(values.astype(jnp.bfloat16))
    cache = cache.view(np.int16) if kv.numpy_dtype == np.int16 else cache.astype(kv.numpy_dtype)
    table = list(range(1, blocks + 1))
    logits = {}
    for pad in pads:
        inputs = pack_step([((11,), context, table)], llm.block_size, pad_tokens=pad, pad_seqs=pad, pad_blocks=blocks)
        out = model.functions["decode"](**inputs, **{kv.input: jnp.asarray(cache)})
        logits[pad] = np.asarray(out["logits"])[0]
    assert np.isfinite(logits[1]).all() and np.abs(logits[1]).max() > 1
    for pad in pads[1:]:
        np.testing.assert_array_equal(logits[pad], logits[1], err_msg=f"a step of {pad} rows")


def test_a_verifying_step_gives_each_row_the_logits_of_sequential_decodes(library, invariant_artifact):  # noqa: F811
    """A prompt of 290 tokens through `prefill`, then 16 tokens decoded one step at a time, against the
    same 16 tokens as one step of 16 rows (and 8), a row per token of the one sequence, as speculative
    decoding verifies proposals: every row's logits bit for bit. (Before the norms' sums went through
    hloserve.row_sum, rows of this prompt differed by 0.04-0.2 in a 16-row step: XLA's row reduce
    sums 16 rows in another order than one.)"""
    import jax.numpy as jnp

    from hloserve import runtime
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.runtime.artifact.llm import pack_step

    llm = LLMArtifact.read(invariant_artifact).llm
    prompt_len, k = 290, 16
    blocks = -(-(prompt_len + k) // llm.block_size)
    model = runtime.load(invariant_artifact, buckets={"num_tokens": [1, 8, 16, prompt_len],
                                                      "num_seqs": [1, 8, 16], "max_blocks": [blocks]})
    kv, bs = llm.kv_cache, llm.block_size
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 40000, prompt_len)]
    tokens = [int(t) for t in rng.integers(100, 40000, k)]
    table = list(range(1, blocks + 1))
    empty = jnp.zeros(kv.concrete_shape(1 + blocks), kv.numpy_dtype)
    out = model.functions["prefill"](**pack_step([(prompt, 0, table)], bs, pad_blocks=blocks), **{kv.input: empty})
    prefilled = np.asarray(out[kv.output])

    def step(rows, cache):
        out = model.functions["decode"](**pack_step(rows, bs, pad_blocks=blocks), **{kv.input: cache})
        return np.asarray(out["logits"]), out[kv.output]

    cache, sequential = jnp.asarray(prefilled), []
    for j, t in enumerate(tokens):
        logits, cache = step([((t,), prompt_len + j, table)], cache)
        sequential.append(logits[0])
    assert np.isfinite(sequential).all()
    for rows in (8, k):
        logits, _ = step([((tokens[j],), prompt_len + j, table) for j in range(rows)], jnp.asarray(prefilled))
        for j in range(rows):
            np.testing.assert_array_equal(logits[j], sequential[j], err_msg=f"row {j} of a {rows}-row step")


def test_a_prompt_gets_the_same_bits_however_it_is_chunked(library, invariant_artifact):  # noqa: F811
    """A 290-token prompt through the step the CPU server runs (`decode`: one call for chunks and
    decodes) as one chunk, and cut where a step's budget could cut it (chunks of two or more tokens:
    the scheduler's chunk_tokens): the same K/V in every cache row and the same logits for its last
    token and for the token decoded after it, bit for bit. The attention kernel's tiles of 2-7 tokens
    (a cut's tail) take the AMX path as longer ones do, and it never makes a tile of one token;
    before, these cuts gave 0.04-0.12 of logits."""
    import jax.numpy as jnp

    from hloserve import runtime
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.runtime.artifact.llm import pack_step

    llm = LLMArtifact.read(invariant_artifact).llm
    prompt_len = 290
    cuts = [[290], [257, 33], [33, 257], [145, 145], [2, 288], [100, 2, 188]]
    blocks = -(-(prompt_len + 1) // llm.block_size)
    sizes = sorted({n for cut in cuts for n in cut} | {1})
    model = runtime.load(invariant_artifact, buckets={"num_tokens": sizes, "num_seqs": [1], "max_blocks": [blocks]})
    kv, bs = llm.kv_cache, llm.block_size
    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 40000, prompt_len)]
    table = list(range(1, blocks + 1))
    step = model.functions["decode"]
    results = []
    for cut in cuts:
        cache, start = jnp.zeros(kv.concrete_shape(1 + blocks), kv.numpy_dtype), 0
        for n in cut:
            out = step(**pack_step([(prompt[start:start + n], start, table)], bs, pad_blocks=blocks), **{kv.input: cache})
            cache, start = out[kv.output], start + n
        last, rows = np.asarray(out["logits"])[0], np.asarray(cache)
        out = step(**pack_step([((123,), prompt_len, table)], bs, pad_blocks=blocks), **{kv.input: cache})
        results.append((cut, rows, last, np.asarray(out["logits"])[0]))
    _, rows0, last0, next0 = results[0]
    assert np.isfinite(last0).all() and np.isfinite(next0).all()
    for cut, rows, last, after in results[1:]:
        np.testing.assert_array_equal(rows, rows0, err_msg=f"K/V of the prompt cut {cut}")
        np.testing.assert_array_equal(last, last0, err_msg=f"the last prompt token's logits, cut {cut}")
        np.testing.assert_array_equal(after, next0, err_msg=f"the next decode's logits, cut {cut}")
