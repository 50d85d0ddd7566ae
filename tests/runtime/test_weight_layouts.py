"""Weights laid out for the kernels at load (runtime/kernels/backend.py WeightLayout): on a CPU with
AMX, AVX512-BF16 or AVX2 and FMA, the default model's bf16 layer stacks and its tied embedding table go to the
device as B tiles (runtime/kernels/cpu/layouts.py) and its steps call `hloserve_layer_linear_tiles`
(the table's rows for the embedding read from the tiles by a gather of their own), with the same
logits bit for bit as a load that keeps the artifact's layout where both run AMX tiles (AVX512-BF16:
within what the kernels and the decompositions differ by; AVX2 likewise)."""
from __future__ import annotations

import numpy as np
import pytest

from hloserve.runtime.kernels.cpu import build, layouts

pytestmark = pytest.mark.skipif(not build.enabled() or not layouts.b_tiles_read(build.cpu()),
                                reason="layouts are offered where the CPU kernels run AMX, AVX512-BF16 or AVX2 and FMA")


def test_layer_stacks_go_to_the_device_as_b_tiles_and_the_steps_keep_their_bits():
    from hloserve import runtime
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.runtime.artifact.llm import pack_step
    from hloserve.runtime import kernels
    from hloserve.runtime.kernels.cpu import layouts
    from hloserve.server.serve import DEFAULT_PRESET, SERVE_QUANTIZE, default_artifact

    path = default_artifact(DEFAULT_PRESET, SERVE_QUANTIZE)
    llm = LLMArtifact.read(path).llm
    buckets = {"num_tokens": [1, 64], "num_seqs": [1], "max_blocks": [8]}
    models = {name: runtime.load(path, functions=["decode"], buckets=buckets, layouts=name == "tiles")
              for name in ("tiles", "rows")}
    tiles = models["tiles"]
    stacks = {w for w, spec in tiles.manifest.weights.items() if len(spec.shape) == 3 and spec.dtype in ("bf16", "i16")}
    table = {w for w, spec in tiles.manifest.weights.items() if len(spec.shape) == 2 and spec.shape[0] == llm.vocab_size}
    assert stacks and len(table) == 1 and set(tiles.layouts) == stacks | table
    assert set(tiles.layouts.values()) == {layouts.B_TILES.name}
    assert models["rows"].layouts == {}
    for w in sorted(stacks)[:2] + sorted(table):      # the arrays hold the file's values, laid out
        file_view = np.asarray(models["rows"].weights[w])
        np.testing.assert_array_equal(np.asarray(tiles.weights[w]),
                                      np.ascontiguousarray(layouts.B_TILES.arrange(file_view)).view(file_view.dtype)
                                      .reshape(file_view.shape))

    def run(model) -> list:
        """a 40-token chunk's logits, then a decode row's over the chunk's cache"""
        fn = model.functions["decode"]
        cache = np.zeros(llm.kv_cache.concrete_shape(9), llm.kv_cache.numpy_dtype)
        prompt = list(range(100, 130)) + list(range(llm.vocab_size - 10, llm.vocab_size))   # the table's last tile too
        chunk = fn(**pack_step([(prompt, 0, [1, 2, 3])], llm.block_size), **{llm.kv_cache.input: cache})
        row = fn(**pack_step([([7], 40, [1, 2, 3])], llm.block_size), **{llm.kv_cache.input: chunk[llm.kv_cache.output]})
        return [np.asarray(chunk["logits"]), np.asarray(row["logits"])]
    if not build.cpu().has("amx_bf16"):
        # AVX512-BF16's outer products sum each output in another order than the row routines: the
        # step's logits then move as they do between the kernels and the decompositions (every linear
        # rounds its input to bf16, so a changed last bit reroutes later roundings): bounded by that
        models["decomposition"] = runtime.load(path, functions=["decode"], buckets=buckets,
                                               kernel_support=kernels.Decompositions())
    logits = {name: run(model) for name, model in models.items()}
    for i, (got, want) in enumerate(zip(logits["tiles"], logits["rows"])):
        assert np.isfinite(want).all() and np.abs(want).max() > 1
        if build.cpu().has("amx_bf16"):
            np.testing.assert_array_equal(got, want)
        else:
            moved = np.abs(want - logits["decomposition"][i]).max()
            assert 0 < np.abs(got - want).max() <= 2 * moved, (np.abs(got - want).max(), moved)


def test_rows_gathered_from_a_table_laid_out_as_b_tiles_are_its_rows():
    """The gather `specialize` puts in place of an embedding lookup of a laid-out table (layouts.py's
    tile_row_gather) returns each row's values exactly, at any number of ids (symbolic), every row of
    every tile included, and clamps an id outside the table as the gather it replaces does."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from hloserve.runtime import kernels
    from hloserve.runtime.kernels.cpu import layouts

    V, H = 64, 96
    table = (np.random.default_rng(0).normal(size=(V, H)) * 3).astype(jnp.bfloat16)
    exp = export.export(jax.jit(lambda t, ids: t[ids]))(
        jax.ShapeDtypeStruct((V, H), jnp.bfloat16), jax.ShapeDtypeStruct(export.symbolic_shape("n"), jnp.int32))
    backend = kernels.support("cpu", mesh=False)
    specialized = backend.specialize(exp, laid_out=frozenset({0}))
    assert specialized.exported is not exp          # the gather was replaced
    tiled = np.ascontiguousarray(layouts.B_TILES.arrange(table)).view(table.dtype).reshape(V, H)
    assert not np.array_equal(tiled, table)
    for ids in (np.arange(V, dtype=np.int32)[::-1], np.array([5], np.int32), np.array([63, 0, 16, 17, 15], np.int32),
                np.array([64, 1000, -1, -77, 31], np.int32)):
        got = np.asarray(jax.jit(specialized.exported.call)(tiled, ids))
        want = np.asarray(jax.jit(exp.call)(table, ids))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        inside = (ids >= 0) & (ids < V)                   # (jax's indexing wraps negative ids before its gather)
        np.testing.assert_array_equal(got[inside].view(np.uint16), table[ids[inside]].view(np.uint16))
