"""The `hloserve` command line.

    hloserve export SOURCE -o OUT [--dynamic SPEC] [--dtype D] [--weight-dtype D] [--kv-cache-dtype D] [--function F] [--pad DIM] [--quantize Q]
    hloserve tf ART -o SAVEDMODEL [--function F] [--xla-call-module-version N] [--platforms P]
    hloserve inspect ART
    hloserve run ART --inputs in.npz --outputs out.npz [--function F]
    hloserve bench ART --shape INPUT:2x16 [--shape DIM=N] [--function F] [--iters N]

Errors print one line and exit 1 (2 for usage errors); --debug shows tracebacks.
Subcommands import their stack lazily: `serve`, `run` and `bench` never import torch.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Sequence


def _need_export_stack() -> None:
    """`hloserve export` needs torch; serving does not (it is the `export` extra)."""
    import importlib.util
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        from .errors import HloserveError
        raise HloserveError(f"exporting needs {', '.join(missing)}, which this install lacks; "
                            f"install them with: pip install 'hloserve[export]'")


def _export(args: argparse.Namespace) -> int:
    _need_export_stack()
    from .export import export_artifact
    from .progress import Reporter
    from .sources import apply_dynamic, load_source

    reporter = Reporter(enabled=not args.quiet)
    reporter.stage(f"loading {args.source}")
    source = load_source(args.source, dtype=args.dtype, quantize=args.quantize,
                         quantize_skip=args.quantize_skip.split(",") if args.quantize_skip else (),
                         weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype)
    entries = source.entries
    if args.function:
        known = {e.name for e in entries}
        unknown = [f for f in args.function if f not in known]
        if unknown:
            from .errors import SourceError
            raise SourceError(f"--function {', '.join(unknown)}: {args.source} provides {sorted(known)}")
        entries = [e for e in entries if e.name in args.function]
    apply_dynamic(entries, args.dynamic, args.pad.split(",") if args.pad else ())
    model = dict(source.model, dtype=args.dtype)
    manifest = export_artifact(args.output, entries, source=args.source, model=model,
                               platforms=args.platforms.split(","), reporter=reporter, files=source.files,
                               weight_quant=source.weight_quant)
    for fn in manifest.functions.values():
        ins = ", ".join(f"{t.name}: {t.describe()}" for t in fn.inputs)
        reporter.stage(f"  {fn.name}({ins})")
    if args.savedmodel:
        _write_savedmodel(args.output, args.savedmodel, reporter=reporter)
    return 0


def _write_savedmodel(artifact_dir: str, out: str, *, reporter, **options) -> None:
    from .tf_savedmodel import to_savedmodel
    reporter.stage(f"writing TensorFlow SavedModel to {out} (XlaCallModule)")
    info = to_savedmodel(artifact_dir, out, **options)
    reporter.stage(f"  XlaCallModule version {info.call_module_version}, platforms "
                   f"{','.join(info.platforms)}{'' if info.platform_check else ' (check disabled)'}, {info.variables} variables "
                   f"({info.variable_bytes / 2**20:.1f} MiB), TensorFlow {info.tensorflow}")
    for key, sig in info.signatures.items():
        ins = ", ".join(f"{n}: {d}{list(s)}" for n, d, s in sig.inputs)
        reporter.stage(f"  signature {key} -> {sig.function}({ins})")


def _tf(args: argparse.Namespace) -> int:
    from .progress import Reporter
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's C++ start-up chatter
    platforms = None
    if args.platforms is not None:
        platforms = [] if args.platforms == "none" else args.platforms.split(",")
    _write_savedmodel(args.artifact, args.output, reporter=Reporter(enabled=not args.quiet),
                      functions=args.function, serving_default=args.serving_default,
                      call_module_version=args.xla_call_module_version, platforms=platforms,
                      stablehlo_version=args.stablehlo_version)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from . import artifact
    m = artifact.read_manifest(args.artifact)
    artifact.verify_files(args.artifact, m)
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
    kv = (m.model.get("llm") or {}).get("kv_cache")
    if kv:
        held = f" holding {kv['holds']} bits" if kv.get("holds") else ""
        print(f"kv cache: {kv['dtype']}{held} {kv['shape']}")
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
    return 0


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from hloserve.runtime import load
    from .errors import HloserveError

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
    np.savez(args.outputs, **{k: np.asarray(v) for k, v in outs.items()})
    for k, v in outs.items():
        print(f"{k}: {v.dtype}{list(v.shape)}", file=sys.stderr)
    return 0


def _cache_dir(args: argparse.Namespace) -> str | None:
    from hloserve.runtime.client import DEFAULT_CACHE
    return None if args.no_cache else (args.cache_dir or DEFAULT_CACHE)


def _bench(args: argparse.Namespace) -> int:
    from hloserve.runtime.bench import run_bench
    from .progress import Reporter
    run_bench(args.artifact, args.shape, function=args.function, iters=args.iters, warmup_iters=args.warmup_iters,
              platform=args.platform, cache_dir=_cache_dir(args), reporter=Reporter(enabled=not args.quiet))
    return 0


def _runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", help="cpu, cuda or tpu (default: jax's default backend)")
    p.add_argument("--cache-dir", help="persistent compilation cache (default ~/.cache/hloserve/xla)")
    p.add_argument("--no-cache", action="store_true", help="disable the persistent compilation cache")


def _serve(args: argparse.Namespace) -> int:
    from hloserve.server.serve import serve
    from hloserve.server.services import ServeConfig

    limits = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    config = ServeConfig(**limits, max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_mib << 20,
                         num_blocks=args.num_blocks,
                         max_pending=args.max_pending, max_batch_size=args.max_batch_size,
                         batch_timeout_s=args.batch_timeout_ms / 1000, model_name=args.model_name,
                         api_key=args.api_key or os.environ.get("HLOSERVE_API_KEY"), platform=args.platform)
    serve(args.artifact, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hloserve", description="Export PyTorch models to StableHLO and serve them.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="export a checkpoint to an artifact directory")
    e.add_argument("source", help="HF model dir, .pt2, .gguf, module:factory, or a preset name")
    e.add_argument("-o", "--output", required=True, help="artifact directory to write")
    e.add_argument("--dynamic", help="dynamic dims, e.g. 'input_ids:0=batch[1,64],1=seq[1,512];attention_mask:0=batch,1=seq'")
    e.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    e.add_argument("--weight-dtype", metavar="D",
                   help="LLMs: store the weight matrices in D (bfloat16 or float16) under --dtype activations and "
                        "KV cache; matmuls round activations to D and sum in float32 (docs/performance.md)")
    e.add_argument("--kv-cache-dtype", metavar="D",
                   help="LLMs: store K and V in D (bfloat16 or float16) under float32 activations: half the "
                        "cache memory and gather traffic; attention still computes in float32")
    e.add_argument("--function", action="append", help="entry point(s) to export (default: all the source provides)")
    e.add_argument("--pad", help="symbolic dims the runtime may pad to buckets, comma-separated ('none' for none)")
    e.add_argument("--platforms", default="cpu", help="comma-separated lowering platforms (cpu,cuda,tpu)")
    e.add_argument("--quantize", metavar="SPEC",
                   help="weight-only quantization: int8 (per channel), int8:GROUP, int4[:GROUP[:asym|sym]] "
                        "(default group 32), or gguf (keep a GGUF file's Q8_0/Q4_0/Q4_1 blocks); "
                        "see docs/quantization.md")
    e.add_argument("--quantize-skip", metavar="PATTERNS",
                   help="comma-separated fnmatch patterns of modules left in float, e.g. '*embed*,lm_head'")
    e.add_argument("--savedmodel", metavar="DIR", help="also write a TensorFlow SavedModel (see `hloserve tf`)")
    e.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    e.set_defaults(fn=_export)

    t = sub.add_parser("tf", help="convert an artifact to a TensorFlow SavedModel (XlaCallModule) for TF Serving")
    t.add_argument("artifact")
    t.add_argument("-o", "--output", required=True, help="SavedModel directory to write (e.g. models/NAME/1)")
    t.add_argument("--function", action="append", help="function(s) to export (default: all, one signature each)")
    t.add_argument("--serving-default", help="function behind serving_default (default: the first)")
    t.add_argument("--xla-call-module-version", type=int,
                   help="XlaCallModule version (default: the module's, lowered to what this TensorFlow accepts)")
    t.add_argument("--platforms", help="XlaCallModule platforms (default: the artifact's lowering platforms; "
                                       "'none' disables the platform check)")
    t.add_argument("--stablehlo-version", help="re-serialize the StableHLO for an older consumer, e.g. 1.0.0")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    t.set_defaults(fn=_tf)

    i = sub.add_parser("inspect", help="show an artifact's functions, shapes and weights")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(fn=_inspect)

    r = sub.add_parser("run", help="run an artifact function on inputs from an .npz file")
    r.add_argument("artifact")
    r.add_argument("--inputs", required=True)
    r.add_argument("--outputs", required=True)
    r.add_argument("--function")
    _runtime_options(r)
    r.set_defaults(fn=_run)

    b = sub.add_parser("bench", help="compile time, latency p50/p99 and throughput of an artifact function")
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
    sv = sub.add_parser("serve", help="serve an artifact over HTTP (OpenAI API for LLMs, TF Serving predict otherwise)")
    sv.add_argument("artifact", nargs="?", help="artifact directory (default: export and serve SmolLM2-135M-Instruct)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or set HLOSERVE_API_KEY)")
    sv.add_argument("--model-name", help="model name clients use (default: the artifact directory's name)")
    sv.add_argument("--max-num-seqs", type=int, help="LLM: sequences per step (default 16)")
    sv.add_argument("--max-num-batched-tokens", type=int, help="LLM: tokens per step, prompts chunked to fit (default 256)")
    sv.add_argument("--max-model-len", type=int, help="LLM: context per request (default: the artifact's, at most 2048)")
    sv.add_argument("--kv-cache-mib", type=int, default=1024, help="LLM: device memory for the paged KV cache")
    sv.add_argument("--num-blocks", type=int, help="LLM: KV blocks (overrides --kv-cache-mib)")
    sv.add_argument("--max-pending", type=int, default=256, help="requests in flight before answering 429")
    sv.add_argument("--max-batch-size", type=int, default=32, help="predict: rows batched per call")
    sv.add_argument("--batch-timeout-ms", type=float, default=5.0, help="predict: wait for a batch to fill")
    sv.add_argument("--platform", help="PJRT platform (cpu, cuda, tpu); default: jax's")
    sv.add_argument("--log-level", default="warning", help="uvicorn log level")
    sv.set_defaults(fn=_serve)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("hloserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one-line error contract
        if args.debug:
            raise
        from .errors import HloserveError
        if isinstance(e, HloserveError):
            msg = str(e)
        else:
            msg = f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)"
        print(f"hloserve: error: {' '.join(msg.split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
