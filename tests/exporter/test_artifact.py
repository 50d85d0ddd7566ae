"""Artifact format, symbolic shapes, errors: the contracts of exporter/ (docs/artifact-format.md)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from torch.export import Dim

from hloserve.runtime import artifact
from hloserve.exporter.errors import ArtifactError, ShapeConstraintError, UnsupportedOpError
from hloserve.exporter.export import EntryPoint, export_artifact
from hloserve.exporter.registry import DuplicateLoweringError, Registry, lower
from hloserve.runtime import load

from . import factories

ATOL = 1e-5


def _export(tmp_path, factory, name="art", **kw):
    module, args, dyn = factory()
    names = list(dyn)
    out = str(tmp_path / name)
    export_artifact(out, [EntryPoint("forward", module, args, tuple(dyn[n] for n in names), input_names=names)],
                    source=factory.__name__, **kw)
    return out, module


def test_independent_and_derived_dims(tmp_path):
    out, module = _export(tmp_path, factories.two_dims)
    m = artifact.read_manifest(out)
    fn = m.functions["forward"]
    assert [t.shape for t in fn.inputs] == [("batch", "seq", 16), ("batch", "2*seq", 16), ("batch", "seq + 1", 16)]
    assert m.symbols == {"batch": artifact.SymbolSpec("batch", 1, 16), "seq": artifact.SymbolSpec("seq", 2, 64)}
    text = open(os.path.join(out, "functions", "forward.mlir")).read()
    assert "tensor<?x?x16xf32>" in text
    model = load(out)
    for b, s in [(1, 2), (3, 17), (16, 64)]:
        x, p, sh = torch.randn(b, s, 16), torch.randn(b, 2 * s, 16), torch.randn(b, s + 1, 16)
        got = model.functions["forward"](x=x.numpy(), pairs=p.numpy(), shifted=sh.numpy())
        want = module(x, p, sh)
        np.testing.assert_allclose(np.asarray(got["output_0"]), want[0].detach().numpy(), atol=ATOL)
        np.testing.assert_allclose(np.asarray(got["output_1"]), want[1].detach().numpy(), atol=ATOL)


@pytest.mark.parametrize("shapes,message", [
    ({"x": (17, 5, 16), "pairs": (17, 10, 16), "shifted": (17, 6, 16)}, "batch = 17 is outside its range [1, 16]"),
    ({"x": (2, 65, 16), "pairs": (2, 130, 16), "shifted": (2, 66, 16)}, "seq = 65 is outside its range [2, 64]"),
    ({"x": (2, 5, 16), "pairs": (2, 11, 16), "shifted": (2, 6, 16)}, "input 'pairs' dim 1 is 11, but must equal 2*seq = 10"),
    ({"x": (2, 5, 16), "pairs": (3, 10, 16), "shifted": (2, 6, 16)}, "dims named batch must be equal"),
    ({"x": (2, 5), "pairs": (2, 10, 16), "shifted": (2, 6, 16)}, "input 'x' has rank 2"),
    ({"x": (2, 5, 15), "pairs": (2, 10, 16), "shifted": (2, 6, 16)}, "input 'x' dim 2 is 15, expected 16"),
])
def test_constraint_violations_name_dim_and_bound(tmp_path, shapes, message):
    out, _ = _export(tmp_path, factories.two_dims)
    fn = load(out).functions["forward"]
    with pytest.raises(ShapeConstraintError, match=re.escape(message)):
        fn(**{k: np.zeros(v, np.float32) for k, v in shapes.items()})


def test_tied_weights_stored_once_and_no_big_constants(tmp_path):
    out, module = _export(tmp_path, factories.tied)
    m = artifact.read_manifest(out)
    # head.weight is tied to emb.weight: one tensor stored under one of its names
    assert sorted(m.weights) in (["emb.weight", "table"], ["head.weight", "table"])
    text = open(os.path.join(out, "functions", "forward.mlir")).read()
    for const in re.findall(r"dense<[^>]*>", text):
        assert len(const) <= 2 * 1024 + 16, const[:80]
    ids = torch.randint(0, 100, (5, 7))
    got = load(out).functions["forward"](ids=ids.numpy())["output"]
    np.testing.assert_allclose(np.asarray(got), module(ids).detach().numpy(), atol=ATOL)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1)
        self.total.add_(x.sum(0))
        return self.total * self.steps


def test_buffer_mutations_are_outputs(tmp_path):
    out = str(tmp_path / "art")
    export_artifact(out, [EntryPoint("forward", Counter(), (torch.randn(3, 4),), ({0: Dim("n", max=8)},))], source="t")
    fn = load(out).functions["forward"]
    assert fn.spec.mutations == {"updated:steps": "steps", "updated:total": "total"}
    res = fn(x=np.ones((2, 4), np.float32))
    assert int(res["updated:steps"]) == 1
    np.testing.assert_array_equal(np.asarray(res["updated:total"]), np.full(4, 2.0))


class _Encode(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp.a(x)


@pytest.mark.parametrize("first", ["forward", "encode"])
def test_entry_points_share_one_weights_file(tmp_path, first):
    # forward first: the weights file is written while encode is lowered (encode reads no other
    # weight); encode first: forward reads weights encode does not, and the file is written again
    mlp, args, dyn = factories.mlp()
    out = str(tmp_path / "art")
    entries = [EntryPoint("forward", mlp, args, (dyn["x"],)), EntryPoint("encode", _Encode(mlp), args, (dyn["x"],))]
    export_artifact(out, entries if first == "forward" else entries[::-1], source="t")
    m = artifact.read_manifest(out)
    assert set(m.functions) == {"forward", "encode"}
    a = "a" if first == "forward" else "mlp.a"      # a shared tensor is stored under its first name
    assert sorted(m.weights) == sorted([f"{a}.bias", f"{a}.weight", "b.bias", "b.weight"])
    assert m.functions["encode"].weights == (f"{a}.weight", f"{a}.bias")
    model = load(out)                       # checks every weight's sha256 against the manifest
    x = torch.randn(4, 8)
    np.testing.assert_allclose(np.asarray(model.functions["encode"](x=x.numpy())["output"]),
                               mlp.a(x).detach().numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(model.functions["forward"](x=x.numpy())["output"]),
                               mlp(x).detach().numpy(), atol=ATOL)


def test_a_failing_entry_point_leaves_no_artifact_while_the_weights_are_written(tmp_path):
    mlp, args, dyn = factories.mlp()
    out = tmp_path / "art"
    with pytest.raises(UnsupportedOpError):
        export_artifact(str(out), [EntryPoint("forward", mlp, args, (dyn["x"],)),
                                   EntryPoint("exotic", *factories.exotic())], source="t")
    assert os.listdir(tmp_path) == []        # neither the artifact nor its partial directory


class _Offset(torch.nn.Module):
    """Adds a tensor made in forward: torch.export lifts it as a constant of each trace."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def forward(self, x):
        return x + torch.tensor(self.values, dtype=torch.float32)


def test_equal_constants_of_entry_points_are_stored_once(tmp_path):
    x = torch.randn(2, 3)
    out = str(tmp_path / "art")
    export_artifact(out, [EntryPoint("one", _Offset([1.0, 2.0, 3.0]), (x,)),
                          EntryPoint("same", _Offset([1.0, 2.0, 3.0]), (x,)),
                          EntryPoint("other", _Offset([4.0, 5.0, 6.0]), (x,))], source="t")
    m = artifact.read_manifest(out)
    assert m.functions["one"].weights == m.functions["same"].weights
    assert m.functions["other"].weights != m.functions["one"].weights
    assert len(m.weights) == 2
    model = load(out)
    for name, values in (("one", [1.0, 2.0, 3.0]), ("same", [1.0, 2.0, 3.0]), ("other", [4.0, 5.0, 6.0])):
        np.testing.assert_allclose(np.asarray(model.functions[name](x=x.numpy())["output"]),
                                   (x + torch.tensor(values)).numpy(), atol=ATOL)


# -- loading errors ----------------------------------------------------------
@pytest.fixture
def mlp_artifact(tmp_path):
    return _export(tmp_path, factories.mlp)[0]


def test_missing_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load(str(tmp_path / "nope"))


def test_newer_format_version_rejected(mlp_artifact):
    path = os.path.join(mlp_artifact, "manifest.json")
    data = json.load(open(path))
    data["format_version"] = artifact.FORMAT_VERSION + 1
    json.dump(data, open(path, "w"))
    with pytest.raises(ArtifactError, match=f"format_version {artifact.FORMAT_VERSION + 1}.*reads up to {artifact.FORMAT_VERSION}"):
        load(mlp_artifact)


def test_corrupted_weight_detected(mlp_artifact):
    path = os.path.join(mlp_artifact, "weights.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ArtifactError, match=r"weight 'b.bias' does not match its sha256"):
        load(mlp_artifact)


def test_truncated_weights_detected(mlp_artifact):
    path = os.path.join(mlp_artifact, "weights.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])
    with pytest.raises(ArtifactError, match="truncated"):
        load(mlp_artifact)


def test_edited_function_file_detected(mlp_artifact):
    with open(os.path.join(mlp_artifact, "functions", "forward.mlir"), "a") as f:
        f.write("// edited\n")
    with pytest.raises(ArtifactError, match="forward.mlir does not match its sha256"):
        load(mlp_artifact)


def test_wrong_dtype_names_input(mlp_artifact):
    fn = load(mlp_artifact).functions["forward"]
    with pytest.raises(ShapeConstraintError, match="input 'x' has dtype int8, expected f32"):
        fn(x=np.zeros((2, 8), np.int8))


# -- unsupported ops and the registry ---------------------------------------
def test_unsupported_ops_listed_at_once(tmp_path):
    with pytest.raises(UnsupportedOpError) as info:
        export_artifact(str(tmp_path / "a"), [EntryPoint("forward", *factories.exotic())], source="t")
    msg = str(info.value)
    assert "hloserve_test.frobnicate_cli.default" in msg and "hloserve_test.twiddle_cli.default" in msg
    assert "factories.py:" in msg                # the model's source line
    assert "f32[2,3]" in msg                      # input shapes
    assert "exporter/lowerings/" in msg           # where to add the lowering
    assert len(info.value.nodes) == 2


def test_registry_rejects_duplicates():
    import types
    mod = types.ModuleType("fake_family")

    @lower(torch.ops.aten.abs.default)
    def a(ctx, x):
        return x

    @lower(torch.ops.aten.abs.default)
    def b(ctx, x):
        return x

    a.__module__ = b.__module__ = mod.__name__
    mod.a, mod.b = a, b
    with pytest.raises(DuplicateLoweringError, match="aten.abs.default already lowered"):
        Registry.from_modules([mod])


def test_registry_falls_back_from_overload_to_packet():
    from hloserve.exporter.lowerings import default_registry
    reg = default_registry()
    assert reg.lookup(torch.ops.aten.add.Tensor) is reg.lookup(torch.ops.aten.add.Scalar) is not None
