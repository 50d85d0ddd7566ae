"""Mutated state survives export: a buffer or input that forward updates in place
becomes an explicit output `updated:NAME`; feeding it back reproduces eager's
second call."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import torch
from jax import export as jax_export
from torch.export import Dim

from hloserve.runtime import artifact
from hloserve.runtime.artifact import weights as weights_io
from hloserve.exporter.export import EntryPoint, export_artifact
from hloserve.runtime import load

ATOL = 1e-5  # f32


class CountingCache(torch.nn.Module):
    """A call counter and a row cache written with index_copy_ (a KV cache in miniature)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int32))
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x, pos):                    # x: (N, 4) rows to write at cache[pos]; pos: (N,)
        self.count.add_(1)
        self.cache.index_copy_(0, pos, self.proj(x))
        return self.cache.sum(0) * self.count


class Artifact:
    """The exported function called straight through its jax.export form, state passed explicitly:
    `call(weights, **inputs)` with weights {name: array}, so updated buffers can be fed back."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = artifact.read_manifest(path)
        self.spec = self.manifest.functions["forward"]
        with open(os.path.join(path, "functions", "forward.jax_exported"), "rb") as f:
            self.exported = jax_export.deserialize(bytearray(f.read()))
        reader = weights_io.Reader(os.path.join(path, artifact.WEIGHTS))
        self.weights = {n: np.array(reader[n]) for n in self.spec.weights}

    def call(self, weights, **inputs):
        args = [weights[n] for n in self.spec.weights]
        args += [np.asarray(inputs[t.name]).astype(artifact.numpy_dtype(t.dtype)) for t in self.spec.inputs]
        return {t.name: np.asarray(o) for t, o in zip(self.spec.outputs, self.exported.call(*args))}


def _export(tmp_path, module, args, dynamic):
    out = str(tmp_path / "art")
    export_artifact(out, [EntryPoint("forward", module, args, dynamic)], source="test_mutation")
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    return Artifact(out), manifest["functions"]["forward"]


def test_buffer_mutations_are_outputs_and_feed_back(tmp_path):
    torch.manual_seed(0)
    n = Dim("n", min=1, max=8)
    module = CountingCache().eval()
    eager = copy.deepcopy(module)
    fn, spec = _export(tmp_path, module, (torch.randn(2, 4), torch.tensor([0, 3])), ({0: n}, {0: n}))
    assert [t["name"] for t in spec["outputs"]] == ["updated:count", "updated:cache", "output"]
    assert spec["mutations"] == {"updated:count": "count", "updated:cache": "cache"}
    assert {"count", "cache"} <= set(spec["weights"])
    assert [t["shape"] for t in spec["outputs"]] == [[], [8, 4], [4]]

    weights = fn.weights
    calls = [(torch.randn(2, 4), torch.tensor([0, 3])), (torch.randn(3, 4), torch.tensor([3, 5, 7]))]
    for step, (x, pos) in enumerate(calls, start=1):
        with torch.no_grad():
            want = eager(x, pos)
        got = fn.call(weights, x=x.numpy(), pos=pos.numpy())
        assert int(np.asarray(got["updated:count"])) == step
        np.testing.assert_allclose(np.asarray(got["updated:cache"]), eager.cache.numpy(), atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(got["output"]), want.numpy(), atol=ATOL, rtol=0)
        # the artifact is functional: the caller feeds the updated buffers back as the next call's weights
        weights = {**weights, "count": got["updated:count"], "cache": got["updated:cache"]}


class InputCache(torch.nn.Module):
    def forward(self, cache, x, pos):             # cache: (8, 4) updated in place; x: (N, 4); pos: (N,)
        cache.index_copy_(0, pos, x * 2)
        return cache.sum(0)


def test_user_input_mutation_is_an_output_and_feeds_back(tmp_path):
    n = Dim("n", min=1, max=8)
    fn, spec = _export(tmp_path, InputCache(), (torch.zeros(8, 4), torch.randn(2, 4), torch.tensor([1, 5])),
                       (None, {0: n}, {0: n}))
    assert [t["name"] for t in spec["inputs"]] == ["cache", "x", "pos"]
    assert [t["name"] for t in spec["outputs"]] == ["updated:cache", "output"]
    assert spec["mutations"] == {"updated:cache": "cache"}
    assert spec["weights"] == []

    runtime_fn = load(fn.path).functions["forward"]   # inputs go by name: the runtime takes the cache back as is
    cache_eager, cache_art = torch.zeros(8, 4), np.zeros((8, 4), np.float32)
    for x, pos in [(torch.randn(2, 4), torch.tensor([1, 5])), (torch.randn(1, 4), torch.tensor([1]))]:
        want = InputCache()(cache_eager, x, pos)                    # mutates cache_eager
        got = runtime_fn(cache=cache_art, x=x.numpy(), pos=pos.numpy())
        np.testing.assert_allclose(np.asarray(got["updated:cache"]), cache_eager.numpy(), atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(got["output"]), want.numpy(), atol=ATOL, rtol=0)
        cache_art = np.asarray(got["updated:cache"])
    assert not np.any(cache_art[[0, 2, 3, 4, 6, 7]])  # untouched rows stay zero
