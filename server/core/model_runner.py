"""The mechanism half of a step: plan -> padded arrays -> one artifact call -> logits -> tokens.

ModelRunner drives an LLM artifact's step functions through the typed contract
(hloserve.runtime.artifact.llm: LLMSpec, and `pack_step`, the one packer of step inputs):

    tokens, positions, seq_ids, slot_mapping   int32[T]
    block_tables                               int32[S, B]  (padded with the null block 0)
    context_lens, last_token                   int32[S]
    kv_cache                                   LLMSpec.kv_cache.shape, e.g. [L, 2, kv_heads, N, block_size, head_dim]  (donated)
    -> logits f32[S, vocab], kv_cache

T, S and B are padded up to buckets chosen once (RunnerConfig, in step_shapes.py with the rest of
what a plan becomes as a call) and compiled by `warmup()`, so serving never compiles. When the runtime runs `decode`'s
attention composite as a kernel (the CPU), every step is one call of `decode`,
prompt chunks and decodes mixed: the kernel reads only each token's own blocks.
Otherwise a decode-only step (one token per sequence) calls `decode` with T = S,
prefill chunks call `prefill`, and a plan that mixes both runs as two calls:
the flat attention of `prefill` costs T * S * context, so 15 decodes riding
along one 128-token chunk would cost several times the two separate calls
(measured on SmolLM2: 3.2 s of CPU for T=128, S=16 against 0.5 s + 0.3 s). Padding tokens write into the null block and belong to a padding
row whose context is empty; padding rows are never sampled. The KV cache
lives on the device for the runner's lifetime: each call donates it and keeps
the returned one. N (num_blocks) is fixed at construction from a memory budget.

`execute(plan)` is `collect(dispatch(plan))`: `dispatch` binds the inputs and sends the call(s),
leaving the logits on the device (jax dispatches asynchronously), and `collect` waits for them and
samples on the host, or, after `sample_on_device()` (the default on accelerators), samples on the
device and waits for the token ids (plan_sampling.py); async scheduling (core/engine.py) plans the
next step between the two.

With prefix-cache tiers (core/kv_tiers.py) a plan also carries block copies, made before its step:
`kv_saves` gathered on the device (read into the tiers at `collect`, while the step runs: dispatch
never waits for them), then `kv_loads` scattered into their fresh blocks, each a jitted gather/scatter over
the cache's block dim padded to a few bucket sizes (compiled at warm-up; pads read and write the null
block).
"""
from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from hloserve import runtime
from hloserve.runtime.artifact.errors import ArtifactError
from hloserve.runtime.artifact.llm import (MAX_BLOCKS, NULL_BLOCK, NUM_BLOCKS, NUM_SEQS, NUM_TOKENS, STEP_DIMS,
                                           LLMArtifact, LLMSpec)
from hloserve.runtime.buckets import geometric
from hloserve.runtime.host_pages import zeroed_in_huge_pages

from .adapters import Adapter, AdapterError, AdapterTable
from .outputs import RunnerOutput, SchedulerPlan
from .plan_sampling import DeviceSampler, sample_plan
from .sampling import token_logprobs
from .step_shapes import RunnerConfig, StepPolicy, build_step, fit_bucket, warmup_shapes

log = logging.getLogger("hloserve.server.runner")

if TYPE_CHECKING:
    from hloserve.runtime.model import LoadedModel

    from .kv_tiers import KVTiers


def _host(x) -> np.ndarray:
    """A step output on the host: a replicated array of a multi-host run is read from this
    process's own copy."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def tensor_parallel_rules(llm: LLMSpec, path: str, size: int) -> dict:
    """runtime.load's mesh, partition_rules and input_rules for `size`-way tensor parallelism."""
    tp = llm.tensor_parallel
    if tp is None:
        raise ArtifactError(f"{path} does not say how its step splits over devices (it was exported before "
                            f"tensor parallelism); re-export it to serve with --tensor-parallel-size")
    tp.check(size, path)
    axis = "model"
    rules = [(f"^{re.escape(name)}$", (None,) * dim + (axis,)) for name, dim in tp.weights.items()]
    kv = [(f"^{re.escape(llm.kv_cache.input)}$", (None,) * tp.kv_cache_dim + (axis,))]
    return {"mesh": {axis: size}, "partition_rules": rules, "input_rules": kv}


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A step sent to the device and not read back yet (ModelRunner.dispatch -> collect)."""
    plan: SchedulerPlan
    calls: tuple[tuple[SchedulerPlan, int, Any], ...]   # each call's part of the plan, its rows, its logits (on device)
    started: float                                      # time.perf_counter() at dispatch
    dispatch_seconds: float                             # spent in the calls themselves (inputs bound and sent)


class ModelRunner:
    """Runs plans on an LLM artifact loaded by hloserve.runtime.

    Construct with `ModelRunner.from_artifact(artifact, cfg)`: it picks the StepPolicy, narrows cfg's
    buckets to it and loads the runtime with exactly those buckets (the runner is the one bucket
    authority: every call reaches the runtime padded to a bucket it was loaded with).
    """

    def __init__(self, model: "LoadedModel", llm: LLMSpec, cfg: RunnerConfig, policy: StepPolicy):
        # tensor parallel: the step runs over model.mesh, the cache split by KV heads (from_artifact)
        self.tensor_parallel_size = 1 if model.mesh is None else int(model.mesh.devices.size)
        self.model = model
        self.cfg = cfg
        self.llm = llm
        self.policy = policy
        self.block_size = llm.block_size
        self.vocab_size = llm.vocab_size
        self.max_blocks = llm.max_blocks
        fns = model.functions
        if policy.one_call and not fns[policy.decode_fn].kernels:
            log.warning("%s: %s's attention composite was expected to run as a kernel and did not (an artifact "
                        "exported before the composite?): every step runs its portable formulation; re-export "
                        "it for the faster path", model.path, policy.decode_fn)
        if max(cfg.block_buckets) > self.max_blocks:
            raise ValueError(f"block bucket {max(cfg.block_buckets)} exceeds the artifact's max_blocks "
                             f"{self.max_blocks}; lower max_model_len")
        kv = llm.kv_cache
        # kv_cache_bytes is per device: N devices hold 1/N of each block
        n = cfg.num_blocks or max(2, cfg.kv_cache_bytes * self.tensor_parallel_size // kv.bytes_per_block)
        sym = model.manifest.symbols.get(NUM_BLOCKS)
        if sym is not None and sym.max is not None:
            n = min(n, sym.max)
        self.num_blocks = int(n)
        import jax  # the runner is the one server module that touches the device
        import jax.numpy as jnp
        self._kv_name, self._kv_out = kv.input, kv.output
        shape = kv.concrete_shape(self.num_blocks)                         # e.g. [L, 2, kvh, N, bs, hd]
        split = fns[policy.decode_fn].input_sharding(kv.input)            # each device allocates its part
        self.kv_cache = jax.jit(lambda: jnp.zeros(shape, kv.numpy_dtype), out_shardings=split)()
        # on a CPU: the decode steps' block reads cross no 4 KiB pages, and the pages are faulted in
        # by a background thread, not by the first step that writes each block
        zeroed_in_huge_pages(self.kv_cache, populate=True)
        self.kv_cache_bytes = kv.bytes_per_block * self.num_blocks
        # adapter slots (LoraSpec): the table's stacks, placed on the device after each change
        self.adapters = AdapterTable(llm.lora) if llm.lora is not None else None
        self._lora: dict = {}
        self._adapter_lock = threading.Lock()     # loads come from HTTP worker threads
        if self.adapters is not None:
            self._place_adapters()
        # several hosts (runtime/distributed.py): the leader's calls are replayed by the others
        self._calls = None
        if jax.process_count() > 1:
            from hloserve.runtime.distributed import CallChannel
            if self.tensor_parallel_size != jax.device_count():
                raise ValueError(f"a multi-host run needs the step split over every device: "
                                 f"--tensor-parallel-size {jax.device_count()} (got {self.tensor_parallel_size})")
            if self.adapters is not None:   # the followers would not see the adapters' loads
                raise ValueError(f"{model.path} has adapter slots, which a multi-host run does not serve yet; "
                                 f"serve it on one host")
            self._calls = CallChannel(fns, state=(kv.input,))
        self.is_leader = jax.process_index() == 0
        self.steps = 0
        self.step_seconds = 0.0
        self.tiers: "KVTiers | None" = None     # attach_tiers
        self.sampler: DeviceSampler | None = None   # sample_on_device
        self._sampler_warm = 0                        # its executables after warm-up
        self._copy_buckets = geometric(1, self.max_blocks, 4)
        axis = list(kv.shape).index(NUM_BLOCKS)
        self._gather = jax.jit(lambda cache, ids: jnp.moveaxis(jnp.take(cache, ids, axis=axis), axis, 0))
        self._scatter = jax.jit(      # the cache keeps the sharding the step reads it with
            lambda cache, ids, data: cache.at[(slice(None),) * axis + (ids,)].set(jnp.moveaxis(data, 0, axis)),
            donate_argnums=0, out_shardings=split)

    @property
    def multi_host(self) -> bool:
        """Whether this runner's calls are replayed by other processes (runtime/distributed.py)."""
        return self._calls is not None

    def attach_tiers(self, tiers: "KVTiers") -> None:
        """Keep full blocks in `tiers` (the plans' kv_saves / kv_loads); one process only (a multi-host
        run's followers could not replay the copies)."""
        if self.multi_host:
            raise ValueError("prefix-cache tiers serve one process; a multi-host run keeps its KV on the devices")
        self.tiers = tiers

    def sample_on_device(self) -> None:
        """Sample each step's tokens where its logits are (plan_sampling.DeviceSampler): only token ids
        and asked-for logprobs come back to the host. Call before `warmup`, which compiles the sampler.
        One process only (a multi-host run's followers hold no sampler)."""
        if self.multi_host:
            raise ValueError("sampling on the device serves one process; a multi-host run samples on the host")
        self.sampler = DeviceSampler()

    def block_layout(self) -> tuple[tuple[int, ...], str]:
        """One block's K/V: the cache's shape without its num_blocks dim, and its numpy dtype."""
        kv = self.llm.kv_cache
        return tuple(int(d) for d in kv.shape if d != NUM_BLOCKS), kv.numpy_dtype.name

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Read a PEFT LoRA directory into a free slot (AdapterError when it cannot be served; the
        steps already running see the new stacks from their next call)."""
        return self.load_adapters([(name, path)])[0]

    def load_adapters(self, pairs) -> list[Adapter]:
        """load_adapter for each (name, path), the stacks placed on the device once at the end."""
        with self._adapter_lock:
            try:
                return [self._adapter_table(name).load(name, path) for name, path in pairs]
            finally:
                if self.adapters is not None:
                    self._place_adapters()

    def unload_adapter(self, name: str) -> Adapter:
        with self._adapter_lock:
            adapter = self._adapter_table(name).unload(name)
            self._place_adapters()
        return adapter

    def _adapter_table(self, name: str) -> AdapterTable:
        if self.adapters is None:
            raise AdapterError(f"adapter '{name}': {self.model.path} has no adapter slots; export it with "
                               f"--lora-slots N --max-lora-rank R")
        return self.adapters

    def _place_adapters(self) -> None:
        """The adapters' stacks on the device (one dict swapped whole: a step reads one version)."""
        import jax
        self._lora = {name: jax.device_put(a) for name, a in self.adapters.stacks().items()}

    @property
    def one_call(self) -> bool:
        return self.policy.one_call

    @property
    def decode_fn(self) -> str:
        return self.policy.decode_fn

    @property
    def prefill_fn(self) -> str:
        return self.policy.prefill_fn

    @classmethod
    def from_artifact(cls, artifact: "str | LLMArtifact", cfg: RunnerConfig, *, platform: str | None = None,
                      strict: bool = True, verify: bool | str = True, tensor_parallel_size: int = 1) -> "ModelRunner":
        """Load the artifact (a path, or an LLMArtifact already read) with the buckets of cfg narrowed
        to the StepPolicy, on one device or, with tensor_parallel_size N > 1, on a mesh of N devices:
        weights split as the artifact's TensorParallelSpec says (XLA's SPMD partitioner adds the
        collectives), the KV cache split by KV heads."""
        art = artifact if isinstance(artifact, LLMArtifact) else LLMArtifact.read(artifact)
        split = tensor_parallel_rules(art.llm, art.path, tensor_parallel_size) if tensor_parallel_size > 1 else {}
        kernels = runtime.kernel_support(platform, mesh=bool(split))
        policy = StepPolicy.choose(art.llm, list(art.manifest.functions), kernels, art.path)
        cfg = policy.buckets(cfg)
        tokens = sorted({*cfg.token_buckets, *cfg.lone_token_buckets, *cfg.seq_buckets})   # decode steps: T = S
        model = runtime.load(art.path, platform=platform, strict=strict, verify=verify, manifest=art.manifest,
                             kernel_support=kernels,
                             buckets={NUM_TOKENS: tokens, NUM_SEQS: list(cfg.seq_buckets),
                                      MAX_BLOCKS: list(cfg.block_buckets)}, **split)
        return cls(model, art.llm, cfg, policy)

    def device_memory(self) -> dict[tuple[str, str], int]:
        """(device, "weights" | "kv_cache") -> bytes this runner holds on each device."""
        out: dict[tuple[str, str], int] = {}
        for kind, arrays in (("weights", self.model.weights.values()), ("kv_cache", [self.kv_cache])):
            for a in arrays:
                for shard in a.addressable_shards:
                    key = (str(shard.device.id), kind)
                    out[key] = out.get(key, 0) + shard.data.nbytes
        return out

    def warmup_shapes(self) -> list[tuple[str, int, int, int]]:
        """(function, T, S, B) for every padded shape `build_step` can produce."""
        return warmup_shapes(self.cfg, self.decode_fn, self.prefill_fn)

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile every serving shape now; returns how many compiles it took.

        Nothing is run: a freshly compiled step runs at its steady speed from its first call
        (measured 2026-11-26: gemma3-1b shape, each of the 20 shapes' first call within a few ms of
        its second), so running each once on padding only added the step time (~10 s of a 21 s
        warm-up), except in a multi-host run (below). `progress` gets one line per shape.
        """
        done = 0
        shapes = self.warmup_shapes()
        t_start = time.perf_counter()
        for i, (fn, t, s, b) in enumerate(shapes, 1):
            t0 = time.perf_counter()
            env = {NUM_TOKENS: t, NUM_SEQS: s, MAX_BLOCKS: b, NUM_BLOCKS: self.num_blocks}
            function = self.model.functions[fn]
            done += function.warmup({k: [v] for k, v in env.items()}, run=False)
            if self._calls is not None and not function.from_executable_cache(env):
                # a multi-host run still runs each shape once: the processes meet in its collectives,
                # so no process starts serving while another is still compiling (a first step that
                # waits on a compiling peer fails its collective's connect timeout)
                # (all-zero inputs are a valid step: padding tokens of padding rows, into the null block)
                zeros = {n: np.zeros([env[d] for d in dims], np.int32) for n, dims in STEP_DIMS.items()}
                _host(self._call(fn, zeros)["logits"])
            if progress is not None:
                how = ("read from the executable cache" if function.from_executable_cache(env)
                       else f"in {time.perf_counter() - t0:.1f} s")
                progress(f"warm-up {i}/{len(shapes)}: {fn} T={t} S={s} B={b} {how} "
                         f"({time.perf_counter() - t_start:.0f} s so far)")
        self._warm_copies()
        if self.sampler is not None:
            self._warm_sampler()
        return done

    def _warm_sampler(self) -> None:
        """Compile the device sampler for logits of every row bucket, placed as the step leaves them
        (the step function's default placement: its device, or replicated over a tensor-parallel mesh)."""
        import jax
        place = self.model.functions[self.decode_fn].input_sharding("tokens")
        for S in self.cfg.seq_buckets:
            self.sampler.warmup(jax.device_put(np.zeros((S, self.vocab_size), np.float32), place))
        self._sampler_warm = self.sampler.compiles()

    def _copy_chunks(self, n: int):
        """(start, end, padded size) pieces of n block copies, each padded to a copy bucket."""
        top = self._copy_buckets[-1]
        for lo in range(0, n, top):
            m = min(top, n - lo)
            yield lo, lo + m, fit_bucket(self._copy_buckets, m, "blocks copied")

    def _transfer(self, plan: SchedulerPlan) -> None:
        """The plan's block copies: saves first (their blocks may be reused by a load or this step),
        then loads into their blocks; pads copy the null block.

        A save is a gather sent to the device, not read here: reading it would wait for the gather
        (and, with async scheduling, for the previous step) before this step is even sent. The gather
        reads the cache as it is now (jax runs the loads' scatter and the step, which donate the cache,
        after it) into a buffer of its own; the tiers read it at `collect` (KVTiers.land), while the
        step runs.
        """
        saves, loads = plan.kv_saves, plan.kv_loads
        for lo, hi, pad in self._copy_chunks(len(saves)):
            ids = np.zeros(pad, np.int32)
            ids[:hi - lo] = [b for b, _ in saves[lo:hi]]
            self.tiers.put_later([h for _, h in saves[lo:hi]], self._gather(self.kv_cache, ids))
        for lo, hi, pad in self._copy_chunks(len(loads)):
            ids = np.zeros(pad, np.int32)
            ids[:hi - lo] = [b for b, _ in loads[lo:hi]]
            data = np.zeros((pad, *loads[0][1].shape), loads[0][1].dtype)
            data[:hi - lo] = [a for _, a in loads[lo:hi]]
            self.kv_cache = self._scatter(self.kv_cache, ids, data)
        self.tiers.loaded += len(loads)

    def _warm_copies(self) -> None:
        """Compile the block copies at every bucket (a first load must not pay a compile)."""
        if self.tiers is None:
            return
        shape, dtype = self.block_layout()
        for pad in self._copy_buckets:
            ids = np.zeros(pad, np.int32)
            np.asarray(self._gather(self.kv_cache, ids))
            self.kv_cache = self._scatter(self.kv_cache, ids, np.zeros((pad, *shape), dtype))

    def execute(self, plan: SchedulerPlan) -> RunnerOutput:
        """One step, start to end: dispatch it, then collect its tokens."""
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: SchedulerPlan) -> "PendingStep":
        """Send a step to the device without waiting for it: the plan's block copies, then each call
        (jax dispatches asynchronously: the logits stay device arrays until `collect` reads them)."""
        if self.tiers is not None and (plan.kv_saves or plan.kv_loads):
            self._transfer(plan)
        t0 = time.perf_counter()
        if plan.is_empty:
            return PendingStep(plan, (), t0, 0.0)
        # one token per row: decodes, and verified drafts (a row per token)
        decodes = tuple(s for s in plan.seqs if not s.is_chunk)
        chunks = tuple(s for s in plan.seqs if s.is_chunk)
        parts = [plan] if self.one_call or not decodes or not chunks else [
            SchedulerPlan.of(rows) for rows in (decodes, chunks)]
        calls = []
        for part in parts:   # the parts write disjoint cache slots, so their order does not matter
            step = build_step(part, self.cfg, self.block_size, decode_fn=self.decode_fn, prefill_fn=self.prefill_fn,
                              lora=self.adapters is not None)
            calls.append((part, step.num_seqs, self._call(step.function, step.inputs)["logits"]))
        return PendingStep(plan, tuple(calls), t0, time.perf_counter() - t0)

    def collect(self, pending: "PendingStep") -> RunnerOutput:
        """A dispatched step's logits on the host (waiting for the device), sampled; prompt logprobs scored.

        Its block saves land in the tiers first: their gathers run before the step (which donates the
        cache they read), so their host copies overlap the step instead of delaying its dispatch."""
        if self.tiers is not None:
            self.tiers.land()
        if pending.plan.is_empty:
            return RunnerOutput({})
        sampled, logprobs, device, ready = {}, {}, pending.dispatch_seconds, 0.0
        for part, num_seqs, logits in pending.calls:
            t = time.perf_counter()
            if self.sampler is not None:     # tokens drawn on the device; the host waits for them
                result = self.sampler.sample_plan(part, logits, lambda: _host(logits)[:num_seqs])
                ready = time.perf_counter()
                device += ready - t
            else:
                logits = _host(logits)[:num_seqs]               # [S, vocab]
                ready = time.perf_counter()
                device += ready - t
                result = sample_plan(part, logits)
            sampled.update(result.sampled)
            logprobs.update(result.logprobs)
        scored = {s.request_id: self._score(s) for s in pending.plan.seqs if s.score_prompt}
        self.steps += 1
        self.step_seconds += time.perf_counter() - pending.started
        return RunnerOutput(sampled, logprobs, scored, device_seconds=device, ready_at=ready)

    def _score(self, seq) -> tuple:
        """Logprobs of each prompt token after the first, its whole prompt being in the cache now.

        Decode-shaped calls over the warmed buckets: row q re-runs prompt token q at position q with
        its sequence's block table, so its logits are those that predict token q + 1; its K/V write
        goes to the null block (the cache already holds it, and prefix-cached blocks may be shared).
        """
        prompt, k = seq.score_prompt, seq.sampling.prompt_logprobs
        out = []
        width = self.cfg.seq_buckets[-1]
        for lo in range(0, len(prompt) - 1, width):
            qs = range(lo, min(lo + width, len(prompt) - 1))              # positions scored by this call
            rows = tuple(dataclasses.replace(seq, token_ids=(prompt[q],), start=q, score_prompt=()) for q in qs)
            step = build_step(SchedulerPlan.of(rows), self.cfg, self.block_size, decode_fn=self.decode_fn,
                              prefill_fn=self.prefill_fn, lora=self.adapters is not None)
            step.inputs["slot_mapping"][:] = NULL_BLOCK * self.block_size    # nothing is written back
            logits = _host(self._call(step.function, step.inputs)["logits"])
            out += [token_logprobs(logits[i], prompt[q + 1], k) for i, q in enumerate(qs)]
        return tuple(out)

    def _call(self, fn: str, inputs: dict) -> dict:
        """One step function call with the cache (donated, replaced); the leader of a multi-host
        run first sends it to the other processes, which make the same call (follow)."""
        if self._calls is not None and self.is_leader:
            self._calls.send(fn, inputs)
        out = self.model.functions[fn](**inputs, **{self._kv_name: self.kv_cache}, **self._lora)
        self.kv_cache = out[self._kv_out]
        return out

    def follow(self) -> int:
        """A multi-host run's other processes: run every step the leader sends until it stops;
        returns how many ran."""
        if self._calls is None or self.is_leader:
            raise ValueError("follow() is for the non-leader processes of a multi-host run")
        n = 0
        for fn, inputs in self._calls.receive_all():
            self._call(fn, inputs)
            n += 1
        return n

    def close(self) -> None:
        """Release the followers of a multi-host run; land the block saves still pending (a step dispatched
        and never collected) and write the blocks still queued for the disk tier."""
        if self._calls is not None and self.is_leader:
            self._calls.stop()
            self._calls = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    def stats(self) -> dict[str, float]:
        fs = [f.stats for f in self.model.functions.values()]
        sampler = 0 if self.sampler is None else self.sampler.compiles()     # the device sampler's executables
        return {"compiles_total": sum(s.compiles for s in fs) + sampler,
                "compiles_after_warmup_total": sum(s.compiles_after_warmup for s in fs) + sampler - self._sampler_warm,
                "runner_steps_total": self.steps, "runner_step_seconds_total": self.step_seconds,
                **(self.tiers.stats() if self.tiers is not None else {})}
