"""On-disk cache of compiled executables, keyed without lowering; data only, never code.

jax's persistent compilation cache (configured in client.py) keys on the
lowered HLO, so a warm process still pays for lowering the artifact's module
(~0.5 s for MiniLM) before it can look anything up. This cache sits in front of
it: the key is computed from what the manifest already pins down (the
function file's sha256, the concrete symbol values, donation, shardings,
devices, jax/jaxlib and backend versions), so a warm start deserializes the
executable directly. A miss falls through to jax (and its cache), and the
result is written here.

An entry is CACHE_DIR/executables/<key>.xla, written atomically:

    one line of JSON (EntryHeader: format, key, jax/jaxlib, platform, the payload's
    sha256, which arguments the executable keeps, each output's shape, dtype and sharding)
    the payload: the executable as PJRT serializes it (what jax's own cache stores)

Nothing in it is unpickled or imported: the header is parsed as JSON and checked
(format, key, versions, platform, digest) before PJRT sees the payload, and any
mismatch is a miss with one log line, then a recompile that rewrites the entry.
A directory another user owns or that group/others may write is still refused
(a PJRT executable is machine code), with one warning naming it; the directory is
created 0700.

An entry is written whole or not at all (runtime/paths.py: write_atomically). A write that
finds the disk full stops caching for the rest of the process, jax's persistent cache included
(jax writes its entries in place: every further write would leave one cut short, which jax never
reads back and never rewrites), removes the entries of jax's that this process left cut short,
and says so in one warning; serving goes on, compiling what it does not find.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ._private import unreadable_compile_cache_entries
from .client import configure_compile_cache
from .paths import disk_full, untrusted, write_atomically

LOG = logging.getLogger("hloserve.runtime")
FORMAT = 2
SUFFIX = ".xla"


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """One output of a cached executable: what its per-device buffers assemble into."""
    shape: tuple[int, ...]
    dtype: str
    mesh_axes: tuple[str, ...] = ()              # () : the one device's array as it comes back
    mesh_shape: tuple[int, ...] = ()
    spec: tuple[Any, ...] = ()                   # PartitionSpec entries: None, an axis, or a list of axes


@dataclasses.dataclass(frozen=True)
class EntryHeader:
    """The first line of an entry (JSON): everything needed to check and call the payload."""
    format: int
    key: str
    jax: str
    jaxlib: str
    platform: str
    payload_sha256: str
    kept_args: tuple[int, ...]                   # arguments the executable reads (jit drops unused ones)
    outputs: tuple[OutputSpec, ...]
    single_output: bool                          # the function returns one array, not a tuple

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "EntryHeader":
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format') if isinstance(d, dict) else '?'} is not {FORMAT}")
        outs = tuple(OutputSpec(tuple(o["shape"]), str(o["dtype"]), tuple(o["mesh_axes"]), tuple(o["mesh_shape"]),
                                tuple(tuple(s) if isinstance(s, list) else s for s in o["spec"]))
                     for o in d["outputs"])
        return cls(FORMAT, str(d["key"]), str(d["jax"]), str(d["jaxlib"]), str(d["platform"]),
                   str(d["payload_sha256"]), tuple(int(i) for i in d["kept_args"]), outs, bool(d["single_output"]))


class CachedExecutable:
    """A PJRT executable read from the cache, called like the jax executable it was built from:
    `exe(*args)` with every argument of the jitted function (placed on the devices) returns its
    outputs. Donated arguments are donated (the aliasing is part of the executable)."""

    def __init__(self, loaded: Any, header: EntryHeader, devices: Sequence[Any]):
        self._loaded = loaded
        self._kept = header.kept_args
        self._single = header.single_output
        by_id = {d.id: d for d in devices}
        self._assemble: list[Any] = []   # per output: None (one device's array) or its global sharding
        for o in header.outputs:
            if not o.mesh_axes:
                self._assemble.append(None)
                continue
            mesh = jax.sharding.Mesh(np.array([by_id[d.id] for d in devices]).reshape(o.mesh_shape), o.mesh_axes)
            self._assemble.append((o.shape, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*o.spec))))

    def as_text(self) -> str:
        """The compiled HLO, as jax's Compiled.as_text gives it (an executable read from the cache
        answers what one just compiled does)."""
        return "\n".join(m.to_string() for m in self._loaded.hlo_modules())

    def __call__(self, *args: Any) -> Any:
        results = self._loaded.execute_sharded([args[i] for i in self._kept])
        outs = []
        for shards, how in zip(results.disassemble_into_single_device_arrays(), self._assemble):
            outs.append(shards[0] if how is None else jax.make_array_from_single_device_arrays(how[0], how[1], shards))
        return outs[0] if self._single else tuple(outs)


def _output_spec(aval: Any, sharding: Any, devices: Sequence[Any]) -> OutputSpec:
    shape, dtype = tuple(int(d) for d in aval.shape), str(aval.dtype)
    if len(devices) == 1:
        return OutputSpec(shape, dtype)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise ValueError(f"output sharding {type(sharding).__name__} has no plain description")
    mesh = sharding.mesh
    if [d.id for d in mesh.devices.flat] != [d.id for d in devices]:
        raise ValueError("output mesh devices differ from the executable's")
    spec = tuple(list(s) if isinstance(s, tuple) else s for s in sharding.spec)
    return OutputSpec(shape, dtype, tuple(mesh.axis_names), tuple(mesh.devices.shape), spec)


class ExecutableCache:
    """A directory of serialized executables; every failure is a miss, never an error."""

    def __init__(self, cache_dir: str):
        self.dir = os.path.join(cache_dir, "executables")
        self.refused = untrusted(cache_dir, self.dir)
        self.full = False             # a write found the disk full: nothing more is written by this process
        self.opened = time.time()     # jax's entries written since are this process's (see _stop_writing)
        if self.refused:
            LOG.warning("executable cache %s not used: %s (an entry is machine code); fix the permissions "
                        "(chmod go-w, or own it) or point HLOSERVE_CACHE elsewhere", self.dir, self.refused)

    @staticmethod
    def key(parts: Mapping[str, Any]) -> str:
        blob = json.dumps({"format": FORMAT, "jax": jax.__version__, "jaxlib": jax.lib.__version__, **parts},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def path(self, key: str) -> str:
        return os.path.join(self.dir, f"{key}{SUFFIX}")

    def get(self, key: str, devices: Sequence[Any]) -> CachedExecutable | None:
        """The executable for `key` loaded onto `devices` (in compile order), or None."""
        path = self.path(key)
        if self.refused or not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                blob = f.read()
            line, sep, payload = blob.partition(b"\n")
            if not sep:
                raise ValueError("no header line")
            header = EntryHeader.from_json(line.decode("utf-8"))
            client = devices[0].client
            want = {"key": key, "jax": jax.__version__, "jaxlib": jax.lib.__version__, "platform": client.platform}
            got = {k: getattr(header, k) for k in want}
            if got != want:
                raise ValueError(f"written for {got}, looked up for {want}")
            if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
                raise ValueError("payload digest mismatch (truncated or overwritten)")
            loaded = client.deserialize_executable(payload, list(devices), None)
            return CachedExecutable(loaded, header, devices)
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss; it is rewritten after compiling
            LOG.warning("executable cache entry %s not used (%s: %s); recompiling", path, type(e).__name__, e)
            return None

    def evict(self, key: str) -> None:
        try:
            os.remove(self.path(key))
        except OSError:
            pass

    def put(self, key: str, compiled: Any, devices: Sequence[Any]) -> None:
        """Write `compiled` (a jax.stages.Compiled of a function with flat array outputs)."""
        if self.refused or self.full:
            return
        try:
            unloaded = compiled._executable._unloaded_executable
            loaded = unloaded.xla_executable
            payload = loaded.client.serialize_executable(loaded)
            out_avals = jax.tree.leaves(compiled.out_info)
            out_shardings = jax.tree.leaves(compiled.output_shardings)
            single = jax.tree_util.treedef_is_leaf(compiled.out_tree)
            if not single and compiled.out_tree not in (jax.tree.structure(tuple(out_avals)),
                                                        jax.tree.structure(list(out_avals))):
                raise ValueError(f"outputs are not a flat sequence ({compiled.out_tree})")
            header = EntryHeader(
                FORMAT, key, jax.__version__, jax.lib.__version__, loaded.client.platform,
                hashlib.sha256(payload).hexdigest(), tuple(sorted(unloaded.kept_var_idx)),
                tuple(_output_spec(a, s, devices) for a, s in zip(out_avals, out_shardings)), single)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            write_atomically(self.path(key), [header.to_json().encode() + b"\n", payload])
        except Exception as e:  # noqa: BLE001 - caching is an optimization; the executable still runs
            if disk_full(e):
                self._stop_writing(e)
            else:
                LOG.info("executable not written to the cache %s (%s: %s)", self.dir, type(e).__name__, e)

    def _stop_writing(self, e: OSError) -> None:
        """The disk is full: no more compiled executables are written by this process, ours or jax's,
        and jax's entries it left cut short are removed (see the module docstring)."""
        self.full = True
        jax_dir = os.path.dirname(self.dir)
        configure_compile_cache(None)
        cut = unreadable_compile_cache_entries(jax_dir, self.opened - 1)
        for path in cut:
            try:
                os.remove(path)
            except OSError:
                pass
        removed = f" ({len(cut)} entries of jax's cache left cut short removed)" if cut else ""
        LOG.warning("the disk holding %s is full (%s): compiled executables are not cached for the rest of this "
                    "process%s; free space there or point HLOSERVE_CACHE at a disk with room", jax_dir,
                    e.strerror or e, removed)
