"""hloserve's CPU kernels for the composites an artifact may contain (runtime/artifact/kernels.py).

    library = kernels.cpu_library(report)      # built once per machine into <cache>/kernels/, or None
    exported, n = kernels.specialize(exported, library)

`cpu_library` compiles cpu_kernels.cc with the system C++ compiler for this CPU (-march=native)
against jaxlib's XLA FFI headers, keyed by the source, compiler, flags, jaxlib and CPU, and
registers its targets with XLA for the CPU platform. `specialize` replaces each composite it has
a kernel for by an FFI custom call to it, in this process's copy of the function only: the
artifact keeps the portable decomposition, which a CPU without a compiler (or with
HLOSERVE_CPU_KERNELS=0) runs. TPU and GPU have their own Pallas kernels (accelerators.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Any, Callable

from hloserve.runtime.artifact.kernels import (COMPOSITES, LAYER_LINEAR, PAGED_ATTENTION, PAGED_ATTENTION_V2,
                                               QUANT_LINEAR, QUANT_LINEAR_V2)

from .._private import rewrite_composites
from ..paths import cache_dir, untrusted

LOG = logging.getLogger("hloserve.runtime")
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernels.cc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# -march=native, unless HLOSERVE_CPU_KERNEL_MARCH names another target (tests build the fallbacks a
# CPU without AMX or AVX512-BF16 runs, e.g. x86-64-v3, on a CPU that has them)
MARCH_ENV = "HLOSERVE_CPU_KERNEL_MARCH"
# composite (name, version) -> FFI target in cpu_kernels.cc
TARGETS = {(PAGED_ATTENTION.name, PAGED_ATTENTION.version): "hloserve_paged_attention",
           (PAGED_ATTENTION_V2.name, PAGED_ATTENTION_V2.version): "hloserve_paged_attention_v2",
           (LAYER_LINEAR.name, LAYER_LINEAR.version): "hloserve_layer_linear",
           (QUANT_LINEAR.name, QUANT_LINEAR.version): "hloserve_quant_linear",
           (QUANT_LINEAR_V2.name, QUANT_LINEAR_V2.version): "hloserve_quant_linear_v2"}
# What a kernel needs of a composite's attributes (the others run their decomposition)
ACCEPTS = {"hloserve_quant_linear": lambda attrs: attrs["group"] % 32 == 0,   # whole 32-element vectors
           "hloserve_quant_linear_v2": lambda attrs: attrs["group"] % 32 == 0}
# Kernels that beat XLA only up to a number of rows (the first operand's dim 0): above it the
# decomposition runs. layer_linear reads each weight once where XLA's dot copies and packs the
# layer, which pays off once enough rows share the packed copy. Measured (AMD EPYC, AVX512-BF16,
# docs/performance.md): the kernel is 2.8x faster at 1 row, 1.3x at 32, even from 128 on; without
# AVX512-BF16 it widens each product to f32, so only decode-sized row counts stay with it.
def max_rows(target: str) -> int | None:
    native = _march() == "native"
    flags = _cpu_identity().split()
    vnni = native and "avx512_vnni" in flags
    if target == "hloserve_quant_linear":
        # int8 x int8 (VNNI) against XLA dequantizing the layer to f32 for its dot: the kernel is the
        # faster to 64 rows and even at 256 (1B Llama MLP shape, 2026-11-25, docs/quantization.md);
        # the portable integer loop only at decode-sized row counts
        return 64 if vnni else 4
    if target == "hloserve_quant_linear_v2":
        # 16 interleaved rows per vpdpbusd: 4-5x XLA's dequantize-then-dot at 256 rows and more
        # (docs/quantization.md, "Version 2"), so every row count runs it
        return None if vnni else 4
    if target != "hloserve_layer_linear":
        return None
    # with AMX the kernel is bandwidth-bound to 64 rows too, and XLA's dot still the faster at 256
    # (prompt chunks: 355 against 418 ms per 256-token chunk of a Qwen3-0.6B shape, 2026-11-25)
    return 64 if native and "avx512_bf16" in flags else 4


# A result's dims, as (operand, dim) pairs, where they are not the first operand's
# (None: a static dim of the result)
RESULT_DIMS = {"hloserve_layer_linear": ((0, 0), (1, 1)), "hloserve_quant_linear": ((0, 0), (1, 1)),
               "hloserve_quant_linear_v2": ((0, 0), None)}
CONTRACTS = COMPOSITES   # (name, version) -> contract
ENV = "HLOSERVE_CPU_KERNELS"     # "0" turns the kernels off (the portable decompositions run)


@dataclasses.dataclass(frozen=True)
class Library:
    """A built kernel library: its file and the digest that identifies the code (cache keys)."""
    path: str
    digest: str


@dataclasses.dataclass(frozen=True)
class KernelSupport:
    """What a load runs as kernels: a runtime capability, known before the artifact loads, from
    which a server picks how to call the step (server/core/model_runner.py's StepPolicy).
    `library`: the CPU kernels; `accelerator`: "tpu" or "cuda" where that platform's Pallas kernels
    run (runtime/kernels/accelerators.py)."""
    library: Library | None
    accelerator: str | None = None

    @property
    def composites(self) -> frozenset[tuple[str, int]]:
        """The (name, version) of every composite run as a kernel (the rest run their decomposition)."""
        if self.accelerator is not None:
            from . import accelerators
            return accelerators.SERVED
        return frozenset(TARGETS) if self.library is not None else frozenset()

    def runs(self, name: str, version: int) -> bool:
        return (name, version) in self.composites


def support(platform: str, *, mesh: bool, report: Callable[[str], None] | None = None) -> KernelSupport:
    """The kernels a load on `platform` ("cpu", "gpu" or "tpu" as jax names it; "cuda" or "tpu" for
    a load that interprets that accelerator's Pallas kernels on this device) runs, one device only
    (a kernel is one device's code: XLA cannot partition a custom call, so over a mesh the
    decomposition runs and is partitioned with the rest): the CPU's, or the accelerator's Pallas
    kernels unless they are turned off."""
    if mesh:
        return KernelSupport(None)
    if platform == "cpu":
        return KernelSupport(cpu_library(report))
    from . import accelerators
    lowering = accelerators.LOWERING.get(platform)
    return KernelSupport(None, lowering if lowering and accelerators.enabled() else None)


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def cpu_library(report: Callable[[str], None] | None = None) -> Library | None:
    """The CPU kernels, built on first use on this machine and registered with XLA; None when
    they are turned off or cannot be built (then the composites run their decompositions)."""
    if not enabled():
        return None
    import jax
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        LOG.warning("no C++ compiler (g++/clang++, or $CXX): the CPU kernels are off, "
                    "attention runs its portable formulation")
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, _compiler_version(compiler).encode(), " ".join(_flags()).encode(),
                                     jax.__version__.encode(), _cpu_identity().encode()])).hexdigest()
    root = os.path.join(cache_dir(), "kernels")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:   # a read-only or full cache volume: built for this process only, in a private directory
        LOG.warning("the CPU kernels cannot be kept in %s (%s); building them for this process only", root,
                    e.strerror or e)
        root = _private_dir()
    path = os.path.join(root, key[:24], "libhloserve_cpu.so")
    shared = [cache_dir()] if root == os.path.join(cache_dir(), "kernels") else []   # not our private directory
    refused = untrusted(*shared, root, os.path.dirname(path))
    if refused:
        LOG.warning("the CPU kernels in %s are not loaded: %s (the library runs in this process); fix the "
                    "permissions or point HLOSERVE_CACHE elsewhere. The portable formulations run.", root, refused)
        return None
    problem = _check_built(path, key) if os.path.exists(path) else "not built yet"
    if problem:
        if problem != "not built yet":
            LOG.warning("rebuilding the CPU kernel library %s: %s", path, problem)
        if report:
            report("building hloserve's CPU kernels for this machine (once; about 10 s)")
        err = _build(compiler, path, key)
        if err:
            LOG.warning("the CPU kernels could not be built (%s); attention runs its portable formulation", err)
            return None
    _register(path)
    return Library(path, key)


@functools.cache
def _private_dir() -> str:
    return tempfile.mkdtemp(prefix="hloserve-kernels-")   # 0700, this process's own


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_built(path: str, key: str) -> str | None:
    """Why the library at `path` must not be loaded (its record is missing, or names another build
    or other bytes), or None. The record (`path`.json) is written with the library when it is built."""
    try:
        with open(path + ".json") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return f"its build record is unreadable ({type(e).__name__})"
    if not isinstance(record, dict) or record.get("key") != key:
        return "its build record names another build"
    if record.get("sha256") != _digest(path):
        return "its bytes differ from the ones built (sha256 mismatch)"
    return None


def specialize(exported: Any, library: Library | None) -> tuple[Any, int]:
    """`exported` with its composites resolved: each one `library` has a kernel for becomes an
    FFI call to it, every other one a call of its decomposition. Returns (function, number of
    kernels called).

    The decompositions are called, not left as composites, because jax 0.10's shape refinement
    does not enter a composite's decomposition: a composite over symbolic dims fails to compile
    ("operand ... has type tensor<6x...>, but decomposition has type tensor<?x...>").
    """
    kernels_used = 0

    def replace(op, api) -> bool:
        nonlocal kernels_used
        ir, hlo = api.ir, api.hlo
        attrs = op.attributes
        key = (ir.StringAttr(attrs["name"]).value, ir.IntegerAttr(attrs["version"]).value)
        target = TARGETS.get(key) if library is not None else None
        config = {a.name: a.attr for a in ir.DictAttr(attrs["composite_attributes"])}
        if target in ACCEPTS and not ACCEPTS[target]({k: attribute_value(ir, v) for k, v in config.items()}):
            target = None
        result_types = [r.type for r in op.results]
        decomposition = ir.FlatSymbolRefAttr(attrs["decomposition"])

        def decomposed():
            return api.func.CallOp(result_types, decomposition, list(op.operands))

        with ir.InsertionPoint(op):
            if target is None:
                new = decomposed()
            else:
                # leading operands beyond the contract's are the decomposition's dimension variables
                operands = list(op.operands)[-len(CONTRACTS[key].operands):]

                def kernel():
                    return custom_call(api, target, result_types, operands, config, RESULT_DIMS.get(target))

                limit = max_rows(target)
                rows = ir.RankedTensorType(operands[0].type).shape[0]
                static = not ir.ShapedType.is_dynamic_size(rows)
                if limit is not None and static and rows > limit:
                    new = decomposed()
                elif limit is None or static:
                    new = kernel()
                    kernels_used += 1
                else:
                    # symbolic rows: both, chosen by a predicate that is constant once the
                    # function is compiled for a shape (XLA keeps only the branch taken)
                    i32 = ir.IntegerType.get_signless(32)
                    scalar = ir.RankedTensorType.get([], i32)
                    n = hlo.get_dimension_size(operands[0], 0)
                    bound = hlo.constant(ir.DenseElementsAttr.get_splat(scalar, ir.IntegerAttr.get(i32, limit)))
                    pred = hlo.compare(n, bound, hlo.ComparisonDirectionAttr.get("LE"))
                    new = hlo.IfOp(result_types, pred)
                    with ir.InsertionPoint(new.true_branch.blocks.append()):
                        hlo.return_(list(kernel().results))
                    with ir.InsertionPoint(new.false_branch.blocks.append()):
                        hlo.return_(list(decomposed().results))
                    kernels_used += 1
        for old, res in zip(op.results, new.results):
            old.replace_all_uses_with(res)
        op.erase()
        return True

    body, n = rewrite_composites(exported.mlir_module_serialized, replace)
    return (dataclasses.replace(exported, mlir_module_serialized=body) if n else exported), kernels_used


def custom_call(api, target: str, result_types, operands, config, dims=None):
    """An FFI custom call `target` (api v4) replacing a composite: `config` (the composite's
    attributes) as its backend config, and, where the result has symbolic dims, those dims as
    (operand, dim) pairs, or None for a static dim (default: the first operand's), for shape refinement."""
    ir, hlo = api.ir, api.hlo
    shape = None
    if not all(ir.RankedTensorType(t).has_static_shape for t in result_types):
        i32 = ir.IntegerType.get_signless(32)
        dims = dims or [(0, d) for d in range(ir.RankedTensorType(operands[0].type).rank)]
        result = ir.RankedTensorType(result_types[0])

        def size(r: int, where):
            if where is None:   # a static dim of the result
                return hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([1], i32),
                                                                   ir.IntegerAttr.get(i32, result.get_dim_size(r))))
            return hlo.reshape(ir.RankedTensorType.get([1], i32), hlo.get_dimension_size(operands[where[0]], where[1]))
        shape = [hlo.concatenate([size(r, where) for r, where in enumerate(dims)], 0)]
    return api.mlir.custom_call(target, result_types=result_types, operands=operands, backend_config=config,
                                api_version=4, result_shapes=shape)


def attribute_values(api, op) -> dict[str, Any]:
    """A composite op's (name, version) and its attributes as Python values."""
    ir = api.ir
    attrs = op.attributes
    config = {a.name: attribute_value(ir, a.attr) for a in ir.DictAttr(attrs["composite_attributes"])}
    return {"name": ir.StringAttr(attrs["name"]).value, "version": ir.IntegerAttr(attrs["version"]).value,
            "attributes": config}


def attribute_value(ir, attr):
    """A composite attribute's Python value (integers and floats; others as they are)."""
    for kind in (ir.IntegerAttr, ir.FloatAttr):
        if isinstance(attr, kind):
            return attr.value
        try:
            return kind(attr).value
        except (ValueError, TypeError):
            continue
    return attr


def _march() -> str:
    return os.environ.get(MARCH_ENV, "native")


def _flags() -> tuple[str, ...]:
    return tuple(f"-march={_march()}" if f == "-march=native" else f for f in FLAGS)


def _build(compiler: str, path: str, key: str) -> str | None:
    """Compile the library into `path` (atomically) with its build record (key, sha256); returns
    an error line or None."""
    import jax
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [compiler, *_flags(), "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return f"{os.path.basename(compiler)}: {e}"
    if proc.returncode != 0:
        os.unlink(tmp)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines() or ["?"]
        return f"{os.path.basename(compiler)} exited {proc.returncode}: {errors[0][:300]}"
    record = json.dumps({"key": key, "sha256": _digest(tmp)})
    with open(tmp + ".json", "w") as f:
        f.write(record)
    os.replace(tmp + ".json", path + ".json")
    os.replace(tmp, path)
    return None


@functools.cache
def _register(path: str) -> None:
    """Load the library and register its targets with XLA (once per process and file)."""
    import jax
    lib = ctypes.CDLL(path)
    for target in TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return compiler


@functools.cache
def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform
        return platform.processor()
