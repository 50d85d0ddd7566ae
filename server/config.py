"""Every serving knob and its only default, resolved against the artifact once.

`ServeConfig` is parsed at the edge (the CLI, or a caller building a server in process). The engine's
lower configs (`SchedulerConfig`, `RunnerConfig`) have no defaults of their own: `ServeConfig.resolve`
builds both from one artifact's `LLMSpec`, clamping to what the artifact was exported for and saying
so, so `hloserve serve`, tests and benchmarks run with the same numbers.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from hloserve.runtime.artifact.errors import HloserveError
from hloserve.runtime.artifact.generation import (GENERATION_CONFIG, SAMPLING_FIELDS, read_generation_config,
                                                  sampling_fields)
from hloserve.runtime.artifact.llm import LLMSpec, kv_cache_dtype_name

from .core.step_shapes import RunnerConfig
from .core.sampling import SamplingParams
from .core.scheduler import SchedulerConfig
from .core.spec_decode import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_GRPC_PORT = 8500   # TF Serving's
# `hloserve serve --quantize`: "auto" is `gguf` (the file's own blocks: the smallest step time at one
# or a few concurrent requests) for a GGUF file or preset named on the command line, bf16 for the
# default model (no argument; twice the throughput at 16 concurrent requests until the integer
# kernel catches up); "bf16" is DEFAULT_EXPORT_FLAGS; anything else is an export --quantize spec.
SERVE_QUANTIZE = "auto"
# Prompt text longer than this many characters per token of context is refused before tokenizing:
# no tokenizer packs that much into the tokens a context holds, and tokenizing it would stall.
MAX_PROMPT_CHARS_PER_TOKEN = 64
# --generation-config besides a PATH: "auto" the artifact's own generation_config.json, "none" (or
# vLLM's name for it, "vllm") hloserve's neutral defaults (temperature 1, top_p 1, no top-k or min-p)
GENERATION_AUTO, GENERATION_NEUTRAL = "auto", ("none", "vllm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Server options.

    Attributes:
      max_num_seqs / max_num_batched_tokens: the LLM scheduler's per-step limits (clamped to the
        artifact's max_seqs / max_tokens).
      max_model_len: context per request (<= the artifact's max_context); None: the artifact's,
        at most DEFAULT_MAX_MODEL_LEN (a longer context means wider block tables to compile).
      kv_cache_bytes: device memory for the paged KV cache; num_blocks overrides it.
      min_token_bucket / prefill_growth: the smallest prefill T bucket and the ratio between T buckets.
      block_buckets / block_growth: how many block-table widths to compile and their ratio
        (widths 8..128 blocks x2 apart for a 2048-token context) where attention pays for the
        table's width; where the CPU attention kernel runs it reads only the blocks in use and
        the runner compiles the widest alone (20 shapes for the defaults instead of 100).
      kv_host_cache_bytes / kv_disk_cache_bytes: LLM: prefix-cache tiers below the device
        (core/kv_tiers.py): host RAM and disk kept for full KV blocks, least recently used out
        past the bound; 0 turns a tier off. A preempted request's blocks come back from host RAM;
        a restart, or a replica sharing the directory, serves a known prefix from disk.
      kv_disk_dir: the disk tier's directory (None: kv/ under the cache root, $HLOSERVE_CACHE);
        blocks are kept under a subdirectory per artifact digest.
      enable_prefix_caching / admission_watermark: scheduler policy (fraction of blocks kept free
        when admitting, so running decodes can grow without preempting at once).
      max_pending: requests admitted at once (queued + running); more answer 429 with Retry-After.
      max_batch_size / batch_timeout_s: predict batching (TF Serving's batching_parameters).
      served_model_names: the names clients use, the first one reported (default: the artifact
        directory's name; `hloserve serve` with no artifact: the preset's name).
      api_key: when set, every route but /health, /ready and /metrics requires `Authorization: Bearer KEY`
        (and every gRPC call the metadata `authorization: Bearer KEY`).
      metrics_require_key: /metrics needs the API key too.
      max_body_bytes: a request body above it answers 413 (from Content-Length before it is read, or as
        soon as a chunked body passes it).
      max_body_chunks: a chunked request body in more chunks than this answers 400 (each chunk costs
        parsing on the event loop; 16 MiB in 1 KiB chunks is 16,384).
      body_timeout_s: a request body not complete this long after its headers answers 408 (a client
        dripping a body cannot hold a connection and its handler for ever).
      max_output_tokens: the operator's cap on tokens generated per request (None: the context); a
        request without max_tokens gets at most this many, one asking for more answers 400.
      shutdown_grace_s: on SIGTERM/SIGINT, how long running requests may still finish.
      grpc_port: TF Serving's gRPC API (predict artifacts) on this port; 0: off; None: DEFAULT_GRPC_PORT
        for a predict artifact, off for an LLM (see `grpc_port_for`).
      platform: "cpu", "gpu", "tpu" or None for jax's default.
      tensor_parallel_size: LLM: devices the step is split over (Megatron-style, by KV heads); the
        KV cache budget (kv_cache_bytes) is per device.
      strict: refuse to compile a shape outside the warmed buckets while serving.
      verify_weights: "stamp" re-hashes the weights only when the file changed since its last full
        check (runtime.load's default); "full" re-hashes them on every start.
      generation_config: where an LLM's sampling defaults come from (vLLM's --generation-config):
        "auto" the artifact's generation_config.json, "none" neutral, else a directory holding
        generation_config.json or the file itself.
      override_generation_config: generation_config.json fields merged over those (vLLM's
        --override-generation-config); a request's own fields win over both.
      speculative_config: LLM: speculative decoding (vLLM's --speculative-config, the n-gram or draft-model method;
        server/core/spec_decode.py), None: off. Each drafted token is a row of the step, so
        num_speculative_tokens is clamped to max_num_seqs - 1.
      lora_modules: LLM: (name, PEFT directory) of the LoRA adapters loaded at start into an artifact's
        adapter slots (vLLM's --lora-modules); a request picks one by its `model`.
      kv_cache_dtype: LLM: how K and V are stored (--kv-cache-dtype: bfloat16, float16, int8, fp8_e4m3 or fp8), where
        `serve` exports (the default model, a preset, a GGUF file); an artifact directory's must match
        (check_kv_cache). None: the export's default.
      async_scheduling: LLM: plan each step while the one before runs on the device (vLLM's
        --async-scheduling; core/engine.py states its rules). None: per platform (`async_scheduling_on`).
      sample_on_device: LLM: draw tokens where the logits are (core/plan_sampling.py). None: per platform
        (`sample_on_device_on`).
      fit_chunks_to_buckets: LLM: cut a step's last prompt chunk back to fill a token bucket where padding
        would cost more (SchedulerConfig.token_buckets), and compile finer buckets for a step of one
        sequence (RunnerConfig.with_lone_buckets). None: per platform (`fit_chunks_on`).
    """
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30
    num_blocks: int | None = None
    min_token_bucket: int = 32
    prefill_growth: int = 4
    block_buckets: int = 5
    block_growth: int = 2
    enable_prefix_caching: bool = True
    kv_host_cache_bytes: int = 2 << 30      # twice the device's default, as SGLang's hierarchical cache
    kv_disk_cache_bytes: int = 8 << 30
    kv_disk_dir: str | None = None
    admission_watermark: float = 0.01
    max_pending: int = 256
    max_batch_size: int = 32
    batch_timeout_s: float = 0.005
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    metrics_require_key: bool = False
    max_body_bytes: int = 16 << 20
    max_body_chunks: int = 16384
    body_timeout_s: float = 60.0
    max_output_tokens: int | None = None
    shutdown_grace_s: float = 10.0
    grpc_port: int | None = None
    platform: str | None = None
    tensor_parallel_size: int = 1
    strict: bool = True
    verify_weights: str = "stamp"
    generation_config: str = GENERATION_AUTO
    override_generation_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    speculative_config: SpeculativeConfig | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    kv_cache_dtype: str | None = None
    async_scheduling: bool | None = None
    sample_on_device: bool | None = None
    fit_chunks_to_buckets: bool | None = None

    def __post_init__(self):
        if self.verify_weights not in ("stamp", "full"):
            raise HloserveError(f"verify_weights={self.verify_weights!r}: use 'stamp' or 'full'")
        if self.tensor_parallel_size < 1:
            raise HloserveError(f"tensor_parallel_size={self.tensor_parallel_size}: use 1 (one device) or more")
        for flag, value in (("--kv-host-cache-mib", self.kv_host_cache_bytes), ("--kv-disk-cache-mib",
                                                                                 self.kv_disk_cache_bytes)):
            if value < 0:
                raise HloserveError(f"{flag} {value >> 20}: give a size in MiB, or 0 to turn the tier off")
        for flag, value in (("--max-body-mib", self.max_body_bytes / 2**20), ("--max-body-chunks", self.max_body_chunks),
                            ("--body-timeout", self.body_timeout_s)):
            if not value > 0:
                raise HloserveError(f"{flag} {value:g}: give a positive limit")
        unknown = sorted(set(self.override_generation_config) - set(SAMPLING_FIELDS))
        if unknown:
            raise HloserveError(f"--override-generation-config: unknown field(s) {', '.join(map(repr, unknown))}; "
                                f"the fields are {', '.join(SAMPLING_FIELDS)}")
        checked_defaults(sampling_fields(self.override_generation_config), "--override-generation-config")
        names = [n for n, _ in self.lora_modules]
        clash = sorted({n for n in names if names.count(n) > 1 or n in self.served_model_names})
        if clash:
            raise HloserveError(f"--lora-modules {', '.join(clash)}: each adapter needs a name of its own, not a "
                                f"served model name or another adapter's")
        if self.generation_config != GENERATION_AUTO:   # a PATH that cannot be read fails before anything loads
            self.generation_defaults("")

    def async_scheduling_on(self, platform: str) -> bool:
        """Whether the engine plans ahead on `platform` (jax's name: cpu, gpu, tpu): as asked, else on an
        accelerator, where the host's work per step is a share of the step worth hiding, and off on the
        CPU, where the host and the "device" share the same cores (measured: docs/performance.md)."""
        return self.async_scheduling if self.async_scheduling is not None else platform != "cpu"

    def sample_on_device_on(self, platform: str) -> bool:
        """Whether the runner samples on the device on `platform`: as asked, else on an accelerator, where
        copying S x vocab f32 logits back and sampling them on the host is a share of a 1-2 ms step, and
        off on the CPU, where the logits are already in host memory and numpy samples them without a
        sort (docs/performance.md "Sampling on the device")."""
        return self.sample_on_device if self.sample_on_device is not None else platform != "cpu"

    def fit_chunks_on(self, platform: str) -> bool:
        """Whether the scheduler cuts prompt chunks to the token buckets on `platform`: as asked, else on
        the CPU, where a prompt chunk's rows are compute-bound and a padding row costs what a real one
        does (a 160-token prompt: 128 + 32 rows 132 ms against 256 rows 186 ms, docs/performance.md),
        and not on an accelerator, whose chunk steps are mostly the weights' read at these sizes."""
        return self.fit_chunks_to_buckets if self.fit_chunks_to_buckets is not None else platform == "cpu"

    def grpc_port_for(self, *, llm: bool) -> int:
        """The port the gRPC API listens on for this kind of artifact (0: none)."""
        if self.grpc_port is None:
            return 0 if llm else DEFAULT_GRPC_PORT
        if self.grpc_port and llm:
            raise HloserveError(f"--grpc-port {self.grpc_port}: the gRPC API is TF Serving's, for predict artifacts; "
                                f"an LLM artifact is served through the OpenAI API over HTTP (leave --grpc-port out)")
        return self.grpc_port

    def generation_defaults(self, artifact_dir: str) -> tuple[dict[str, Any], str]:
        """(the sampling defaults of an LLM served from `artifact_dir`, under a request's field names;
        where they come from). Precedence, as vLLM's: a request's own fields > the override > the
        generation config > hloserve's neutral defaults (SamplingParams')."""
        if self.generation_config in GENERATION_NEUTRAL:
            config, where = {}, f"--generation-config {self.generation_config}"
        else:
            path = artifact_dir if self.generation_config == GENERATION_AUTO else self.generation_config
            config = read_generation_config(path, required=self.generation_config != GENERATION_AUTO)
            where = os.path.join(path, GENERATION_CONFIG) if os.path.isdir(path) else path
            if not config:
                where = f"{artifact_dir} has no {GENERATION_CONFIG}"
        if self.override_generation_config:
            where += ", --override-generation-config"
        defaults = {**sampling_fields(config), **sampling_fields(self.override_generation_config)}
        return checked_defaults(defaults, where), where

    @property
    def load_verify(self) -> bool | str:
        """runtime.load's `verify` for this config."""
        return "full" if self.verify_weights == "full" else True

    def check_kv_cache(self, llm: LLMSpec, path: str) -> None:
        """--kv-cache-dtype against the artifact's cache: the cache's dtype is part of the exported step,
        so a mismatch is one line naming both and the export that gives it."""
        stored = llm.kv_cache.stored_name
        if self.kv_cache_dtype is not None and stored != kv_cache_dtype_name(self.kv_cache_dtype):
            raise HloserveError(f"--kv-cache-dtype {self.kv_cache_dtype}: {path} was exported with a {stored} KV "
                                f"cache; serve it without --kv-cache-dtype, or export it again with `hloserve export "
                                f"SOURCE --kv-cache-dtype {self.kv_cache_dtype}`")

    def resolve(self, llm: LLMSpec) -> tuple[SchedulerConfig, RunnerConfig, list[str]]:
        """The scheduler's and runner's configs for an artifact, and a note per clamped limit."""
        notes = []

        def clamp(name: str, want: int, limit: int, what: str) -> int:
            if want > limit:
                notes.append(f"{name} {want} -> {limit} ({what})")
            return min(want, limit)

        tokens = clamp("max_num_batched_tokens", self.max_num_batched_tokens, llm.max_tokens, "the artifact's max_tokens")
        seqs = clamp("max_num_seqs", self.max_num_seqs, min(llm.max_seqs, tokens), "the artifact's max_seqs")
        if self.max_model_len is not None and self.max_model_len > llm.max_context:
            raise HloserveError(f"max_model_len={self.max_model_len} exceeds the artifact's max_context "
                                f"{llm.max_context}; re-export with a longer context or lower --max-model-len")
        max_len = self.max_model_len or min(llm.max_context, DEFAULT_MAX_MODEL_LEN)
        spec = self.speculative_config
        if spec is not None:
            if seqs < 2:
                raise HloserveError(f"--speculative-config needs at least 2 sequences a step (max_num_seqs is {seqs}): "
                                    f"each proposed token is verified in a row of the step; raise --max-num-seqs")
            k = clamp("num_speculative_tokens", spec.num_speculative_tokens, seqs - 1,
                      "max_num_seqs - 1: each proposed token is a row of the step")
            spec = dataclasses.replace(spec, num_speculative_tokens=k)
        sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=max_len,
                                admission_watermark=self.admission_watermark,
                                enable_prefix_caching=self.enable_prefix_caching, speculative=spec)
        runner = RunnerConfig.for_limits(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, max_blocks=-(-max_len // llm.block_size),
            num_blocks=self.num_blocks, kv_cache_bytes=self.kv_cache_bytes, min_tokens=self.min_token_bucket,
            block_buckets=self.block_buckets, prefill_growth=self.prefill_growth, block_growth=self.block_growth)
        return sched, runner, notes


def checked_defaults(defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """`defaults` (request field names), refused with the reason when SamplingParams would refuse them."""
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("max_tokens=", "max_new_tokens=")   # generation_config.json's name for it
        raise HloserveError(f"{where}: {msg}; fix the value or leave the field out") from None
    return defaults
