"""`hloserve serve`: the server's subcommand."""
from __future__ import annotations

import argparse
import os


def _serve(args: argparse.Namespace) -> int:
    from .config import ServeConfig
    from .serve import serve

    given = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": args.max_model_len, "num_blocks": args.num_blocks, "max_pending": args.max_pending,
             "max_batch_size": args.max_batch_size, "served_model_names": tuple(args.served_model_name or ()) or None, "platform": args.platform,
             "api_key": args.api_key or os.environ.get("HLOSERVE_API_KEY"),
             "kv_cache_bytes": None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
             "kv_host_cache_bytes": None if args.kv_host_cache_mib is None else args.kv_host_cache_mib << 20,
             "kv_disk_cache_bytes": None if args.kv_disk_cache_mib is None else args.kv_disk_cache_mib << 20,
             "kv_disk_dir": args.kv_disk_dir,
             "max_body_bytes": None if args.max_body_mib is None else int(args.max_body_mib * 2**20),
             "max_body_chunks": args.max_body_chunks, "body_timeout_s": args.body_timeout,
             "metrics_require_key": args.metrics_require_key or None,
             "shutdown_grace_s": args.shutdown_grace, "verify_weights": args.verify_weights,
             "max_output_tokens": args.max_output_tokens, "tensor_parallel_size": args.tensor_parallel_size,
             "batch_timeout_s": None if args.batch_timeout_ms is None else args.batch_timeout_ms / 1000,
             "grpc_port": args.grpc_port, "generation_config": args.generation_config,
             "override_generation_config": _json_object(args.override_generation_config),
             "speculative_config": _speculative(args.speculative_config), "kv_cache_dtype": args.kv_cache_dtype,
             "lora_modules": _lora_modules(args.lora_modules), "async_scheduling": args.async_scheduling,
             "sample_on_device": args.sample_on_device, "fit_chunks_to_buckets": args.fit_chunks_to_buckets}
    config = ServeConfig(**{k: v for k, v in given.items() if v is not None})   # the rest: ServeConfig's defaults
    hosts = int(os.environ.get("JAX_NUM_PROCESSES") or 1) if args.distributed else 1
    if config.tensor_parallel_size > 1 and (config.platform or "cpu") == "cpu":
        from hloserve.runtime.client import host_devices
        host_devices(max(1, config.tensor_parallel_size // hosts))   # a CPU host splits into that many devices
    if args.distributed:
        from hloserve.runtime import distributed
        process = distributed.initialize()
        if not process.is_leader:
            from .serve import follow
            follow(args.artifact, config, process, args.quantize)
            return 0
    serve(args.artifact, host=args.host, port=args.port, config=config, log_level=args.log_level,
          quantize=args.quantize)
    return 0


def _json_object(text: str | None) -> dict | None:
    """--override-generation-config's JSON object (None: not given)."""
    import json

    from hloserve.runtime.artifact.errors import HloserveError
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise HloserveError(f"--override-generation-config {text!r} is not JSON ({e}); pass an object such as "
                            f"'{{\"temperature\": 0.7}}'") from None
    if not isinstance(value, dict):
        raise HloserveError(f"--override-generation-config {text!r} is a JSON {type(value).__name__}; pass an "
                            f"object such as '{{\"temperature\": 0.7}}'")
    return value


def _lora_modules(items: list[str] | None) -> tuple[tuple[str, str], ...] | None:
    """--lora-modules NAME=PATH ... as (name, path) pairs (None: not given)."""
    from hloserve.runtime.artifact.errors import HloserveError
    if not items:
        return None
    pairs = [item.partition("=") for item in items]
    bad = [item for item, (name, eq, path) in zip(items, pairs) if not (name and eq and path)]
    if bad:
        raise HloserveError(f"--lora-modules {bad[0]!r}: give NAME=PATH, the name requests use as `model` and a "
                            f"PEFT LoRA directory (e.g. --lora-modules sql=/adapters/sql)")
    return tuple((name, path) for name, _, path in pairs)


def _speculative(text: str | None):
    """--speculative-config's typed config (None: not given)."""
    if text is None:
        return None
    from .core.spec_decode import SpeculativeConfig
    return SpeculativeConfig.from_json(text)


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    from .config import DEFAULT_GRPC_PORT, SERVE_QUANTIZE, ServeConfig
    from .core.spec_decode import DEFAULT_DISABLE_BY_BATCH_SIZE
    d = ServeConfig()   # the defaults shown in --help are ServeConfig's, not copies
    sv = sub.add_parser(name, help="serve an artifact over HTTP (OpenAI API for LLMs, TF Serving predict otherwise)")
    sv.add_argument("artifact", nargs="?", help="artifact directory, or a GGUF file or preset exported into the cache "
                    "once (default: export and serve SmolLM2-135M-Instruct)")
    sv.add_argument("--quantize", default=SERVE_QUANTIZE, metavar="Q",
                    help="weights of a GGUF file or preset when it is exported: auto (default: the file's own "
                         "blocks, 'gguf', for one named here; bf16 for the default model), gguf, bf16, or any "
                         "`hloserve export --quantize` spec (int8, int4, ...)")
    sv.add_argument("--kv-cache-dtype", metavar="D",
                    help="LLM: how a GGUF file or preset exported here stores K and V: bfloat16 (the default, "
                         "quantized weights included), float16, int8 or fp8_e4m3 (alias fp8) (per token and KV head: ~1.9x the "
                         "blocks of bf16 in --kv-cache-mib; docs/quantization.md); with an artifact directory it "
                         "must be how that artifact was exported")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, metavar="N",
                    help="TF Serving's gRPC API (PredictionService, ModelService) on port N, 0: off (default: "
                         "%d for predict artifacts, off for LLMs)" % DEFAULT_GRPC_PORT)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health, /ready and "
                    "/metrics, and the metadata 'authorization: Bearer KEY' on every gRPC call (or set HLOSERVE_API_KEY)")
    sv.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    sv.add_argument("--served-model-name", "--model-name", nargs="+", metavar="NAME",
                    help="name(s) clients use for the model, the first one reported (default: the artifact "
                         "directory's name; the preset's name for the default model)")
    sv.add_argument("--max-num-seqs", type=int, help="LLM: sequences per step (default %d)" % d.max_num_seqs)
    sv.add_argument("--max-num-batched-tokens", type=int, help="LLM: tokens per step, prompts chunked to fit (default %d)" % d.max_num_batched_tokens)
    sv.add_argument("--max-model-len", type=int, help="LLM: context per request (default: the artifact's, at most 2048)")
    sv.add_argument("--kv-cache-mib", type=int, help="LLM: device memory for the paged KV cache (default %d MiB)" % (d.kv_cache_bytes >> 20))
    sv.add_argument("--num-blocks", type=int, help="LLM: KV blocks (overrides --kv-cache-mib)")
    sv.add_argument("--kv-host-cache-mib", type=int, metavar="N",
                    help="LLM: host RAM keeping full KV blocks of cached prefixes past the device's; preempted "
                         "requests come back from it (default %d MiB; 0: off)" % (d.kv_host_cache_bytes >> 20))
    sv.add_argument("--kv-disk-cache-mib", type=int, metavar="N",
                    help="LLM: disk keeping full KV blocks of cached prefixes, so a restart or a replica sharing "
                         "--kv-disk-dir serves a known prefix from it (default %d MiB; 0: off)"
                         % (d.kv_disk_cache_bytes >> 20))
    sv.add_argument("--kv-disk-dir", metavar="DIR",
                    help="LLM: the KV disk tier's directory (default: kv/ under the cache root, $HLOSERVE_CACHE)")
    sv.add_argument("--max-pending", type=int, help="requests in flight before answering 429 (default %d)" % d.max_pending)
    sv.add_argument("--max-batch-size", type=int, help="predict: rows batched per call (default %d)" % d.max_batch_size)
    sv.add_argument("--batch-timeout-ms", type=float, help="predict: wait for a batch to fill (default %g ms)" % (d.batch_timeout_s * 1000))
    sv.add_argument("--max-body-mib", type=float, help="request bodies larger than this answer 413 (default %g MiB)"
                    % (d.max_body_bytes / 2**20))
    sv.add_argument("--max-body-chunks", type=int, metavar="N", help="a chunked request body in more chunks than "
                    "this answers 400 (default %d)" % d.max_body_chunks)
    sv.add_argument("--body-timeout", type=float, metavar="S", help="a request body not complete S seconds after "
                    "its headers answers 408 (default %g)" % d.body_timeout_s)
    sv.add_argument("--shutdown-grace", type=float, metavar="S", help="on SIGTERM/SIGINT, seconds running requests "
                    "may still finish before they are ended (default %g)" % d.shutdown_grace_s)
    sv.add_argument("--max-output-tokens", type=int, metavar="N",
                    help="LLM: most tokens one request may generate (default: the rest of the context)")
    sv.add_argument("--verify-weights", choices=("stamp", "full"),
                    help="'full' re-hashes every weight on start; 'stamp' (default) only when the file changed")
    sv.add_argument("--platform", help="PJRT platform (cpu, cuda, tpu); default: jax's")
    sv.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N",
                    help="LLM: split the model over N devices by KV heads (default %d; on CPU the host's "
                         "cores become N devices)" % d.tensor_parallel_size)
    sv.add_argument("--distributed", action="store_true",
                    help="LLM: one process of a multi-host run (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID, or a detected TPU slice / SLURM / Kubernetes job): process 0 serves "
                         "HTTP and schedules, the others run its steps; --tensor-parallel-size counts every "
                         "host's devices")
    sv.add_argument("--generation-config", metavar="auto|none|PATH",
                    help="LLM: sampling defaults for the fields a request leaves out (temperature, top_p, top_k, "
                         "min_p, repetition_penalty, max_new_tokens as max_tokens): auto (default) the artifact's "
                         "generation_config.json, none hloserve's neutral ones (temperature 1), or a directory "
                         "holding generation_config.json, or the file")
    sv.add_argument("--override-generation-config", metavar="JSON",
                    help="LLM: a JSON object of those fields merged over the generation config, e.g. "
                         "'{\"temperature\": 0.7}'; a request's own fields still win")
    sv.add_argument("--speculative-config", metavar="JSON",
                    help="LLM: speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                         "K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": M}' proposes up to K tokens a step "
                         "by prompt lookup (the context's last N..M tokens found earlier in it) and verifies them "
                         "in one step; '{\"model\": DRAFT, \"num_speculative_tokens\": K}' proposes K tokens a "
                         "step greedily with a draft model (an artifact, GGUF file or preset with the same "
                         "tokenizer); \"disable_by_batch_size\": B (default %d) turns it off in steps with more "
                         "than B requests running (default: off)" % DEFAULT_DISABLE_BY_BATCH_SIZE)
    sv.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                    help="LLM: LoRA adapters (PEFT directories) loaded at start into an artifact exported with "
                         "--lora-slots; a request names one as its `model` (more at run time: "
                         "/v1/load_lora_adapter, docs/api.md)")
    sv.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                    help="LLM: plan each step while the one before runs on the device, hiding the host's work "
                         "(vLLM's flag; default: on for GPU and TPU, off on CPU; docs/architecture.md)")
    sv.add_argument("--sample-on-device", action=argparse.BooleanOptionalAction,
                    help="LLM: draw each step's tokens on the device, so only token ids (and asked-for logprobs) "
                         "come back, not the logits; rows with penalties, logit_bias, min_tokens or a grammar are "
                         "sampled on the host (default: on for GPU and TPU, off on CPU; docs/api.md)")
    sv.add_argument("--fit-chunks-to-buckets", action=argparse.BooleanOptionalAction,
                    help="LLM: cut a step's last prompt chunk back to the token bucket below where padding the step "
                         "up would cost more than one more step (a 160-token prompt as 128 + 32 rows, not 256), "
                         "and pad a lone request's prompt steps to the next 32 tokens "
                         "(default: on for CPU, where a padding row costs what a real one does, off for GPU and "
                         "TPU; docs/architecture.md)")
    sv.add_argument("--log-level", default="warning", help="uvicorn log level")
    sv.set_defaults(fn=_serve)
