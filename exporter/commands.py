"""`hloserve export` and `hloserve tf`: the exporter's subcommands (torch is imported only when they run)."""
from __future__ import annotations

import argparse
import os
import sys

from hloserve.runtime.progress import Reporter

from .errors import HloserveError, SourceError


def _need_export_stack() -> None:
    """`hloserve export` needs torch; serving does not (it is the `export` extra)."""
    import importlib.util
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise HloserveError(f"exporting needs {', '.join(missing)}, which this install lacks; "
                            f"install them with: pip install 'hloserve[export]'")


PLATFORMS = ("cpu", "cuda", "rocm", "tpu")   # jax.export lowering platforms


def _check_export_options(args: argparse.Namespace) -> None:
    """Options that are wrong whatever the model: refused before anything heavy runs."""
    bad = [p for p in (args.platforms or "cpu").split(",") if p not in PLATFORMS]
    if bad:
        raise HloserveError(f"--platforms {','.join(bad)}: lowering platforms are {', '.join(PLATFORMS)} "
                            f"(e.g. --platforms cpu,cuda)")
    if args.dynamic:
        from .dynamic_spec import parse_dynamic_spec
        parse_dynamic_spec(args.dynamic, None)      # the syntax now; input names once the model is loaded
    if args.pad:
        bad = [p for p in args.pad.split(",") if not p.isidentifier()]
        if bad and args.pad != "none":
            raise HloserveError(f"--pad {args.pad!r}: give dim names separated by commas (e.g. --pad batch,seq), "
                                f"or 'none'")
    if args.lora_slots is None and (args.max_lora_rank is not None or args.lora_targets):
        raise HloserveError("--max-lora-rank and --lora-targets need --lora-slots N (adapters served at once)")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise HloserveError(f"-o {args.output} is a file; give a directory to write the artifact into")
    if os.path.isdir(args.output) and os.listdir(args.output) and \
            not os.path.exists(os.path.join(args.output, "manifest.json")):
        raise HloserveError(f"-o {args.output} is a non-empty directory that is not an artifact; choose a new "
                            f"directory (an existing artifact is overwritten)")


def _export(args: argparse.Namespace) -> int:
    _check_export_options(args)
    _need_export_stack()
    created = not os.path.exists(args.output)
    try:
        return _export_checked(args)
    except BaseException:
        if created and os.path.isdir(args.output):   # nothing half-written is left behind
            import shutil
            shutil.rmtree(args.output, ignore_errors=True)
        raise


def _export_checked(args: argparse.Namespace) -> int:
    from .export import export_artifact
    from .sources import apply_dynamic, auto_dtypes, load_source

    reporter = Reporter(enabled=not args.quiet)
    reporter.stage(f"loading {args.source}")
    dtype, weight_dtype, kv_cache_dtype = auto_dtypes(args.source, args.dtype, args.weight_dtype,
                                                      args.kv_cache_dtype, args.quantize)
    if (weight_dtype, kv_cache_dtype) != (args.weight_dtype, args.kv_cache_dtype):
        what = "KV cache is" if args.quantize else "unquantized weight matrices and KV cache are"
        reporter.stage(f"  the checkpoint is stored in {kv_cache_dtype}: its {what} exported in {kv_cache_dtype} "
                       f"under float32 activations (--dtype float32 for float32 throughout)")
    source = load_source(args.source, dtype=dtype, quantize=args.quantize,
                         quantize_skip=args.quantize_skip.split(",") if args.quantize_skip else (),
                         weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype, llm_step=args.llm_step,
                         lora=_lora_request(args), keep_16bit_embedding=args.keep_16bit_embedding)
    entries = source.entries
    if args.function:
        known = {e.name for e in entries}
        unknown = [f for f in args.function if f not in known]
        if unknown:
            raise SourceError(f"--function {', '.join(unknown)}: {args.source} provides {sorted(known)}")
        entries = [e for e in entries if e.name in args.function]
    apply_dynamic(entries, args.dynamic, args.pad.split(",") if args.pad else ())
    model = dict(source.model, dtype=dtype)
    manifest = export_artifact(args.output, entries, source=args.source, model=model,
                               platforms=args.platforms.split(",") if args.platforms else None, reporter=reporter, files=source.files,
                               weight_quant=source.weight_quant, batch_invariant=args.batch_invariant)
    for fn in manifest.functions.values():
        ins = ", ".join(f"{t.name}: {t.describe()}" for t in fn.inputs)
        reporter.stage(f"  {fn.name}({ins})")
    if manifest.is_llm:
        reporter.stage("wrote an LLM step artifact: `hloserve serve` answers it with the OpenAI API")
    else:
        reporter.stage("wrote a predict artifact: `hloserve serve` answers it with TF Serving's REST API")
        if manifest.model.get("llm_note"):
            print(f"hloserve: note: {manifest.model['llm_note']}", file=sys.stderr)
    if args.savedmodel:
        _write_savedmodel(args.output, args.savedmodel, reporter=reporter)
    return 0


def _lora_request(args: argparse.Namespace):
    """--lora-slots / --max-lora-rank / --lora-targets as a LoraRequest (None without slots)."""
    if args.lora_slots is None:
        return None
    from .llm.lora import ALL_LINEAR, LoraRequest
    targets = None if args.lora_targets in (None, ALL_LINEAR) else tuple(args.lora_targets.split(","))
    return LoraRequest(args.lora_slots, args.max_lora_rank or 16, targets)


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
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's C++ start-up chatter
    platforms = None
    if args.platforms is not None:
        platforms = [] if args.platforms == "none" else args.platforms.split(",")
    _write_savedmodel(args.artifact, args.output, reporter=Reporter(enabled=not args.quiet),
                      functions=args.function, serving_default=args.serving_default,
                      call_module_version=args.xla_call_module_version, platforms=platforms,
                      stablehlo_version=args.stablehlo_version)
    return 0


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    if name == "export":
        e = sub.add_parser(name, help="export a checkpoint to an artifact directory")
        from .presets import PRESETS
        e.add_argument("source", help="HF model dir, .pt2, .gguf, module:factory, or a preset name: "
                                      + ", ".join(f"{n} ({p.description})" for n, p in PRESETS.items()))
        e.add_argument("-o", "--output", required=True, help="artifact directory to write")
        e.add_argument("--dynamic", help="dynamic dims, e.g. 'input_ids:0=batch[1,64],1=seq[1,512];attention_mask:0=batch,1=seq'")
        e.add_argument("--dtype", default="auto",
                       help="auto (default: a causal LM stored in bfloat16/float16 gets 16-bit weight matrices and KV "
                            "cache under float32 activations, as the default model is served; float32 otherwise), "
                            "float32, bfloat16 or float16")
        e.add_argument("--weight-dtype", metavar="D",
                       help="LLMs: store the weight matrices in D (bfloat16 or float16) under --dtype activations and "
                            "KV cache; matmuls round activations to D and sum in float32 (docs/performance.md)")
        e.add_argument("--kv-cache-dtype", metavar="D",
                       help="LLMs: store K and V in D under float32 activations: bfloat16 or float16 (half the "
                            "cache memory and gather traffic), or int8 (quantized per token and KV head with a bf16 "
                            "scale and an int8 zero point: about a quarter; docs/quantization.md), or fp8_e4m3 (alias "
                            "fp8: float8 e4m3 values with a bf16 scale per token and KV head); attention still "
                            "computes in float32")
        e.add_argument("--batch-invariant", action="store_true",
                       help="compute every row's bits independently of how many rows its call has (a sum of two "
                            "products, as in rotary embeddings, through the hloserve.product_sum composite; XLA's CPU "
                            "compiler fuses one product into a multiply-add by the shapes): speculative decoding's "
                            "greedy text then equals plain decoding's; costs a few percent of a step on CPU")
        e.add_argument("--llm-step", choices=("auto", "generic", "none"), default="auto",
                       help="how a HF causal LM or a GGUF is exported: 'auto'/'generic' (the paged-cache step: the "
                            "model's own code through transformers' attention interface, layers scanned), 'none' "
                            "(a causal LM's plain forward, served with TF Serving's predict API)")
        e.add_argument("--lora-slots", type=int, metavar="N",
                       help="LLMs: the step takes LoRA adapters in N slots (served at once, mixed in a batch), "
                            "loaded by `hloserve serve --lora-modules` or /v1/load_lora_adapter (docs/api.md)")
        e.add_argument("--max-lora-rank", type=int, metavar="R",
                       help="with --lora-slots: the largest adapter rank a slot holds (default 16)")
        e.add_argument("--lora-targets", metavar="NAMES",
                       help="with --lora-slots: the decoder layers' projections adapters may target, comma-separated "
                            "(e.g. q_proj,v_proj), or all-linear (default)")
        e.add_argument("--function", action="append", help="entry point(s) to export (default: all the source provides)")
        e.add_argument("--pad", help="symbolic dims the runtime may pad to buckets, comma-separated ('none' for none)")
        e.add_argument("--platforms", help="comma-separated lowering platforms (default: cpu,cuda,tpu for an LLM "
                                           "step, cpu otherwise); e.g. --platforms cpu narrows an LLM step to CPU")
        e.add_argument("--quantize", metavar="SPEC",
                       help="weight-only quantization: int8 (per channel), int8:GROUP, int4[:GROUP[:asym|sym]] "
                            "(default group 32), or gguf (keep a GGUF file's Q8_0/Q4_0/Q4_1 blocks); "
                            "see docs/quantization.md")
        e.add_argument("--quantize-skip", metavar="PATTERNS",
                       help="comma-separated fnmatch patterns of modules left in float, e.g. '*embed*,lm_head'")
        e.add_argument("--keep-16bit-embedding", action="store_true",
                       help="compressed-tensors checkpoints: keep the embedding table (and the LM head tied to it) "
                            "in 16 bits instead of int8 with a scale per row (docs/quantization.md)")
        e.add_argument("--savedmodel", metavar="DIR", help="also write a TensorFlow SavedModel (see `hloserve tf`)")
        e.add_argument("-q", "--quiet", action="store_true", help="no progress output")
        e.set_defaults(fn=_export)
    elif name == "tf":
        t = sub.add_parser(name, help="convert an artifact to a TensorFlow SavedModel (XlaCallModule) for TF Serving")
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
