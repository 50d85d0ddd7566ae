"""Load an artifact and call its functions through PJRT (jax's client).

Weights are read from the memory-mapped safetensors file and placed on the
device once; every call passes the device arrays. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax import export as jax_export

from hloserve.exporter import artifact, weights as weights_io
from hloserve.exporter.errors import ArtifactError, ShapeConstraintError


def _coerce(name: str, value: Any, spec: artifact.TensorSpec) -> Any:
    """Accept numpy/jax arrays and nested lists; narrow i64->i32 / f64->f32 as the artifact does."""
    want = artifact.numpy_dtype(spec.dtype)
    if isinstance(value, jax.Array):
        if value.dtype != want:
            raise ShapeConstraintError(f"input {name!r} has dtype {value.dtype}, expected {spec.dtype} ({spec.describe()})")
        return value
    arr = np.asarray(value)
    if arr.dtype == want:
        return arr
    narrowing = {(np.dtype(np.int64), np.dtype(np.int32)), (np.dtype(np.float64), np.dtype(np.float32))}
    if (arr.dtype, want) in narrowing or (arr.dtype.kind in "iu" and want.kind in "iu"):
        if arr.dtype.kind in "iu" and arr.size and (arr.min() < np.iinfo(want).min or arr.max() > np.iinfo(want).max):
            raise ShapeConstraintError(f"input {name!r} has values outside {spec.dtype}'s range")
        return arr.astype(want)
    if arr.dtype.kind == "f" and want.kind == "f" and arr.dtype != want and spec.dtype in ("bf16", "f16", "f32"):
        return arr.astype(want)
    raise ShapeConstraintError(f"input {name!r} has dtype {arr.dtype}, expected {spec.dtype} ({spec.describe()})")


@dataclasses.dataclass
class LoadedFunction:
    spec: artifact.FunctionSpec
    symbols: Mapping[str, artifact.SymbolSpec]
    exported: jax_export.Exported
    weights: Mapping[str, jax.Array]

    def __post_init__(self):
        self._call = jax.jit(self.exported.call)

    def check(self, inputs: Mapping[str, Any]) -> dict[str, int]:
        shapes = {k: tuple(np.shape(v)) for k, v in inputs.items()}
        return artifact.bind_symbols(self.spec, self.symbols, shapes)

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        self.check(inputs)
        args = [self.weights[n] for n in self.spec.weights]
        args += [_coerce(t.name, inputs[t.name], t) for t in self.spec.inputs]
        outs = self._call(*args)
        return {t.name: o for t, o in zip(self.spec.outputs, outs)}


@dataclasses.dataclass
class LoadedModel:
    path: str
    manifest: artifact.Manifest
    functions: dict[str, LoadedFunction]


def load(path: str, *, verify: bool = True, device=None) -> LoadedModel:
    manifest = artifact.read_manifest(path)
    if verify:
        artifact.verify_files(path, manifest)
    reader = weights_io.Reader(os.path.join(path, artifact.WEIGHTS))
    if verify:
        artifact.verify_weights(path, manifest, reader)
    device = device or jax.devices()[0]
    on_device = {n: jax.device_put(reader[n], device) for n in manifest.weights}
    functions = {}
    for name, spec in manifest.functions.items():
        with open(os.path.join(path, "functions", f"{name}.jax_exported"), "rb") as f:
            try:
                exp = jax_export.deserialize(bytearray(f.read()))
            except Exception as e:  # noqa: BLE001
                raise ArtifactError(f"artifact {path}: function {name!r} cannot be deserialized ({e}); re-export it") from e
        functions[name] = LoadedFunction(spec, manifest.symbols, exp, on_device)
    return LoadedModel(path, manifest, functions)
