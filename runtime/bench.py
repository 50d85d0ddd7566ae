"""`hloserve bench`: compile time, latency p50/p99 and throughput of one artifact function.

Inputs are synthetic (ones for integer inputs, a fixed normal sample for floats),
shaped from `--shape INPUT:2x16` and `--shape DIM=N` specs; inputs not given take
their shape from the dims the given ones bind.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

import jax
import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact.errors import HloserveError
from hloserve.runtime.progress import QUIET, Reporter

from .model import load


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """One benchmark run (seconds unless noted).

    Attributes:
      load_s: artifact load (verify, weights to device).
      compile_s: building the executable (0 if cached in memory); from_disk: it came from a disk cache.
      first_run_s: the first call after compiling (XLA initializes kernels on it).
      latencies_s: every timed call, in order.
      rows: the leading dim of the first input (rows per call, for rows/s).
    """
    function: str
    shapes: dict[str, tuple[int, ...]]
    load_s: float
    compile_s: float
    from_disk: bool
    first_run_s: float
    latencies_s: tuple[float, ...]
    rows: int

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.latencies_s, 50)) * 1e3

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.latencies_s, 99)) * 1e3

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies_s) / sum(self.latencies_s)


def parse_shapes(specs: Sequence[str], fn: artifact.FunctionSpec) -> dict[str, tuple[int, ...]]:
    """--shape specs -> a shape for every input of `fn` (dims bound by given inputs fill the rest)."""
    given: dict[str, tuple[int, ...]] = {}
    env: dict[str, int] = {}
    names = {t.name: t for t in fn.inputs}
    for spec in specs:
        m = re.fullmatch(r"\s*([^:=\s]+)\s*([:=])\s*(\d+(?:\s*[x,]\s*\d+)*)\s*", spec)
        if not m:
            raise HloserveError(f"--shape {spec!r}: expected INPUT:2x16 (an input's shape) or DIM=16 (a dim's size)")
        name, kind, value = m.groups()
        try:
            dims = tuple(int(v) for v in re.split(r"[x,]", value.replace(" ", "")) if v != "")
        except ValueError:
            raise HloserveError(f"--shape {spec!r}: sizes must be integers, e.g. {name}:2x16") from None
        if kind == ":":
            if name not in names:
                raise HloserveError(f"--shape {spec!r}: function {fn.name!r} has no input {name!r}; "
                                    f"its inputs are {list(names)}")
            given[name] = dims
            for want, got in zip(names[name].shape, dims):
                if isinstance(want, str) and want.isidentifier():
                    env.setdefault(want, got)
        else:
            if len(dims) != 1:
                raise HloserveError(f"--shape {spec!r}: a dim takes one size, e.g. {name}=16")
            env[name] = dims[0]
    shapes = {}
    for t in fn.inputs:
        if t.name in given:
            shapes[t.name] = given[t.name]
            continue
        missing = sorted(artifact.names_in(t.shape) - env.keys())
        if missing:
            raise HloserveError(f"--shape: the shape of input {t.name!r} ({t.describe()}) needs "
                                f"{', '.join(missing)}; give --shape {t.name}:... or --shape {missing[0]}=N")
        shapes[t.name] = artifact.concrete_shape(t, env)
    return shapes


def synthetic_inputs(fn: artifact.FunctionSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Ones for integer/bool inputs (valid token ids, masks and indices), a fixed normal sample for floats."""
    rng = np.random.default_rng(0)
    out = {}
    for t in fn.inputs:
        dtype = artifact.numpy_dtype(t.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.kind == "V":
            out[t.name] = rng.standard_normal(shapes[t.name], dtype=np.float32).astype(dtype)
        else:
            out[t.name] = np.ones(shapes[t.name], dtype)
    return out


def bench(model: Any, name: str, inputs: dict[str, Any], *, iters: int = 100, warmup_iters: int = 3,
          reporter: Reporter = QUIET, load_s: float = 0.0) -> BenchResult:
    """Time one function of a loaded model on `inputs`."""
    fn = model.functions[name]
    fn.bind(inputs)
    reporter.stage(f"compiling {name} for " + ", ".join(f"{k}={list(np.shape(v))}" for k, v in inputs.items()))
    info = fn.prepare(**inputs)
    reporter.stage(f"executable ready in {info.seconds:.2f} s"
                   + (" (from the cache)" if info.from_disk else "" if info.compiled else " (in memory)"))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(**inputs))
    first = time.perf_counter() - t0
    for _ in range(warmup_iters):
        jax.block_until_ready(fn(**inputs))
    lat = []
    with reporter.bar(iters, f"{name} x{iters}", unit="calls") as advance:
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(**inputs))
            lat.append(time.perf_counter() - t0)
            advance(1)
    first_input = next(iter(inputs.values()))
    rows = int(np.shape(first_input)[0]) if np.ndim(first_input) else 1
    return BenchResult(name, {k: tuple(np.shape(v)) for k, v in inputs.items()}, load_s, info.seconds,
                       info.from_disk, first, tuple(lat), rows)


def run_bench(path: str, shape_specs: Sequence[str], *, function: str | None = None, iters: int = 100,
              warmup_iters: int = 3, platform: str | None = None, cache_dir: Any = None,
              reporter: Reporter = QUIET) -> BenchResult:
    """`hloserve bench`: load, time, print a summary to stdout."""
    if iters < 1:
        raise HloserveError(f"--iters {iters}: give at least 1")
    reporter.stage(f"loading {path}")
    t0 = time.perf_counter()
    model = load(path, platform=platform, cache_dir=cache_dir)
    load_s = time.perf_counter() - t0
    name = function or next(iter(model.functions))
    if name not in model.functions:
        raise HloserveError(f"--function {name!r}: the artifact has {sorted(model.functions)}")
    shapes = parse_shapes(shape_specs, model.functions[name].spec)
    inputs = synthetic_inputs(model.functions[name].spec, shapes)
    r = bench(model, name, inputs, iters=iters, warmup_iters=warmup_iters, reporter=reporter, load_s=load_s)
    shown = ", ".join(f"{k}={artifact.TensorSpec(k, t.dtype, v).describe()}"
                      for (k, v), t in zip(r.shapes.items(), model.functions[name].spec.inputs))
    print(f"function: {name}({shown}) on {model.client.describe()}")
    print(f"load: {r.load_s:.2f} s")
    print(f"compile: {r.compile_s:.2f} s{' (from the persistent cache)' if r.from_disk else ''}")
    print(f"first run: {r.first_run_s * 1e3:.1f} ms")
    print(f"latency: p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms over {len(r.latencies_s)} calls")
    print(f"throughput: {r.calls_per_s:.1f} calls/s, {r.calls_per_s * r.rows:.1f} rows/s (rows per call: {r.rows})")
    return r
