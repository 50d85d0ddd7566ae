"""The hloserve artifact: a directory, described by a frozen, versioned manifest.

    ARTIFACT/
      manifest.json                 Manifest below (the source of truth)
      weights.safetensors           every weight once, shared by all functions
      functions/NAME.mlir           readable StableHLO
      functions/NAME.mlirbc         StableHLO portable artifact (target version recorded)
      functions/NAME.jax_exported   jax.export serialization (calling convention, shape assertions)

Weights are arguments of every function, passed by name; no function embeds
them. Reading never needs torch. See docs/artifact-format.md.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Mapping

import numpy as np

from . import dtypes
from .errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of a function.

    Attributes:
      name: the name callers use ("input_ids", "logits", "updated:kv_cache").
      dtype: manifest dtype name ("f32", "bf16", "i32", ...).
      shape: ints for static dims, strings in jax syntax for symbolic ones ("batch", "2*batch").
    """
    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: Mapping) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["shape"]))

    def describe(self) -> str:
        return f"{self.dtype}[{','.join(str(s) for s in self.shape)}]"


@dataclasses.dataclass(frozen=True)
class SymbolSpec:
    """A symbolic dim shared by the artifact's functions: inclusive [min, max]."""
    name: str
    min: int
    max: int | None

    def to_json(self) -> dict:
        return {"min": self.min, "max": self.max}


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor of weights.safetensors.

    Attributes:
      quant: the quantization scheme as data (None for plain weights), e.g.
        {"scheme": "int4", "group": 32, "symmetric": true, "of": "model.layers.0.mlp.up.weight"}.
    """
    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    quant: Mapping[str, Any] | None = None

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "shape": list(self.shape), "sha256": self.sha256}
        if self.quant:
            d["quant"] = dict(self.quant)
        return d


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """One entry point.

    Attributes:
      weights: weight names, in the order they are the function's leading arguments.
      inputs: user inputs, following the weights.
      outputs: results; buffer and input mutations come first, named "updated:NAME".
      mutations: output name -> the weight (buffer) or input it replaces.
      donated: inputs whose buffers the runtime may reuse for outputs (e.g. a KV cache).
      paddable: symbols the runtime may pad up to a bucket (padding must not change results).
      files: file name -> sha256 for the function's .mlir/.mlirbc/.jax_exported.
      stablehlo_version: target version of the portable artifact (.mlirbc).
      platforms: platforms the module was lowered for.
    """
    name: str
    weights: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    mutations: Mapping[str, str]
    donated: tuple[str, ...]
    paddable: tuple[str, ...]
    files: Mapping[str, str]
    stablehlo_version: str
    platforms: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "weights": list(self.weights), "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs], "mutations": dict(self.mutations),
            "donated": list(self.donated), "paddable": list(self.paddable), "files": dict(self.files),
            "stablehlo_version": self.stablehlo_version, "platforms": list(self.platforms),
        }

    @classmethod
    def from_json(cls, name: str, d: Mapping) -> "FunctionSpec":
        return cls(name, tuple(d["weights"]), tuple(TensorSpec.from_json(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_json(t) for t in d["outputs"]), dict(d.get("mutations", {})),
                   tuple(d.get("donated", ())), tuple(d.get("paddable", ())), dict(d["files"]),
                   d["stablehlo_version"], tuple(d.get("platforms", ("cpu",))))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """manifest.json, field by field.

    Attributes:
      format_version: FORMAT_VERSION of the writer; readers reject newer ones.
      producer: versions of hloserve, torch and jax that wrote the artifact.
      source: what was exported (a path, preset or module:factory).
      functions: entry points by name.
      weights: every tensor in weights.safetensors, by name.
      symbols: symbolic dims by name with their ranges (derived dims are expressions in shapes).
      model: model metadata (task, tokenizer, chat template); an LLM step artifact keeps its
        typed, versioned step contract under model["llm"] (read it with LLMSpec.of).
    """
    format_version: int
    producer: Mapping[str, str]
    source: str
    functions: Mapping[str, FunctionSpec]
    weights: Mapping[str, WeightSpec]
    symbols: Mapping[str, SymbolSpec]
    model: Mapping[str, Any]

    @property
    def is_llm(self) -> bool:
        """An LLM step artifact: it carries a step contract (model["llm"])."""
        return self.model.get("llm") is not None

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version, "producer": dict(self.producer), "source": self.source,
            "functions": {k: f.to_json() for k, f in self.functions.items()},
            "weights": {k: w.to_json() for k, w in self.weights.items()},
            "symbols": {k: s.to_json() for k, s in self.symbols.items()},
            "model": dict(self.model),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "Manifest":
        return cls(
            d["format_version"], dict(d["producer"]), d["source"],
            {k: FunctionSpec.from_json(k, f) for k, f in d["functions"].items()},
            {k: WeightSpec(k, w["dtype"], tuple(w["shape"]), w["sha256"], w.get("quant")) for k, w in d["weights"].items()},
            {k: SymbolSpec(k, s["min"], s["max"]) for k, s in d["symbols"].items()},
            dict(d.get("model", {})),
        )


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: str, manifest: Manifest) -> None:
    tmp = os.path.join(path, MANIFEST + ".partial")
    with open(tmp, "w") as f:
        json.dump(manifest.to_json(), f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(path, MANIFEST))


def read_manifest(path: str) -> Manifest:
    """Read and validate ARTIFACT/manifest.json; every problem is an ArtifactError."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise ArtifactError(f"artifact {path} does not exist; create it with `hloserve export SOURCE -o {path}`")
    if not os.path.exists(mpath):
        raise ArtifactError(f"{path} is not an hloserve artifact: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            raw = json.load(f)
    except ValueError as e:
        raise ArtifactError(f"{mpath} is not valid JSON ({e}); the artifact is corrupted, re-export it") from e
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not _is_int(version) or version < 1:
        raise ArtifactError(f"{mpath} has no integer format_version >= 1; the artifact is corrupted, re-export it")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"artifact {path} has format_version {version}, but this hloserve reads up to {FORMAT_VERSION}; "
            f"upgrade hloserve (pip install -U hloserve)")
    check_manifest_json(raw, mpath)
    return Manifest.from_json(raw)


# -- manifest.json checked field by field before Manifest.from_json builds on it ---------------------
_MAX_INT = 2**63 - 1
_DIM_FUNCTIONS = ("floordiv", "mod", "max", "min", "non_negative")
_DIM_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.UnaryOp, ast.USub, ast.BinOp, ast.Add, ast.Sub,
              ast.Mult, ast.FloorDiv, ast.Mod, ast.Call)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class _Check:
    """Refuses a field of manifest.json with one line: where it is, what it holds, what it should."""

    def __init__(self, mpath: str):
        self.mpath = mpath

    def __call__(self, ok: bool, at: str, value: Any, want: str) -> None:
        if not ok:
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 60 else shown[:56] + " ..."
            raise ArtifactError(f"{self.mpath}: {at} is {shown}, not {want}; the artifact is corrupted, re-export it")


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= _MAX_INT


def _is_dtype(v: Any) -> bool:
    return isinstance(v, str) and v in dtypes.NUMPY


def _is_strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_dim(d: Any) -> bool:
    """An int >= 0, or a symbolic dim in jax syntax: names, ints, + - * // %, and the functions
    runtime/artifact/symbols.py evaluates."""
    if _is_int(d):
        return True
    if not isinstance(d, str) or not d or len(d) > 200:
        return False
    try:
        tree = ast.parse(d, mode="eval")
    except (SyntaxError, ValueError):
        return False
    for n in ast.walk(tree):
        if not isinstance(n, _DIM_NODES) or isinstance(n, ast.Constant) and not _is_int(n.value):
            return False
        if isinstance(n, ast.Call) and (not isinstance(n.func, ast.Name) or n.func.id not in _DIM_FUNCTIONS
                                        or n.keywords):
            return False
    return True


def check_manifest_json(raw: dict, mpath: str) -> None:
    """Every field of manifest.json has its type and range, and every name refers to something the
    manifest declares, so that what reads it later meets no surprise; ArtifactError (one line) if not."""
    check = _Check(mpath)
    for key, kind, want in (("producer", dict, "an object"), ("source", str, "a string"),
                            ("functions", dict, "an object"), ("weights", dict, "an object"),
                            ("symbols", dict, "an object"), ("model", dict, "an object")):
        check(isinstance(raw.get(key, {} if key == "model" else None), kind), key, raw.get(key), want)
    check(all(isinstance(v, str) for v in raw["producer"].values()), "producer", raw["producer"], "names of versions")
    for name, sym in raw["symbols"].items():
        at = f"symbols.{name}"
        check(name.isidentifier() and isinstance(sym, dict), at, sym, "an object {min, max} named by an identifier")
        check(_is_int(sym.get("min")), f"{at}.min", sym.get("min"), "an int >= 0")
        check("max" in sym and (sym["max"] is None or _is_int(sym["max"], sym["min"])), f"{at}.max", sym.get("max"),
              "null or an int >= min")
    for name, w in raw["weights"].items():
        at = f"weights.{name}"
        check(isinstance(w, dict), at, w, "an object")
        check(_is_dtype(w.get("dtype")), f"{at}.dtype", w.get("dtype"), f"one of {sorted(dtypes.NUMPY)}")
        check(isinstance(w.get("shape"), list) and all(_is_int(d) for d in w["shape"]), f"{at}.shape", w.get("shape"),
              "a list of ints >= 0")
        check(isinstance(w.get("sha256"), str), f"{at}.sha256", w.get("sha256"), "a hex digest")
        check(w.get("quant") is None or isinstance(w["quant"], dict), f"{at}.quant", w.get("quant"), "null or an object")
    for name, fn in raw["functions"].items():
        _check_function(check, name, fn, raw)


def _check_function(check: _Check, name: str, fn: Any, raw: dict) -> None:
    at = f"functions.{name}"
    check(bool(_PLAIN_NAME.fullmatch(name)) and isinstance(fn, dict), at, fn,
          "an object named by a plain file name (it names functions/NAME.jax_exported)")
    for key in ("weights", "donated", "paddable", "platforms"):
        check(_is_strs(fn.get(key, [])), f"{at}.{key}", fn.get(key), "a list of strings")
    check(isinstance(fn.get("weights"), list), f"{at}.weights", fn.get("weights"), "a list of weight names")
    missing = [w for w in fn["weights"] if w not in raw["weights"]]
    check(not missing, f"{at}.weights", missing[:3], "names of weights the manifest declares")
    names = []
    for key in ("inputs", "outputs"):
        check(isinstance(fn.get(key), list), f"{at}.{key}", fn.get(key), "a list of tensors")
        for i, t in enumerate(fn[key]):
            _check_tensor(check, f"{at}.{key}[{i}]", t)
        names += [t["name"] for t in fn[key]] if key == "inputs" else []
    undonatable = [n for n in fn.get("donated", []) if n not in names]
    check(not undonatable, f"{at}.donated", undonatable[:3], "names of the function's inputs")
    unknown = [s for s in fn.get("paddable", []) if s not in raw["symbols"]]
    check(not unknown, f"{at}.paddable", unknown[:3], "names of symbols the manifest declares")
    check(isinstance(fn.get("mutations", {}), dict) and all(isinstance(v, str) for v in fn.get("mutations", {}).values()),
          f"{at}.mutations", fn.get("mutations"), "an object of names")
    files = fn.get("files")
    check(isinstance(files, dict) and all(_PLAIN_NAME.fullmatch(f) and isinstance(d, str) for f, d in files.items()),
          f"{at}.files", files, "an object of plain file names (in functions/) and their sha256")
    check(isinstance(fn.get("stablehlo_version"), str), f"{at}.stablehlo_version", fn.get("stablehlo_version"),
          "a version string")


def _check_tensor(check: _Check, at: str, t: Any) -> None:
    check(isinstance(t, dict) and isinstance(t.get("name"), str), at, t, "an object {name, dtype, shape}")
    check(_is_dtype(t.get("dtype")), f"{at}.dtype", t.get("dtype"), f"one of {sorted(dtypes.NUMPY)}")
    check(isinstance(t.get("shape"), list) and all(_is_dim(d) for d in t["shape"]), f"{at}.shape", t.get("shape"),
          "a list of dims (ints >= 0 or symbolic expressions)")


def verify_files(path: str, manifest: Manifest) -> None:
    """Check every function file against its recorded sha256."""
    for fn in manifest.functions.values():
        for fname, digest in fn.files.items():
            fpath = os.path.join(path, "functions", fname)
            if not os.path.exists(fpath):
                raise ArtifactError(f"artifact {path}: function {fn.name!r} file functions/{fname} is missing; re-export it")
            if _sha256_file(fpath) != digest:
                raise ArtifactError(f"artifact {path}: functions/{fname} does not match its sha256 in {MANIFEST} "
                                    f"(corrupted or edited); re-export the artifact")


def verify_weights(path: str, manifest: Manifest, reader, *, hashes: bool = True) -> None:
    """Check every weight's dtype and shape against the manifest, and its sha256 unless `hashes` is False
    (sizes and truncation are the reader's checks on open)."""
    for name, w in manifest.weights.items():
        if name not in reader:
            raise ArtifactError(f"artifact {path}: weight {name!r} is missing from {WEIGHTS}; re-export it")
        arr = reader[name]
        if dtypes.name_of_numpy(arr.dtype) != w.dtype or tuple(arr.shape) != tuple(w.shape):
            raise ArtifactError(f"artifact {path}: weight {name!r} is {dtypes.name_of_numpy(arr.dtype)}{list(arr.shape)}, "
                                f"manifest says {w.dtype}{list(w.shape)}; re-export it")
        if hashes and reader.sha256(name) != w.sha256:
            raise ArtifactError(f"artifact {path}: {WEIGHTS}: weight {name!r} does not match its sha256 (corrupted); "
                                f"re-export it")


def file_digest(path: str) -> str:
    return _sha256_file(path)


def numpy_dtype(name: str) -> np.dtype:
    return dtypes.NUMPY[name]
