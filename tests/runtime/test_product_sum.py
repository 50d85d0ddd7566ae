"""hloserve.product_sum and batch-invariant steps (`hloserve export --batch-invariant`).

The kernel computes a*b + c*d with both products rounded (numpy's elementwise arithmetic, which never
fuses a multiply-add), bit for bit; the decomposition stays within one rounding of it. A batch-invariant
export of the default model (SmolLM2-135M-Instruct, bf16 weights and KV cache) gives a decode row the
same logits, bit for bit, in steps of 1 to 16 rows, which is what makes speculative decoding's greedy
text plain decoding's (docs/api.md, "Speculative decoding")."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export

from hloserve.exporter import _private
from hloserve.exporter.composites.product_sum import product_sum_reference
from hloserve.runtime import kernels
from hloserve.runtime.artifact.kernels import PRODUCT_SUM

from .test_kernels import library  # noqa: F401 - the module's fixture


def _exported():
    (n,) = export.symbolic_shape("N")
    spec = jax.ShapeDtypeStruct((n,), np.float32)
    f = _private.composite(product_sum_reference, PRODUCT_SUM.name, PRODUCT_SUM.version)
    return export.export(jax.jit(f), platforms=("cpu",))(spec, spec, spec, spec)


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
        assert f'"{PRODUCT_SUM.name}"' in f.read()
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
