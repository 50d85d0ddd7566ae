"""One served LLM, assembled in order from one read of its artifact (as nano-vllm's LLMEngine.__init__).

    art = LLMArtifact.read(path)                  manifest.json, the typed LLMSpec and TextSpec, read once
    sched_cfg, runner_cfg = config.resolve(llm)   every limit from ServeConfig, clamped to the artifact
    runner = ModelRunner.from_artifact(art, ...)  step policy, buckets, weights and KV cache on the device
    runner.load_adapters(config.lora_modules)     each --lora-modules adapter into its slot
    tokenizer = Tokenizer.from_artifact(art)      the TextSpec's tokenizer.json (read once), BOS/EOS from the LLMSpec
    grammars = Grammars(...)                      structured output over the same tokenizer.json text
    scheduler = Scheduler(sched_cfg, BlockManager(runner.num_blocks, ...))
    engine = Engine(scheduler, runner, ...)

Everything below receives typed objects and reads no file of the artifact again. services.build_service
calls `build_engine` with the manifest it read; `load_runner` is the same runner for a multi-host run's
other processes (serve.follow).
"""
from __future__ import annotations

import logging
import os

from hloserve.runtime.artifact.llm import LLMArtifact
from hloserve.runtime.paths import cache_dir

from .config import ServeConfig
from .core.block_manager import BlockManager
from .core.engine import Engine
from .core.kv_tiers import BlockLayout, KVTiers, artifact_digest, make_tiers
from .core.model_runner import ModelRunner, RunnerConfig
from .core.scheduler import Scheduler
from .text.grammar import Grammars
from .text.tokenizer import Tokenizer

log = logging.getLogger("hloserve.server")


def load_runner(art: LLMArtifact, runner_cfg: RunnerConfig, config: ServeConfig, *, strict: bool) -> ModelRunner:
    """The artifact's step on the device(s) `config` names."""
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
    runner = load_runner(art, runner_cfg, config, strict=config.strict)
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
    scheduler = Scheduler(sched_cfg, blocks, eos_token_ids=eos)
    engine = Engine(scheduler, runner, vocab_size=llm.vocab_size, decoder=tokenizer, grammars=grammars)
    return engine, tokenizer


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
