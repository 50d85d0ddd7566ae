"""`hloserve inspect`, `run` and `bench`: the runtime's subcommands (never import torch)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from .artifact.errors import HloserveError


def _inspect(args: argparse.Namespace) -> int:
    from hloserve.runtime import artifact
    m = artifact.read_manifest(args.artifact)
    artifact.verify_files(args.artifact, m)
    reader = artifact.weights.Reader(os.path.join(args.artifact, artifact.WEIGHTS))   # header, sizes, truncation
    artifact.verify_weights(args.artifact, m, reader, hashes=args.verify)
    total = sum(1 for _ in m.weights)
    nbytes = os.path.getsize(os.path.join(args.artifact, artifact.WEIGHTS))
    if args.json:
        print(json.dumps(m.to_json(), indent=2))
        return 0
    print(f"artifact {args.artifact} (format {m.format_version}, "
          + ", ".join(f"{k} {v}" for k, v in m.producer.items()) + ")")
    print(f"source: {m.source}")
    schemes = collections.Counter(w.quant["scheme"] for w in m.weights.values() if w.quant)
    stored = "".join(f", {n} stored as {k}" for k, n in sorted(schemes.items()))
    print(f"weights: {total} tensors, {nbytes / 2**20:.1f} MiB{stored}")
    for line in _quantized(m):
        print(line)
    if m.is_llm:
        llm = artifact.LLMSpec.of(m, args.artifact)
        kv = llm.kv_cache
        held = f" holding {kv.holds} bits" if kv.holds else f" rows of {kv.quant} values and a bf16 scale" if kv.quant else ""
        print(f"llm: step contract v{llm.version}, block {llm.block_size}, context {llm.max_context}, "
              f"{llm.max_seqs} seqs / {llm.max_tokens} tokens a step")
        print(f"kv cache: {kv.dtype}{held} {list(kv.shape)}")
    for name, s in m.symbols.items():
        print(f"dim {name}: [{s.min}, {'inf' if s.max is None else s.max}]")
    for fn in m.functions.values():
        print(f"function {fn.name} (StableHLO {fn.stablehlo_version}, platforms {','.join(fn.platforms)}):")
        for t in fn.inputs:
            extra = " (donated)" if t.name in fn.donated else ""
            print(f"  in  {t.name}: {t.describe()}{extra}")
        for t in fn.outputs:
            print(f"  out {t.name}: {t.describe()}")
        if fn.paddable:
            print(f"  paddable: {', '.join(fn.paddable)}")
    if args.platform:
        return _inspect_platform(args.artifact, m, args.platform)
    return 0


def _quantized(m) -> list[str]:
    """One line per quantized weight: its name, shape and format (a GGUF K-quant block type kept as the
    file had it, e.g. Q4_K, or our int8 / int4 layout with its group), from the manifest's WeightSpec.quant."""
    lines = []
    for w in m.weights.values():
        q = w.quant
        if not q or q.get("role") != "qweight":
            continue
        fmt = q.get("block") or " ".join([str(q["scheme"]), f"g{q['group']}" if q.get("group") else "per row",
                                          *([] if q.get("symmetric", True) else ["asym"])])
        lines.append(f"  {q.get('of', w.name)} {list(q.get('shape', w.shape))}: {fmt}")
    return ["quantized weights:", *sorted(lines)] if lines else []


def _inspect_platform(path: str, m, platform: str) -> int:
    """What `platform` would run: each function's kernel plan, and the function lowered for that
    platform (at its dims' smallest sizes) with the kernels linked in, naming the custom calls."""
    import jax
    from hloserve.runtime import artifact
    from hloserve.runtime.kernels import pallas
    from hloserve.runtime.model import read_exported

    platform = "cuda" if platform == "gpu" else platform
    env = {name: max(s.min, 1) for name, s in m.symbols.items()}
    for fn in m.functions.values():
        exported = read_exported(path, fn.name)
        if pallas.LOWERING[platform] not in exported.platforms:
            raise HloserveError(f"function {fn.name!r} was lowered for {','.join(exported.platforms)}, not "
                                f"{platform}; re-export with --platforms {','.join([*exported.platforms, platform])}")
        pending, plans = pallas.specialize(exported, platform)
        dims = ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if k in artifact.names_in(
            [d for t in fn.inputs for d in t.shape]))
        print(f"on {platform}: function {fn.name}" + (f" (lowered at {dims})" if dims else ""))
        for p in plans:
            print(f"  {p.describe()}")
        if not plans:
            print("  no composites: XLA compiles the whole function")
        avals = [jax.ShapeDtypeStruct(m.weights[w].shape, artifact.numpy_dtype(m.weights[w].dtype)) for w in fn.weights]
        avals += [jax.ShapeDtypeStruct(artifact.concrete_shape(t, env), artifact.numpy_dtype(t.dtype)) for t in fn.inputs]
        static = pallas.for_shapes(pending, platform, avals)
        calls, linked = pallas.kernels_in(static), pallas.kernels_in(static, sites=False)
        listed = ", ".join(f"{k} x{n}" + (f" ({linked[k]} distinct)" if linked.get(k, n) < n else "")
                           for k, n in sorted(calls.items())) or "none"
        print(f"  lowered for {platform} with its kernels: custom calls {listed}")
    return 0


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    from hloserve.runtime import load

    model = load(args.artifact, platform=args.platform, cache_dir=_cache_dir(args))
    name = args.function or next(iter(model.functions))
    if name not in model.functions:
        raise HloserveError(f"--function {name!r}: the artifact has {sorted(model.functions)}")
    try:
        with np.load(args.inputs) as f:
            inputs = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise HloserveError(f"--inputs {args.inputs}: cannot read as .npz ({e})") from e
    outs = model.functions[name](**inputs)
    arrays = {k: np.asarray(v) for k, v in outs.items()}
    # .npz holds numpy's own dtypes: 16-bit floats numpy lacks (bf16) are written widened to f32
    np.savez(args.outputs, **{k: a.astype(np.float32) if a.dtype.kind == "V" or a.dtype.name == "bfloat16" else a
                              for k, a in arrays.items()})
    for k, v in outs.items():
        print(f"{k}: {v.dtype}{list(v.shape)}", file=sys.stderr)
    return 0


def _cache_dir(args: argparse.Namespace) -> str | None:
    from hloserve.runtime.client import DEFAULT_CACHE
    return None if args.no_cache else (args.cache_dir or DEFAULT_CACHE)


def _bench(args: argparse.Namespace) -> int:
    from hloserve.runtime.bench import run_bench
    from hloserve.runtime.progress import Reporter
    run_bench(args.artifact, args.shape, function=args.function, iters=args.iters, warmup_iters=args.warmup_iters,
              platform=args.platform, cache_dir=_cache_dir(args), reporter=Reporter(enabled=not args.quiet))
    return 0


def _runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", help="cpu, cuda or tpu (default: jax's default backend)")
    p.add_argument("--cache-dir", help="persistent compilation cache (default ~/.cache/hloserve/xla)")
    p.add_argument("--no-cache", action="store_true", help="disable the persistent compilation cache")


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    if name == "inspect":
        i = sub.add_parser(name, help="show an artifact's functions, shapes and weights")
        i.add_argument("artifact")
        i.add_argument("--json", action="store_true", help="print the manifest as JSON")
        i.add_argument("--verify", action="store_true",
                       help="also hash every weight against the manifest (sizes and dtypes are always checked)")
        i.add_argument("--platform", choices=("tpu", "cuda", "gpu"),
                       help="also show what this platform runs, without its device: each composite's kernel "
                            "(with its static parameters) and the functions lowered for it with the kernels "
                            "linked in")
        i.set_defaults(fn=_inspect)
    elif name == "run":
        r = sub.add_parser(name, help="run an artifact function on inputs from an .npz file")
        r.add_argument("artifact")
        r.add_argument("--inputs", required=True)
        r.add_argument("--outputs", required=True)
        r.add_argument("--function")
        _runtime_options(r)
        r.set_defaults(fn=_run)
    elif name == "bench":
        b = sub.add_parser(name, help="compile time, latency p50/p99 and throughput of an artifact function")
        b.add_argument("artifact")
        b.add_argument("--shape", action="append", default=[],
                       help="an input's shape, INPUT:2x16, or a dim's size, DIM=16 (repeatable); inputs not "
                            "given take their shape from the dims")
        b.add_argument("--function", help="function to run (default: the first)")
        b.add_argument("--iters", type=int, default=100, help="timed calls (default 100)")
        b.add_argument("--warmup-iters", type=int, default=3, help="untimed calls after compiling (default 3)")
        _runtime_options(b)
        b.add_argument("-q", "--quiet", action="store_true", help="no progress output")
        b.set_defaults(fn=_bench)
