"""One artifact function: compile per concrete (bucketed) shape, cache, call, count recompiles.

A call goes: check the inputs against the manifest (bind_symbols: names, rank,
static dims, symbol ranges) -> coerce dtypes -> pick each paddable dim's bucket
-> pad on the host -> look the bucketed shapes up in the in-memory executable
table (compiling on a miss, through jax's persistent cache) -> run with the
device-resident weights -> slice padded outputs back.

Outputs whose shape involves a padded dim come back as numpy views of the
bucket-sized result (slicing on the host compiles nothing); all other outputs
stay on the device as jax arrays (a donated KV cache never leaves it).

Recompile accounting: every compile bumps `stats.compiles` and logs one line
naming the function, the concrete shapes, and the dim whose new value caused it.
After `warmup`, a compile is unplanned: it logs a warning, and in strict mode it
raises RecompileError instead of compiling.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact.errors import HloserveError, ShapeConstraintError
from jax import export as jax_export

from . import buckets as buckets_mod
from .client import compile_events
from .exec_cache import ExecutableCache
from .sharding import place

LOG = logging.getLogger("hloserve.runtime")

_FLOATS = ("f64", "f32", "bf16", "f16")
Env = tuple[tuple[str, int], ...]   # sorted (symbol, value) pairs: the compile key


class RecompileError(HloserveError):
    """Strict mode: a call needs an executable that warm-up did not build."""


@dataclasses.dataclass
class FunctionStats:
    """Counters of one function (they only grow).

    Attributes:
      calls: completed calls.
      compiles: executables built (persistent cache hits included: each is still a new shape).
      compiles_after_warmup: of those, built after warmup() (unplanned; 0 in a healthy server).
      persistent_cache_hits: executables read from the on-disk compilation cache.
      compile_seconds: wall time spent lowering + compiling (or reading the cache).
      padded_calls: calls whose inputs were padded up to a bucket.
    """
    calls: int = 0
    compiles: int = 0
    compiles_after_warmup: int = 0
    persistent_cache_hits: int = 0
    compile_seconds: float = 0.0
    padded_calls: int = 0


@dataclasses.dataclass(frozen=True)
class CompileInfo:
    """What `Function.prepare` did.

    Attributes:
      env: the (bucketed) symbol values the executable is for.
      compiled: a new executable was built (False: it was already in memory).
      seconds: time spent building it (0 when it was in memory).
      from_disk: it came from the executable cache or jax's persistent cache.
    """
    env: Mapping[str, int]
    compiled: bool
    seconds: float
    from_disk: bool


def coerce(name: str, value: Any, spec: artifact.TensorSpec) -> Any:
    """Accept numpy/jax arrays and nested lists; narrow i64->i32 / f64->f32 as the exporter does."""
    want = artifact.numpy_dtype(spec.dtype)
    if isinstance(value, jax.Array):
        if value.dtype != want:
            raise ShapeConstraintError(f"input {name!r} has dtype {value.dtype}, expected {spec.dtype} "
                                       f"({spec.describe()}); convert it before the call")
        return value
    arr = np.asarray(value)
    if arr.dtype == want:
        return arr
    if arr.dtype.kind in "iu" and want.kind in "iu":
        if arr.size and (arr.min() < np.iinfo(want).min or arr.max() > np.iinfo(want).max):
            raise ShapeConstraintError(f"input {name!r} has values outside {spec.dtype}'s range")
        return arr.astype(want)
    if arr.dtype.kind == "f" and spec.dtype in _FLOATS:       # f64 -> f32, f32 -> bf16/f16, ...
        return arr.astype(want)
    raise ShapeConstraintError(f"input {name!r} has dtype {arr.dtype}, expected {spec.dtype} ({spec.describe()}); "
                               f"convert it before the call")


def _describe_env(env: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "static shapes"


class Function:
    """A callable artifact function bound to device-resident weights.

    `fn(**inputs) -> {output name: array}`. Thread-safe; compiles are serialized.
    """

    def __init__(self, spec: artifact.FunctionSpec, symbols: Mapping[str, artifact.SymbolSpec],
                 exported: jax_export.Exported, weights: Sequence[jax.Array], weight_shardings: Sequence[Any],
                 input_sharding: Any, buckets: buckets_mod.Buckets, *, strict: bool = False,
                 exec_cache: ExecutableCache | None = None, devices: Sequence[Any] = (),
                 cache_identity: Mapping[str, Any] | None = None,
                 compiler_options: Mapping[str, str] | None = None,
                 input_shardings: Mapping[str, Any] | None = None, kernels: int = 0,
                 per_shape: Callable[[Sequence[Any]], jax_export.Exported] | None = None):
        self.spec = spec
        self.symbols = symbols
        self.exported = exported
        self.buckets = buckets
        self.strict = strict
        self.kernels = kernels   # composites this runtime runs as kernels (runtime/kernels/), not decompositions
        self.stats = FunctionStats()
        self.warmed = False
        self._weights = list(weights)
        self._weight_avals = [jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s)
                              for w, s in zip(weights, weight_shardings)]
        # per input: its own sharding (a KV cache split over a mesh) or the default (replicated)
        self._in_shardings = {t.name: (input_shardings or {}).get(t.name, input_sharding) for t in spec.inputs}
        self._dims = sorted(artifact.names_in([d for t in spec.inputs for d in t.shape]))
        self._paddable = set(spec.paddable)
        donate = tuple(len(self._weights) + i for i, t in enumerate(spec.inputs) if t.name in spec.donated)
        out_shardings = None
        if input_shardings:   # an output that replaces a split input (the donated cache) stays split
            out_shardings = tuple(self._in_shardings.get(t.name, input_sharding) for t in spec.outputs)
        self._jit = jax.jit(exported.call, donate_argnums=donate, out_shardings=out_shardings)
        # accelerator kernels: the function re-exported at each compiled shape with its kernels linked
        # in (runtime/kernels/pallas/)
        self._per_shape = per_shape
        self._jit_options = {"donate_argnums": donate, "out_shardings": out_shardings}
        self._executables: dict[Env, Any] = {}
        self._lock = threading.Lock()
        # on-disk executable cache: the key is the identity (artifact function digest, shardings,
        # devices) plus the symbol values, so a warm start needs no lowering
        self._exec_cache = exec_cache
        self._exec_cache_keys: dict[Env, str] = {}   # executables read from the executable cache
        self._devices = list(devices)
        self._compiler_options = dict(compiler_options or {})
        self._cache_identity = dict(cache_identity or {}, donated=list(donate),
                                    compiler_options=sorted(self._compiler_options.items()))

    def input_sharding(self, name: str) -> Any:
        """The sharding input `name` is placed with (a split KV cache, or replicated)."""
        return self._in_shardings[name]

    # -- compile ----------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def compiled_shapes(self) -> list[dict[str, int]]:
        """The symbol values of every executable built so far."""
        return [dict(k) for k in self._executables]

    def _cause(self, env: Mapping[str, int]) -> str:
        if not self._executables:
            return "first compile" if env else "first compile (static shapes)"
        seen: dict[str, set[int]] = {}
        for key in self._executables:
            for k, v in key:
                seen.setdefault(k, set()).add(v)
        new = [f"{k}={v}" for k, v in sorted(env.items()) if v not in seen.get(k, ())]
        if new:
            return f"new {', '.join(new)}"
        return f"new combination {_describe_env(env)}"

    def _executable(self, env: Mapping[str, int], requested: Mapping[str, int] | None = None,
                    *, warming: bool = False) -> Any:
        key: Env = tuple(sorted(env.items()))
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        with self._lock:
            exe = self._executables.get(key)
            if exe is not None:
                return exe
            shapes = ", ".join(f"{t.name}={t.dtype}[{','.join(map(str, artifact.concrete_shape(t, env)))}]"
                               for t in self.spec.inputs)
            cause = self._cause(env)
            padded = ""
            if requested and dict(requested) != dict(env):
                padded = f" (bucket for {_describe_env(requested)})"
            after = self.warmed and not warming
            if after and self.strict:
                raise RecompileError(
                    f"strict mode: function {self.name!r} needs a new executable for {_describe_env(env)}{padded} "
                    f"after warm-up ({cause}); warm it up (model.warmup(sizes=...)) or add the size to the "
                    f"buckets of {', '.join(sorted(env)) or 'its dims'}")
            t0 = time.perf_counter()
            exe, source = self._build(env)
            secs = time.perf_counter() - t0
            hit = source != "compiled"
            self.stats.compiles += 1
            self.stats.compiles_after_warmup += int(after)
            self.stats.persistent_cache_hits += int(hit)
            self.stats.compile_seconds += secs
            self._executables[key] = exe
            level = logging.WARNING if after else logging.INFO
            LOG.log(level, "%scompile #%d of %r for %s%s: %s; %s in %.2f s%s",
                    "unplanned " if after else "", self.stats.compiles, self.name, shapes, padded, cause,
                    source, secs,
                    " (after warm-up: add this size to the buckets or warm it up)" if after else "")
            return exe

    def _build(self, env: Mapping[str, int], *, read_cache: bool = True) -> tuple[Any, str]:
        """Executable for `env` from the executable cache (unless read_cache is False), jax's
        persistent cache, or XLA."""
        avals = list(self._weight_avals)
        avals += [jax.ShapeDtypeStruct(artifact.concrete_shape(t, env), artifact.numpy_dtype(t.dtype),
                                       sharding=self._in_shardings[t.name]) for t in self.spec.inputs]
        key = None
        if self._exec_cache is not None and self._devices:
            key = ExecutableCache.key({**self._cache_identity, "env": sorted(env.items())})
            exe = self._exec_cache.get(key, self._devices) if read_cache else None
            if exe is not None:
                self._exec_cache_keys[tuple(sorted(env.items()))] = key
                return exe, "read from the executable cache"
        events = compile_events()
        hits0 = events.cache_hits
        jit = self._jit if self._per_shape is None else jax.jit(self._per_shape(avals).call, **self._jit_options)
        exe = jit.lower(*avals).compile(compiler_options=self._compiler_options or None)
        if events.cache_hits > hits0:
            # NOTE: an XLA:CPU executable deserialized from jax's cache re-serializes without its
            # kernels ("Function wrapped_iota not found" in the next process): only fresh compiles
            # are written to the executable cache.
            return exe, "read from jax's persistent compilation cache"
        if key is not None:
            self._exec_cache.put(key, exe, self._devices)
        return exe, "compiled"

    def _run(self, key: Env, env: Mapping[str, int], requested: Mapping[str, int], args: list) -> Any:
        """Run the executable for `key`; one read from the executable cache that fails to run is
        evicted and rebuilt once (a bad entry is a miss, never an error)."""
        exe = self._executable(env, requested)
        if not isinstance(exe, jax.stages.Compiled):   # read from the executable cache: it takes placed arrays
            args = self._placed(args)
        try:
            return exe(*args)
        except Exception as e:  # noqa: BLE001 - re-raised unless the executable came from the cache
            cache_key = self._exec_cache_keys.pop(key, None)
            if cache_key is None:
                raise
            LOG.warning("executable cache entry for %r %s failed to run (%s); evicting and recompiling",
                        self.name, _describe_env(env), e)
            self._exec_cache.evict(cache_key)
            with self._lock:   # the same shape rebuilt, not a new one: no compile is counted
                exe, _ = self._build(env, read_cache=False)
                self._executables[key] = exe
            return exe(*args)

    def _placed(self, args: list) -> list:
        """`args` (the weights, then the inputs in the spec's order) with the inputs still on the host
        placed by their shardings, in one batched device_put."""
        first = len(self._weights)
        host = [i for i in range(first, len(args)) if isinstance(args[i], np.ndarray)]
        if not host:
            return args
        shardings = [self._in_shardings[self.spec.inputs[i - first].name] for i in host]
        placed = jax.device_put([args[i] for i in host], shardings)
        args = list(args)
        for i, a in zip(host, placed):
            args[i] = a
        return args

    def warmup_envs(self, sizes: Mapping[str, Sequence[int]] | None = None) -> list[dict[str, int]]:
        """Symbol values to compile ahead of time: every bucket of each paddable dim (or the buckets
        of the sizes given), times the sizes given for each other dim."""
        sizes = dict(sizes or {})
        axes: list[list[int]] = []
        for dim in self._dims:
            sym = self.symbols.get(dim)
            if dim in self.buckets.sizes:
                given = sizes.get(dim)
                vals = self.buckets.sizes[dim] if given is None else sorted(
                    {self.buckets.bucket(dim, int(v)) or int(v) for v in given})
            elif dim in sizes:
                vals = sorted({int(v) for v in sizes[dim]})
            elif sym is not None and sym.max is not None and sym.min == sym.max:
                vals = [sym.min]
            else:
                raise HloserveError(f"warm-up of {self.name!r}: dim {dim!r} is not paddable, so it compiles per "
                                    f"exact size; give its sizes, e.g. warmup(sizes={{{dim!r}: [128, 512]}})")
            axes.append(list(vals))
        envs = []
        for combo in itertools.product(*axes):
            env = dict(zip(self._dims, combo))
            shapes = {t.name: artifact.concrete_shape(t, env) for t in self.spec.inputs}
            artifact.bind_symbols(self.spec, self.symbols, shapes)   # range checks name the input
            envs.append(env)
        return envs

    def warmup(self, sizes: Mapping[str, Sequence[int]] | None = None,
               progress: Callable[[str], None] | None = None, *, run: bool | None = None) -> int:
        """Compile every warm-up shape (see warmup_envs); returns how many were new.

        run: also execute each newly compiled executable once on zeros. XLA:CPU initializes a
        fresh executable's kernels on its first run (~0.25 s for MiniLM, ~0.4 s for an LLM
        prefill step), which would otherwise land on the first real request of each bucket; one
        read from the executable cache runs at its steady speed from the first call (measured:
        docs/performance.md), so it is not run. The default runs functions without donated inputs
        only: a dummy run of a function with a donated KV cache would need a second cache's worth
        of memory.
        """
        if run is None:
            run = not self.spec.donated
        envs = self.warmup_envs(sizes)
        new = 0
        for i, env in enumerate(envs, 1):
            key = tuple(sorted(env.items()))
            if key in self._executables:
                continue
            t0 = time.perf_counter()
            exe = self._executable(env, warming=True)
            new += 1
            if run and not self.from_executable_cache(env):
                args = list(self._weights) + [
                    place(np.zeros(artifact.concrete_shape(t, env), artifact.numpy_dtype(t.dtype)),
                          self._in_shardings[t.name]) for t in self.spec.inputs]
                jax.block_until_ready(exe(*args))
                del args
            if progress:
                progress(f"warm-up {self.name} {i}/{len(envs)}: {_describe_env(env)} "
                         f"({time.perf_counter() - t0:.2f} s)")
        self.warmed = True
        return new

    def from_executable_cache(self, env: Mapping[str, int]) -> bool:
        """Whether the executable for `env` was deserialized from the executable cache (not compiled)."""
        return tuple(sorted(env.items())) in self._exec_cache_keys

    # -- call -------------------------------------------------------------
    def bind(self, inputs: Mapping[str, Any]) -> dict[str, int]:
        """Check input names and shapes against the manifest; returns the symbol values."""
        shapes = {k: tuple(np.shape(v)) for k, v in inputs.items()}
        return artifact.bind_symbols(self.spec, self.symbols, shapes)

    def _plan(self, inputs: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """(symbol values of the call, the bucketed values it runs at)."""
        env = self.bind(inputs)
        env = {k: env[k] for k in self._dims if k in env}
        padded_env = dict(env)
        for k, v in env.items():
            if k in self._paddable:
                b = self.buckets.bucket(k, v)
                padded_env[k] = v if b is None else b
        return env, padded_env

    def prepare(self, **inputs: Any) -> CompileInfo:
        """Build (or find) the executable a call with these inputs would use, without running it."""
        env, padded_env = self._plan(inputs)
        before = (self.stats.compiles, self.stats.compile_seconds, self.stats.persistent_cache_hits)
        self._executable(padded_env, env)
        return CompileInfo(padded_env, self.stats.compiles > before[0], self.stats.compile_seconds - before[1],
                           self.stats.persistent_cache_hits > before[2])

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        env, padded_env = self._plan(inputs)
        padded = padded_env != env
        args = list(self._weights)
        for t in self.spec.inputs:
            value = coerce(t.name, inputs[t.name], t)
            if padded:
                value = buckets_mod.pad_to(t.name, value, artifact.concrete_shape(t, padded_env))
            sharding = self._in_shardings[t.name]
            # a host array goes to the executable as it is: jax places it by the sharding it was
            # compiled with, in C++ (30 us for a step's seven inputs, against 280 us through
            # device_put one by one), and so does a device array already where it goes (the KV
            # cache: device_put's Python took 70 us to return it); a multi-host sharding needs each
            # process's part placed (place)
            direct = sharding.is_fully_addressable and (
                isinstance(value, np.ndarray) or (isinstance(value, jax.Array) and value.sharding == sharding))
            args.append(value if direct else place(value, sharding))
        outs = self._run(tuple(sorted(padded_env.items())), padded_env, env, args)
        self.stats.calls += 1
        self.stats.padded_calls += int(padded)
        result = {}
        for t, o in zip(self.spec.outputs, outs):
            result[t.name] = buckets_mod.slice_to(o, artifact.concrete_shape(t, env)) if padded else o
        return result
