"""Building the CPU kernels once per machine and registering them with XLA.

    library = build.library(report)     # <cache>/kernels/<key>/libhloserve_cpu.so, or None
                                        # ($HLOSERVE_KERNEL_CACHE/<key>/... where that is set)

The .cc files beside this module are compiled with the system C++ compiler for this CPU
(-march=native) against jaxlib's XLA FFI headers, one process per file, and linked into one
library, keyed by the sources, compiler, flags, jaxlib and CPU. A build record (key, sha256) is
written beside the library; a library whose record is missing or names other bytes is rebuilt,
never loaded. The library's FFI targets (targets.py) are registered for the CPU platform only.

Each file's object is kept too (<root>/objects/, keyed by that file, the headers, compiler, flags,
jaxlib and CPU, with a record of its bytes like the library's): a build after one file changed, or
of a library found damaged, compiles only what no kept object covers and links.

The build runs in a temporary directory; the library and its record are then kept in the cache,
each written whole or not at all. Where the cache cannot keep them (a full or read-only disk) the
library is kept in this process's private directory instead, with one warning: the kernels run,
and the next start builds them again. Processes that start together on a cache without the library
(replicas sharing it, the suite's workers) build it once: the others wait on a lock
(paths.made_once), then load what it built.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Callable

from ...paths import cache_dir, kernel_dir, made_once, untrusted, write_atomically
from .targets import SYMBOLS, Cpu

LOG = logging.getLogger("hloserve.runtime")
HERE = os.path.dirname(__file__)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-fPIC")
# -march=native, unless HLOSERVE_CPU_KERNEL_MARCH names another target (tests build the fallbacks a
# CPU without AMX or AVX512-BF16 runs, e.g. x86-64-v3, on a CPU that has them)
MARCH_ENV = "HLOSERVE_CPU_KERNEL_MARCH"
ENV = "HLOSERVE_CPU_KERNELS"     # "0" turns the kernels off (the portable decompositions run)
# "1": only the head shapes the kernel tests run get a specialized decode attention (the fallback
# builds' tests: a quarter of the attention files' compile); never set for serving
TESTED_SHAPES_ENV = "HLOSERVE_CPU_KERNEL_TESTED_SHAPES"


@dataclasses.dataclass(frozen=True)
class Library:
    """A built kernel library: its file and the digest that identifies the code (cache keys)."""
    path: str
    digest: str


def sources() -> list[str]:
    """The kernels' C++ files (and the header they share), in a stable order."""
    return sorted(glob.glob(os.path.join(HERE, "*.cc")) + glob.glob(os.path.join(HERE, "*.h")))


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def library(report: Callable[[str], None] | None = None) -> Library | None:
    """The CPU kernels, built on first use on this machine and registered with XLA; None when
    they are turned off or cannot be built (then the composites run their decompositions)."""
    if not enabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        LOG.warning("no C++ compiler (g++/clang++, or $CXX): the CPU kernels are off, "
                    "attention runs its portable formulation")
        return None
    key = _key(compiler)
    root = _root()
    path = os.path.join(root, key[:24], "libhloserve_cpu.so")
    shared = [cache_dir()] if root == os.path.join(cache_dir(), "kernels") else []   # the root it sits in, if any
    refused = untrusted(*shared, root, os.path.dirname(path))
    if refused:
        LOG.warning("the CPU kernels in %s are not loaded: %s (the library runs in this process); fix the "
                    "permissions or point HLOSERVE_CACHE elsewhere. The portable formulations run.", root, refused)
        return None
    if _problem(path, key):
        with made_once(path):   # processes starting together (replicas, the suite's workers) build it once
            problem = _problem(path, key)     # looked at again: another process may have built it meanwhile
            if problem:
                path, err = _built(compiler, path, key, problem, report)
                if err:
                    LOG.warning("the CPU kernels could not be built (%s); attention runs its portable formulation",
                                err)
                    return None
    _register(path)
    return Library(path, key)


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++, c++ or clang++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def object_names(compiler: str) -> dict[str, str]:
    """.cc file name -> the name its object of this build is kept under (objects/ of the kernel
    cache, where objects of earlier sources stay beside it)."""
    shared = _shared(compiler)
    return {os.path.basename(src): _object_key(src, shared)[:24] + ".o" for src in sources() if src.endswith(".cc")}


def _key(compiler: str) -> str:
    parts = [pathlib.Path(f).read_bytes() for f in sources()]
    return hashlib.sha256(b"\0".join(parts + _toolchain(compiler))).hexdigest()


def _shared(compiler: str) -> list[bytes]:
    """What every .cc's object depends on besides itself: the headers beside it and the toolchain."""
    return [pathlib.Path(h).read_bytes() for h in sources() if h.endswith(".h")] + _toolchain(compiler)


def _object_key(src: str, shared: list[bytes]) -> str:
    """What one .cc's object depends on: the file and `shared` (every header beside it and the
    toolchain: _compile reads them once for all the files)."""
    return hashlib.sha256(b"\0".join([pathlib.Path(src).read_bytes(), *shared])).hexdigest()


def _toolchain(compiler: str) -> list[bytes]:
    import jax
    return [_compiler_version(compiler).encode(), " ".join(flags()).encode(), jax.__version__.encode(),
            cpu_identity().encode()]


def _root() -> str:
    root = kernel_dir()
    try:
        os.makedirs(root, exist_ok=True)
        return root
    except OSError as e:   # a read-only or full cache volume: built for this process only, in a private directory
        LOG.warning("the CPU kernels cannot be kept in %s (%s); building them for this process only", root,
                    e.strerror or e)
        return _private_dir()


@functools.cache
def _private_dir() -> str:
    return tempfile.mkdtemp(prefix="hloserve-kernels-")   # 0700, this process's own


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _problem(path: str, key: str) -> str | None:
    """Why the library at `path` cannot be loaded as it is ("not built yet", or _check_built's reason), or None."""
    return _check_built(path, key) if os.path.exists(path) else "not built yet"


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


def march() -> str:
    return os.environ.get(MARCH_ENV, "native")


def flags() -> tuple[str, ...]:
    tested = ("-DHLOSERVE_TESTED_SHAPES_ONLY",) if os.environ.get(TESTED_SHAPES_ENV) == "1" else ()
    return tuple(f"-march={march()}" if f == "-march=native" else f for f in FLAGS) + tested


def cpu() -> Cpu:
    """What the built code may use: this CPU's flags when built for it (-march=native)."""
    text = cpu_identity()
    listed = [ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags") and ":" in ln]
    return Cpu(native=march() == "native", flags=frozenset(" ".join(listed).split()))


def _compile(compiler: str, out_dir: str, kept: str | None) -> str | None:
    """Each .cc to an object file in `out_dir` (in parallel), or the one kept for it in `kept` (a
    directory of objects and their records; None: none), then linked into out_dir/lib.so; the new
    objects are kept there (where they cannot be, they are not). Returns an error line or None."""
    import jax
    objects, procs, fresh = [], [], []
    shared = _shared(compiler)
    for src in (s for s in sources() if s.endswith(".cc")):
        key = _object_key(src, shared)
        cached = os.path.join(kept, key[:24] + ".o") if kept else None
        if cached and os.path.exists(cached) and _check_built(cached, key) is None:
            objects.append(cached)
            continue
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        objects.append(obj)
        fresh.append((obj, cached, key))
        procs.append(subprocess.Popen([compiler, *flags(), "-c", "-I", jax.ffi.include_dir(), src, "-o", obj],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    LOG.info("CPU kernels: compiling %d of %d files (the rest kept from an earlier build)", len(procs), len(objects))
    link = [compiler, "-shared", *objects, "-o", os.path.join(out_dir, "lib.so")]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            return _failure(compiler, proc.returncode, err)
    proc = subprocess.run(link, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return _failure(compiler, proc.returncode, proc.stderr)
    for obj, cached, key in fresh:
        if cached:
            with contextlib.suppress(OSError):    # a full or read-only disk: the next build compiles it again
                _keep_record(obj, cached, key)
    return None


def _failure(compiler: str, code: int, stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.splitlines() or ["?"]
    return f"{os.path.basename(compiler)} exited {code}: {errors[0][:300]}"


def _built(compiler: str, path: str, key: str, problem: str,
           report: Callable[[str], None] | None) -> tuple[str | None, str | None]:
    """Build the library that belongs at `path` (see the module docstring): (where it is, None), or
    (None, an error line)."""
    private = os.path.join(_private_dir(), f"{key[:24]}.so")
    if os.path.exists(private):     # this process built it before, and the cache could not keep it
        return private, None
    if problem != "not built yet":
        LOG.warning("rebuilding the CPU kernel library %s: %s", path, problem)
    if report:
        report("building hloserve's CPU kernels for this machine (once per machine; about a minute on 2 cores)")
    kept = os.path.join(os.path.dirname(os.path.dirname(path)), "objects")
    if untrusted(kept):    # code others may have written is not linked in: compiled afresh, nothing kept
        kept = None
    try:
        with tempfile.TemporaryDirectory(prefix="hloserve-kernels-build-") as work:
            err = _compile(compiler, work, kept)
            return (None, err) if err else (_keep(os.path.join(work, "lib.so"), path, key, private), None)
    except subprocess.TimeoutExpired as e:
        return None, f"{os.path.basename(compiler)}: {e}"
    except OSError as e:   # no compiler to run, or no room to build in
        return None, f"{os.path.basename(compiler)}: {e.strerror or e}"


def _keep(built: str, path: str, key: str, private: str) -> str:
    """Keep the library `built` at `path` with its build record, each written whole or not at all
    (the record first: a library without one is never loaded); where that fails (a full or read-only
    disk), at `private`, this process's own, with one warning. Returns where it is kept."""
    try:
        _keep_record(built, path, key)
        return path
    except OSError as e:
        LOG.warning("the CPU kernels cannot be kept in %s (%s): built for this process only, the next start builds "
                    "them again; free space there or point HLOSERVE_CACHE at a disk with room",
                    os.path.dirname(path), e.strerror or e)
        shutil.move(built, private)
        return private


def _keep_record(built: str, path: str, key: str) -> None:
    """`built` copied to `path` with its record (`path`.json: the key and the bytes' sha256), the
    record first, each written whole or not at all; raises OSError where they cannot be written (and
    leaves no record naming bytes that are not there)."""
    data = pathlib.Path(built).read_bytes()
    record = json.dumps({"key": key, "sha256": hashlib.sha256(data).hexdigest()}).encode()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomically(path + ".json", [record])
        write_atomically(path, [data])
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(path + ".json")
        raise


@functools.cache
def _register(path: str) -> None:
    """Load the library and register its targets with XLA (once per process and file)."""
    import jax
    lib = ctypes.CDLL(path)
    for symbol in SYMBOLS:
        jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return compiler


@functools.cache
def cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform
        return platform.processor()
