"""`load(path) -> LoadedModel`: an artifact's weights on device once, its functions callable.

    model = hloserve.runtime.load("art/", buckets={"batch": [1, 8, 32]}, strict=True)
    model.warmup(sizes={"seq": [128]})          # compile every bucket ahead of time
    out = model.functions["forward"](input_ids=ids, attention_mask=mask)

Weights are memory-mapped from weights.safetensors and placed on the devices
(sharded by `partition_rules` over `mesh`, or on one device) before any call;
calls pass those device arrays, never re-transfer them. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact import weights as weights_io
from hloserve.runtime.artifact.errors import ArtifactError
from jax import export as jax_export

from . import buckets as buckets_mod
from . import host_pages, kernels
from . import sharding as sharding_mod
from .client import DEFAULT_CACHE, Client, PlatformError, connect, platform_devices
from .exec_cache import ExecutableCache
from .executable import Function, FunctionStats
from .paths import write_atomically


@dataclasses.dataclass
class LoadedModel:
    """An artifact loaded onto devices.

    Attributes:
      path: the artifact directory.
      manifest: its manifest.
      client: platform, devices and compile cache in use.
      mesh: the SPMD mesh, or None on one device.
      weights: weight name -> device array (sharded over the mesh when there is one).
      functions: function name -> callable Function.
      layouts: weight name -> the layout its array is in, for the weights laid out for the kernels at
        load (runtime/kernels/: the same values in another order); the rest are as the artifact has them.
    """
    path: str
    manifest: artifact.Manifest
    client: Client
    mesh: Any
    weights: dict[str, jax.Array]
    functions: dict[str, Function]
    layouts: dict[str, str] = dataclasses.field(default_factory=dict)

    def warmup(self, sizes: Mapping[str, Sequence[int]] | None = None, *, functions: Sequence[str] | None = None,
               progress: Callable[[str], None] | None = None, run: bool | None = None) -> int:
        """Compile every bucket of every (or the named) function ahead of time; returns compiles done.

        sizes: per dim, the sizes to warm: required for dims that are not paddable
        (they compile per exact size); for paddable dims it narrows the buckets warmed.
        After warm-up, any further compile is logged as unplanned (raises in strict mode).
        run: execute each new executable once on zeros (default: functions without donated inputs;
          see Function.warmup).
        """
        names = list(functions or self.functions)
        for n in names:
            if n not in self.functions:
                raise ArtifactError(f"warm-up: the artifact has no function {n!r}; it has {sorted(self.functions)}")
        return sum(self.functions[n].warmup(sizes, progress, run=run) for n in names)

    def stats(self) -> dict[str, FunctionStats]:
        return {n: f.stats for n, f in self.functions.items()}


def _check_platform(name: str, exported: jax_export.Exported, client: Client, path: str) -> None:
    plat = client.platform
    ok = plat in exported.platforms or (plat == "gpu" and {"cuda", "rocm"} & set(exported.platforms))
    if not ok:
        raise PlatformError(f"artifact {path}: function {name!r} was lowered for {', '.join(exported.platforms)}, "
                            f"not {plat}; re-export with --platforms {','.join([*exported.platforms, plat])}")


def read_exported(path: str, name: str) -> jax_export.Exported:
    fpath = os.path.join(path, "functions", f"{name}.jax_exported")
    try:
        with open(fpath, "rb") as f:
            return jax_export.deserialize(bytearray(f.read()))
    except OSError as e:
        raise ArtifactError(f"artifact {path}: functions/{name}.jax_exported cannot be read ({e}); re-export it") from e
    except ImportError as e:   # jax reads the file with flatbuffers, which it does not install itself
        raise ArtifactError(f"artifact {path}: function {name!r} cannot be read without a package jax needs for "
                            f"it ({e}); pip install flatbuffers (a dependency of hloserve)") from e
    except Exception as e:  # noqa: BLE001 - flatbuffer errors have no common type
        raise ArtifactError(f"artifact {path}: function {name!r} cannot be deserialized "
                            f"({type(e).__name__}: {e}); the file is corrupted, re-export it") from e


def load(path: str, platform: str | None = None, devices: Sequence[Any] | None = None, mesh: Any = None,
         partition_rules: sharding_mod.Rules | None = None, cache_dir: str | None = DEFAULT_CACHE,
         buckets: Mapping[str, Sequence[int]] | None = None, strict: bool = False, *, verify: bool | str = True,
         functions: Sequence[str] | None = None, input_rules: sharding_mod.Rules | None = None,
         manifest: artifact.Manifest | None = None, kernel_support: kernels.KernelBackend | None = None,
         pallas_interpret: str | None = None, layouts: bool = True) -> LoadedModel:
    """Load the artifact at `path` onto devices.

    Args:
      platform: "cpu", "cuda"/"gpu", "tpu" (default: jax's default backend).
      devices: jax devices or indices (default: all of the platform's; one is used without a mesh).
      mesh: a jax Mesh, or {axis: size} over `devices`, for SPMD.
      partition_rules: [(regex on weight name, PartitionSpec or tuple), ...]; needs `mesh`.
      cache_dir: persistent compilation cache dir (default ~/.cache/hloserve/xla, or
        xla/ under $HLOSERVE_CACHE); None disables it.
      buckets: explicit bucket sizes per paddable dim (default: powers of two over its range).
      strict: raise RecompileError on any compile after warmup().
      verify: check file and weight sha256s against the manifest (catches corrupted artifacts).
        Hashing every weight costs ~1 s per GB, so a successful check is remembered in the
        cache dir by the weights file's identity (path, size, mtime, inode): a restart on an
        unchanged file skips the re-hash. "full" always re-hashes; False checks nothing.
      functions: load only these functions (default all).
      input_rules: like partition_rules, for function inputs by name (default: replicated), e.g.
        [("^kv_cache$", (None, None, "model"))]; an output named like a split input comes back split.
      manifest: the artifact's manifest when the caller has read it already (read from `path` otherwise).
      kernel_support: the kernels to substitute, when the caller asked `kernel_support()` before the load
        (default: this platform's).
      pallas_interpret: "tpu" or "cuda": run that platform's Pallas kernels (runtime/kernels/pallas/)
        in Pallas interpret mode on this device instead of its own kernels: the accelerator path,
        substitution included, checked where no accelerator is (slow: for tests).
      layouts: lay weights out as the kernels read them best, where they offer it (CPUs with AMX: the
        bf16 layer stacks as tiles; LoadedModel.layouts names them); False keeps every weight as the
        artifact has it (the same results, bit for bit: for comparisons).
    """
    manifest = manifest if manifest is not None else artifact.read_manifest(path)
    names = list(functions or manifest.functions)
    for n in names:
        if n not in manifest.functions:
            raise ArtifactError(f"artifact {path} has no function {n!r}; it has {sorted(manifest.functions)}")
    if verify:
        artifact.verify_files(path, manifest)
    reader = weights_io.Reader(os.path.join(path, artifact.WEIGHTS))
    client = connect(platform, devices, cache_dir)
    if verify:
        _verify_weights(path, manifest, reader, client.cache_dir, full=verify == "full")
    jmesh = sharding_mod.make_mesh(mesh, client.devices) if mesh is not None else None
    device = client.devices[0]

    exported = {n: read_exported(path, n) for n in names}
    for n, exp in exported.items():
        _check_platform(n, exp, client, path)
    # each composite runs this platform's kernel where it has one (runtime/kernels/), else the
    # decomposition the artifact carries
    if kernel_support is None:
        kernel_support = kernels.support(pallas_interpret or client.platform, mesh=jmesh is not None,
                                         report=_stderr, interpret=bool(pallas_interpret))
    # a batch-invariant artifact (export --batch-invariant) runs each kernel at every row count: XLA's
    # dot, which a kernel leaves large row counts to where it is the slower, sums in other orders
    every_row_count = bool(manifest.model.get("batch_invariant"))
    chosen = _weight_layouts(kernel_support, exported, {n: manifest.functions[n] for n in names}) if layouts else {}
    specialized = {n: kernel_support.specialize(
        exported[n], every_row_count=every_row_count,
        laid_out=frozenset(i for i, w in enumerate(manifest.functions[n].weights) if w in chosen)) for n in names}
    on_device, shardings = _place_weights(path, reader, [manifest.functions[n] for n in names], partition_rules,
                                          jmesh, device, chosen)
    in_sharding = sharding_mod.input_sharding(jmesh, device)

    # (a multi-host run compiles on every process: executables are not shared through the cache)
    cache = ExecutableCache(client.cache_dir) if client.cache_dir and jax.process_count() == 1 else None
    exec_devices = list(jmesh.devices.flat) if jmesh is not None else [device]
    fns = {}
    for n in names:
        spec = manifest.functions[n]
        split_inputs = sharding_mod.input_shardings(spec.inputs, input_rules, jmesh)
        bks = buckets_mod.Buckets.build(manifest.symbols, spec.paddable,
                                        {k: v for k, v in (buckets or {}).items() if k in spec.paddable
                                         or k not in _paddable_anywhere(manifest)})
        fns[n] = Function(spec, manifest.symbols, specialized[n].exported, [on_device[w] for w in spec.weights],
                          [shardings[w] for w in spec.weights], in_sharding, bks, strict=strict,
                          exec_cache=cache, devices=exec_devices,
                          cache_identity={**_identity(spec, shardings, in_sharding, exec_devices),
                                          "split_inputs": {k: repr(v.spec) for k, v in split_inputs.items()},
                                          "kernels": specialized[n].digest},
                          compiler_options=client.compiler_options, input_shardings=split_inputs,
                          kernels=specialized[n].kernels, per_shape=specialized[n].per_shape)
    return LoadedModel(path, manifest, client, jmesh, on_device, fns, {w: lay.name for w, lay in chosen.items()})


def _weight_layouts(backend: kernels.KernelBackend, exported: Mapping[str, jax_export.Exported],
                    specs: Mapping[str, artifact.FunctionSpec]) -> dict[str, kernels.WeightLayout]:
    """weight name -> the layout the backend's kernels read it in, for the weights every loaded function
    that reads them offers in one same layout (a weight one function reads as it lies stays so)."""
    offers: dict[str, list] = {}
    for n, exp in exported.items():
        offered = backend.layouts(exp)
        for i, w in enumerate(specs[n].weights):
            offers.setdefault(w, []).append(offered.get(i))
    return {w: got[0] for w, got in offers.items() if got[0] is not None and all(g == got[0] for g in got)}


def _place_weights(path: str, reader: weights_io.Reader, specs: Sequence[artifact.FunctionSpec],
                   partition_rules: sharding_mod.Rules | None, jmesh: Any, device: Any,
                   layouts: Mapping[str, kernels.WeightLayout]) -> tuple[dict, dict]:
    """(weight name -> device array, weight name -> sharding) for the weights `specs` read: the
    memory-mapped views go to the device once (those in `layouts` laid out on the way); with a mesh
    each device receives only its shard."""
    used = list(dict.fromkeys(w for spec in specs for w in spec.weights))
    for w in used:
        if w not in reader:
            raise ArtifactError(f"artifact {path}: weight {w!r} is missing from {artifact.WEIGHTS}; re-export it")
    shardings = sharding_mod.weight_shardings({w: reader[w].shape for w in used}, partition_rules, jmesh, device)
    return {w: sharding_mod.place(_host_copy(reader[w], shardings[w], layouts.get(w)), shardings[w])
            for w in used}, shardings


def _host_copy(view: Any, sharding: Any, layout: kernels.WeightLayout | None = None) -> Any:
    """A large weight bound for one CPU device: a copy in 2 MiB pages (host_pages), which jax
    aliases; anything else: the file's view, which device_put copies or shards. A weight with a
    `layout` is copied so laid out (in the same pass where it goes to 2 MiB pages)."""
    dtype, shape = view.dtype, view.shape
    if layout is not None:
        view = layout.arrange(view)
    devices = sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu" or view.nbytes < host_pages.MIN_BYTES:
        return view if layout is None else np.ascontiguousarray(view).view(dtype).reshape(shape)
    return host_pages.copy_in_huge_pages(view).view(dtype).reshape(shape)


def kernel_support(platform: str | None = None, *, mesh: bool = False) -> kernels.KernelBackend:
    """The composites a `load(platform=..., mesh=...)` would run as kernels, known before it loads
    (builds the CPU kernels on first use); pass it on as load's `kernel_support`."""
    return kernels.support(platform_devices(platform)[0].platform, mesh=mesh, report=_stderr)


def _stderr(message: str) -> None:
    print(f"[hloserve] {message}", file=sys.stderr, flush=True)


def _verify_weights(path: str, manifest: artifact.Manifest, reader: weights_io.Reader, cache_dir: str | None,
                    *, full: bool) -> None:
    """artifact.verify_weights, skipped when this exact file already passed (a stamp in cache_dir)."""
    wpath = os.path.abspath(reader.path)
    st = os.stat(wpath)
    digests = hashlib.sha256(json.dumps({n: w.sha256 for n, w in manifest.weights.items()},
                                        sort_keys=True).encode()).hexdigest()
    stamp = {"path": wpath, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "weights": digests}
    stamp_file = None
    if cache_dir is not None:
        stamp_file = os.path.join(cache_dir, "verified", hashlib.sha256(wpath.encode()).hexdigest() + ".json")
        if not full:
            try:
                with open(stamp_file) as f:
                    if json.load(f) == stamp:
                        return
            except (OSError, ValueError):
                pass
    artifact.verify_weights(path, manifest, reader)
    if stamp_file is not None:
        try:
            os.makedirs(os.path.dirname(stamp_file), exist_ok=True)
            write_atomically(stamp_file, [json.dumps(stamp).encode()])
        except OSError:
            pass   # a read-only or full cache only costs the re-hash next time


def _identity(spec: artifact.FunctionSpec, shardings: Mapping[str, Any], in_sharding: Any,
              devices: Sequence[Any]) -> dict[str, Any]:
    """What, besides the symbol values, fixes a compiled executable of `spec` (the executable-cache key)."""
    exported_file = f"{spec.name}.jax_exported"
    return {
        "function": spec.files.get(exported_file, spec.name),
        "weights": [[w, repr(getattr(shardings[w], "spec", None))] for w in spec.weights],
        "inputs": repr(getattr(in_sharding, "spec", None)),
        "mesh": repr(getattr(getattr(in_sharding, "mesh", None), "shape", None)),
        "devices": [[d.id, d.platform, getattr(d, "device_kind", "")] for d in devices],
        "backend": getattr(devices[0].client, "platform_version", ""),
        # flags change the code XLA generates; an executable built under other flags is not this one
        "flags": [os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")],
    }


def _paddable_anywhere(manifest: artifact.Manifest) -> set[str]:
    return {s for f in manifest.functions.values() for s in f.paddable}
