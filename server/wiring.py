"""One served LLM, assembled in order from one read of its artifact (as nano-vllm's LLMEngine.__init__).

    art = LLMArtifact.read(path)                  manifest.json, the typed LLMSpec and TextSpec, read once
    sched_cfg, runner_cfg = config.resolve(llm)   every limit from ServeConfig, clamped to the artifact
    draft = LLMArtifact.read(spec.model)          a draft model (--speculative-config): checked against the target,
                                                  the KV budget split between the two caches
    runner = ModelRunner.from_artifact(art, ...)  step policy, buckets, weights and KV cache on the device
    runner.load_adapters(config.lora_modules)     each --lora-modules adapter into its slot
    tokenizer = Tokenizer.from_artifact(art)      the TextSpec's tokenizer.json (read once), BOS/EOS from the LLMSpec
    grammars = Grammars(...)                      structured output over the same tokenizer.json text
    proposer = DraftModelProposer(draft runner)   the draft's runner: its own cache, the target's block tables
    scheduler = Scheduler(sched_cfg, BlockManager(runner.num_blocks, ...), proposer=...)
    engine = Engine(scheduler, runner, ...)

Everything below receives typed objects and reads no file of the artifact again. services.build_service
calls `build_engine` with the manifest it read; `load_runner` is the same runner for a multi-host run's
other processes (serve.follow).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from hloserve.runtime.artifact.errors import HloserveError
from hloserve.runtime.artifact.llm import LLMArtifact
from hloserve.runtime.client import platform_devices
from hloserve.runtime.paths import cache_dir

from .config import ServeConfig
from .core.block_manager import BlockManager
from .core.draft_model import DraftModelProposer
from .core.engine import Engine
from .core.kv_tiers import BlockLayout, KVTiers, artifact_digest, make_tiers
from .core.model_runner import ModelRunner
from .core.scheduler import Scheduler
from .core.spec_decode import SpeculativeConfig
from .core.step_shapes import RunnerConfig
from .text.grammar import Grammars
from .text.tokenizer import Tokenizer

log = logging.getLogger("hloserve.server")


def load_runner(art: LLMArtifact, runner_cfg: RunnerConfig, config: ServeConfig, *, strict: bool) -> ModelRunner:
    """The artifact's step on the device(s) `config` names; where prompt chunks are fitted to the token
    buckets (`ServeConfig.fit_chunks_on`), with finer buckets for a lone request's prompt steps."""
    if config.fit_chunks_on(platform_devices(config.platform)[0].platform):
        runner_cfg = runner_cfg.with_lone_buckets(config.min_token_bucket)
    return ModelRunner.from_artifact(art, runner_cfg, platform=config.platform, strict=strict,
                                     verify=config.load_verify, tensor_parallel_size=config.tensor_parallel_size)


def build_engine(artifact: LLMArtifact | str, config: ServeConfig | None = None) -> tuple[Engine, Tokenizer | None]:
    """Load an LLM artifact (a path, or an LLMArtifact already read) and wire runner, tokenizer,
    grammars and scheduler into an engine.

    Returns (engine, tokenizer); the tokenizer is None when the artifact ships none. The engine is
    not started and not warmed up: call `engine.warmup()` (every bucket compiles; /ready waits for
    it), then `engine.start()`.
    """
    config = config or ServeConfig()
    art = artifact if isinstance(artifact, LLMArtifact) else LLMArtifact.read(artifact)
    llm = art.llm
    sched_cfg, runner_cfg, notes = config.resolve(llm)
    for note in notes:
        log.info("%s", note)
    if sched_cfg.speculative is not None and not art.manifest.model.get("batch_invariant"):
        log.warning("%s was exported without --batch-invariant: speculation's greedy text may differ from plain "
                    "decoding's where two tokens are within a rounding (docs/api.md); export it again with "
                    "--batch-invariant for the same text", art.path)
    draft = _draft_artifact(sched_cfg.speculative)
    if draft is not None:
        _check_draft(art, draft, config)
        runner_cfg = _split_kv_budget(art, draft, runner_cfg)
    runner = load_runner(art, runner_cfg, config, strict=config.strict)
    if config.sample_on_device_on(runner.model.client.platform) and not runner.multi_host:
        runner.sample_on_device()
    # an adapter that cannot be served: AdapterError, one line
    for adapter in runner.load_adapters(config.lora_modules) if config.lora_modules else ():
        log.info("LoRA adapter %r (rank %d) from %s in slot %d", adapter.name, adapter.rank, adapter.path,
                 adapter.ref.slot)
    _log_device_memory(runner)
    tokenizer = Tokenizer.from_artifact(art)
    grammars = Grammars(tokenizer.tokenizer_json, llm.vocab_size, tokenizer.eos_token_ids) if tokenizer else None
    eos = tokenizer.eos_token_ids if tokenizer else llm.eos_token_ids
    tiers = _tiers(art, runner, config) if sched_cfg.enable_prefix_caching else None
    blocks = BlockManager(runner.num_blocks, llm.block_size, enable_prefix_caching=sched_cfg.enable_prefix_caching,
                          tiers=tiers)
    proposer = _draft_proposer(draft, runner, config, sched_cfg.speculative) if draft is not None else None
    if config.fit_chunks_on(runner.model.client.platform):
        sched_cfg = dataclasses.replace(sched_cfg, token_buckets=runner.cfg.token_buckets,
                                        lone_token_buckets=runner.cfg.lone_token_buckets)
    scheduler = Scheduler(sched_cfg, blocks, eos_token_ids=eos, proposer=proposer)
    engine = Engine(scheduler, runner, vocab_size=llm.vocab_size, decoder=tokenizer, grammars=grammars,
                    async_scheduling=config.async_scheduling_on(runner.model.client.platform))
    return engine, tokenizer


def _draft_artifact(spec: SpeculativeConfig | None) -> LLMArtifact | None:
    """The draft model's artifact (--speculative-config's "model", a directory by now), read once; None
    without one."""
    return LLMArtifact.read(spec.model) if spec is not None and spec.method == "draft_model" else None


def _check_draft(art: LLMArtifact, draft: LLMArtifact, config: ServeConfig) -> None:
    """A draft model the target can verify: the same vocabulary and tokenizer (its proposals are token ids
    of the target's) and the same KV block size (the two caches share block tables); one device."""
    if config.tensor_parallel_size > 1:
        raise HloserveError("--speculative-config with a draft model serves one device; drop "
                            "--tensor-parallel-size or use \"method\": \"ngram\"")
    ids = []
    for a in (art, draft):
        tok = Tokenizer.from_artifact(a)
        ids.append((a.llm.vocab_size, tok.vocab_digest() if tok else None))
    if ids[0] != ids[1]:
        raise HloserveError(f"--speculative-config: the draft model {draft.path} (vocab {ids[1][0]}, tokenizer "
                            f"{ids[1][1]}) does not share the target {art.path}'s vocabulary (vocab {ids[0][0]}, "
                            f"tokenizer {ids[0][1]}); use a draft with the target's tokenizer")
    if art.llm.block_size != draft.llm.block_size:
        raise HloserveError(f"--speculative-config: the draft model {draft.path} has KV blocks of "
                            f"{draft.llm.block_size} tokens, the target {art.path} of {art.llm.block_size}; the two "
                            f"share block tables, so export the draft with the target's block size")


def _split_kv_budget(art: LLMArtifact, draft: LLMArtifact, runner_cfg: RunnerConfig) -> RunnerConfig:
    """The target's RunnerConfig with its block count fixed so that its cache and the draft's, as many
    blocks each (the draft reads and writes through the target's block tables), fit the KV budget
    together: blocks = budget // (target's bytes per block + draft's). --num-blocks is both caches' count."""
    if runner_cfg.num_blocks is not None:
        return runner_cfg
    t_bytes, d_bytes = art.llm.kv_cache.bytes_per_block, draft.llm.kv_cache.bytes_per_block
    n = max(2, runner_cfg.kv_cache_bytes // (t_bytes + d_bytes))
    log.info("KV cache budget %.1f MiB split between the target and the draft model: %d blocks each, %.1f MiB and "
             "%.1f MiB", runner_cfg.kv_cache_bytes / 2**20, n, n * t_bytes / 2**20, n * d_bytes / 2**20)
    return dataclasses.replace(runner_cfg, num_blocks=n)


def _draft_proposer(draft: LLMArtifact, runner: ModelRunner, config: ServeConfig,
                    spec: SpeculativeConfig) -> DraftModelProposer:
    """The draft model loaded with a cache of the target's block count, for as many sequences a call as
    a step may propose for (disable_by_batch_size, within the target's sequence buckets)."""
    most = min(spec.disable_by_batch_size, runner.cfg.seq_buckets[-1])
    cfg = dataclasses.replace(runner.cfg, num_blocks=runner.num_blocks,
                              seq_buckets=tuple(s for s in runner.cfg.seq_buckets if s < most) + (most,))
    draft_runner = load_runner(draft, cfg, config, strict=config.strict)
    if draft_runner.num_blocks != runner.num_blocks:
        raise HloserveError(f"--speculative-config: the draft model {draft.path} holds at most "
                            f"{draft_runner.num_blocks} KV blocks, the target {runner.num_blocks}; lower "
                            f"--kv-cache-mib or --num-blocks to {draft_runner.num_blocks}")
    log.info("draft model %s: %.1f MiB of weights, %.1f MiB of KV cache", draft.path,
             sum(n for (_, kind), n in draft_runner.device_memory().items() if kind == "weights") / 2**20,
             draft_runner.kv_cache_bytes / 2**20)
    return DraftModelProposer(draft_runner, max_chunk=draft_runner.cfg.token_buckets[-1],
                              max_rows=draft_runner.cfg.seq_buckets[-1])


def _tiers(art: LLMArtifact, runner: ModelRunner, config: ServeConfig) -> KVTiers | None:
    """The prefix-cache tiers below the device (host RAM, disk) the config asks for, attached to the
    runner; none in a multi-host run (its followers could not replay the copies)."""
    if runner.multi_host:
        log.info("prefix-cache tiers are off in a multi-host run")
        return None
    shape, dtype = runner.block_layout()
    tiers = make_tiers(host_bytes=config.kv_host_cache_bytes, disk_bytes=config.kv_disk_cache_bytes,
                       disk_root=config.kv_disk_dir or os.path.join(cache_dir(), "kv"),
                       digest=artifact_digest(art.manifest.to_json()), layout=BlockLayout(shape, dtype))
    if tiers is not None:
        runner.attach_tiers(tiers)
    return tiers


def _log_device_memory(runner: ModelRunner) -> None:
    per_device: dict[str, dict[str, int]] = {}
    for (device, kind), n in runner.device_memory().items():
        per_device.setdefault(device, {})[kind] = n
    for device, kinds in sorted(per_device.items()):
        log.info("device %s holds %.1f MiB of weights and %.1f MiB of KV cache (%d blocks of %d tokens)", device,
                 kinds.get("weights", 0) / 2**20, kinds.get("kv_cache", 0) / 2**20, runner.num_blocks,
                 runner.block_size)
