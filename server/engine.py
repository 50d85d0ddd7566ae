"""The engine: one loop thread owns the device and runs schedule -> execute -> update.

    HTTP handlers (any thread / event loop)          loop thread (owns the runner)
    ---------------------------------------          -----------------------------
    stream = engine.add_request(ids, params)  --->   inbox: ("add", request)
    async for out in stream: ...              <---   outputs dispatched per request
    engine.abort(request_id) / cancelled task --->   inbox: ("abort", id), handled before the next step

Handlers never touch the scheduler or the runner; they enqueue messages and
read per-request streams. `add_request` validates on the caller's thread (the
checks read only immutable configuration) so a bad request fails at once,
with a message fit for a 400 answer.

Metrics are kept by the loop thread and read through `metrics()`, a frozen
snapshot, with vLLM's metric names in `prometheus_text()`.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import Callable, Iterator, Protocol, Sequence

from .block_manager import BlockManager
from .sampling import SamplingParams
from .scheduler import RequestOutput, RunnerOutput, Scheduler, SchedulerConfig, SchedulerPlan

log = logging.getLogger("hloserve.server.engine")


class Runner(Protocol):
    """Executes a plan on the device: one model call plus sampling."""

    def execute(self, plan: SchedulerPlan) -> RunnerOutput: ...


class EngineError(RuntimeError):
    """The engine failed a request (the runner raised, or the engine stopped)."""


# -- per-request streams -----------------------------------------------------------
class RequestStream:
    """Outputs of one request, from the loop thread to the consumer.

    Created inside a running event loop it is async-iterable (`async for out in
    stream`); created outside one it is a plain iterator. Cancelling the task
    that awaits it (client disconnect) aborts the request; so do `abort()` and
    leaving an `async with stream:` block early. Iteration ends after the
    output with `finished=True`.
    """
    _DONE = object()

    def __init__(self, request_id: str, on_abort: Callable[[str], None]):
        self.request_id = request_id
        self._on_abort = on_abort
        self.finished = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._aq: asyncio.Queue | None = asyncio.Queue() if self._loop else None
        self._q: queue.Queue | None = None if self._loop else queue.Queue()

    # called on the loop thread
    def _put(self, out: RequestOutput) -> None:
        if self._loop is None:
            self._q.put(out)
            return
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens
            self._on_abort(self.request_id)

    def abort(self) -> None:
        if not self.finished:
            self._on_abort(self.request_id)

    # `async with stream:` / `with stream:` abort the request if the body leaves before it finished
    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __aiter__(self) -> "RequestStream":
        if self._aq is None:
            raise TypeError("this stream was created outside an event loop; iterate it with `for`, not `async for`")
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._aq.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        self.finished = out.finished
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._q is None:
            raise TypeError("this stream was created inside an event loop; iterate it with `async for`")
        return self

    def __next__(self) -> RequestOutput:
        if self.finished:
            raise StopIteration
        out = self._q.get()
        self.finished = out.finished
        return out

    def drain(self) -> list[RequestOutput]:
        """The outputs queued so far, without waiting (plain-iterator streams; for loops driven
        by hand with `Engine.run_once`)."""
        if self._q is None:
            raise TypeError("this stream was created inside an event loop; iterate it with `async for`")
        outs = []
        while not self.finished:
            try:
                out = self._q.get_nowait()
            except queue.Empty:
                break
            self.finished = out.finished
            outs.append(out)
        return outs


# -- metrics -----------------------------------------------------------------------
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


@dataclasses.dataclass
class Histogram:
    """Prometheus-style cumulative histogram (upper bounds `buckets`, +Inf implied)."""
    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = dataclasses.field(default_factory=list)   # per bucket, not cumulative; last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    """Engine metrics at one instant (taken by the loop thread after a step).

    Attributes:
      num_running / num_waiting: requests in each queue.
      kv_usage: fraction of KV blocks in use; kv_free_blocks / kv_total_blocks: counts.
      prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found cached.
      num_preemptions: requests preempted (recomputed later).
      prompt_tokens / generation_tokens: totals.
      finished: finish reason -> count.
      steps: engine steps run.
      ttft / itl / e2e: histograms of time to first token, inter-token latency and
        request latency, in seconds.
      runner: counters the runner reports (e.g. compiles), if it has `stats()`.
    """
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_free_blocks: int
    kv_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]
    steps: int
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    runner: dict[str, float]


def prometheus_text(m: MetricsSnapshot, *, model_name: str = "model") -> str:
    """Prometheus exposition text with vLLM's metric names where they exist."""
    label = f'model_name="{model_name}"'
    lines: list[str] = []

    def metric(name, kind, help_, value, extra=""):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.append(f"{name}{{{label}{extra}}} {value}")

    def hist(name, help_, h: Histogram):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        for bound, cum in zip(list(h.buckets) + ["+Inf"], itertools.accumulate(h.counts)):
            lines.append(f'{name}_bucket{{{label},le="{bound}"}} {cum}')
        lines.extend([f"{name}_sum{{{label}}} {h.sum}", f"{name}_count{{{label}}} {h.count}"])

    metric("vllm:num_requests_running", "gauge", "Requests running on the device.", m.num_running)
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", m.num_waiting)
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage (1 = full): blocks held by requests; blocks kept "
           "only for prefix-cache reuse count as free.", m.kv_usage)
    metric("hloserve:kv_cache_used_blocks", "gauge", "KV blocks held by requests (reference count > 0).",
           m.kv_total_blocks - m.kv_free_blocks)
    metric("hloserve:kv_cache_free_blocks", "gauge", "KV blocks free to allocate (prefix-cached ones included).",
           m.kv_free_blocks)
    metric("hloserve:kv_cache_total_blocks", "gauge", "Allocatable KV blocks (the null block excluded).",
           m.kv_total_blocks)
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", m.prefix_cache_queries)
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", m.prefix_cache_hits)
    metric("vllm:num_preemptions_total", "counter", "Requests preempted (recomputed later).", m.num_preemptions)
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.", m.prompt_tokens)
    metric("vllm:generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
    lines += ["# HELP vllm:request_success_total Finished requests by finish reason.",
              "# TYPE vllm:request_success_total counter"]
    for reason, n in sorted(m.finished.items()):
        lines.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {n}')
    hist("vllm:time_to_first_token_seconds", "Time to first token.", m.ttft)
    hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m.itl)
    hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", m.e2e)
    for k, v in sorted(m.runner.items()):
        metric(f"hloserve:{k}", "counter" if k.endswith("_total") else "gauge", f"Runner counter {k}.", v)
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class _Live:
    """Loop-thread bookkeeping of one request."""
    stream: RequestStream
    arrival: float
    last_token_time: float | None = None


# -- the engine --------------------------------------------------------------------
class Engine:
    """Scheduler + runner + the loop thread.

    `step()` can be driven by hand (tests, benchmarks) when the loop thread is
    not started; `start()` runs it in a thread until `stop()`.
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, *, vocab_size: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.scheduler = scheduler
        self.runner = runner
        self.vocab_size = vocab_size
        self._clock = clock
        self._cv = threading.Condition()
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self._steps = 0
        self._finished: collections.Counter[str] = collections.Counter()
        self._ttft, self._itl, self._e2e = Histogram(), Histogram(), Histogram()
        self._snapshot_lock = threading.Lock()
        self._snapshot = self._take_snapshot()

    # -- the step: exactly three calls ---------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        out = self.runner.execute(plan)
        return self.scheduler.update(plan, out)

    # -- API for handlers (any thread) -----------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    request_id: str | None = None) -> RequestStream:
        """Validate and enqueue a request; returns its stream of outputs.

        Raises ValueError (say 400) for a request that can never run, and
        EngineError if the engine is stopped.
        """
        ids = [int(t) for t in prompt_token_ids]
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        self.scheduler.check_request(ids, params)
        if self._stopping:
            raise EngineError("the engine is stopped; it accepts no new requests")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self.abort)
        with self._cv:
            self._inbox.append(("add", (request_id, ids, params, stream, self._clock())))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (client disconnect); its blocks are freed before the next step."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile every shape the runner can be asked for (before /ready); returns compiles done."""
        warm = getattr(self.runner, "warmup", None)
        n = warm(progress) if callable(warm) else 0
        with self._snapshot_lock:
            self._snapshot = self._take_snapshot()
        return n

    def metrics(self) -> MetricsSnapshot:
        with self._snapshot_lock:
            return self._snapshot

    # -- the loop thread ------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is not None:
            raise EngineError("the engine loop is already running")
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hloserve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; unfinished requests end with finish_reason "abort"."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.scheduler.has_unfinished() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
            self.run_once()
        self._shutdown()

    def run_once(self) -> None:
        """Handle the inbox, then run one step if there is work (the loop body; drive it by hand
        only when the loop thread is not started)."""
        with self._cv:
            messages = list(self._inbox)
            self._inbox.clear()
        for kind, payload in messages:
            self._handle(kind, payload)
        if self.scheduler.has_unfinished():
            try:
                outputs = self.step()
                self._steps += 1
            except Exception as e:  # noqa: BLE001 (the loop must survive a failing step)
                log.error("engine step failed; failing all in-flight requests:\n%s", traceback.format_exc())
                outputs = self.scheduler.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._dispatch(outputs)
            if not self.scheduler.num_running and self.scheduler.num_waiting:
                time.sleep(0.001)  # nothing could be admitted; don't spin (cannot persist: a lone request fits)
        with self._snapshot_lock:
            self._snapshot = self._take_snapshot()

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            request_id, ids, params, stream, arrival = payload
            try:
                self.scheduler.add_request(request_id, ids, params)
            except ValueError as e:
                stream._put(RequestOutput(request_id, (), "", True, "error", None, len(ids), 0, 0, str(e)))
                return
            self._live[request_id] = _Live(stream, arrival)
        elif kind == "abort":
            out = self.scheduler.abort(payload)
            if out is not None:
                self._dispatch([out])

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        now = self._clock()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:
                if live.last_token_time is None:
                    self._ttft.observe(now - live.arrival)
                else:
                    self._itl.observe(now - live.last_token_time)
                live.last_token_time = now
            if out.finished:
                del self._live[out.request_id]
                self._finished[out.finish_reason] += 1
                if out.finish_reason not in ("abort", "error"):
                    self._e2e.observe(now - live.arrival)
            live.stream._put(out)

    def _shutdown(self) -> None:
        for kind, payload in self._inbox:
            if kind == "add":
                request_id, ids, _, stream, _ = payload
                stream._put(RequestOutput(request_id, (), "", True, "abort", None, len(ids), 0, 0, "engine stopped"))
        self._inbox.clear()
        for rid in list(self._live):
            out = self.scheduler.abort(rid)
            if out is not None:
                self._dispatch([out])
        with self._snapshot_lock:
            self._snapshot = self._take_snapshot()

    def _take_snapshot(self) -> MetricsSnapshot:
        s, b = self.scheduler.stats, self.scheduler.blocks
        runner_stats = getattr(self.runner, "stats", None)
        return MetricsSnapshot(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting, kv_usage=b.usage,
            kv_free_blocks=b.num_free_blocks, kv_total_blocks=b.total_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
            finished=dict(self._finished), steps=self._steps, ttft=self._ttft.copy(), itl=self._itl.copy(),
            e2e=self._e2e.copy(), runner=dict(runner_stats()) if callable(runner_stats) else {})


# -- wiring an artifact into an engine ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits, parsed once at the edge (CLI flags / app settings).

    Attributes:
      max_num_seqs / max_num_batched_tokens: per-step limits (SchedulerConfig); the runner's
        largest S and T buckets equal them.
      max_model_len: context per request; None = the artifact's max_context.
      kv_cache_bytes: device memory for the KV cache (sets num_blocks); num_blocks overrides it.
      block_buckets / block_growth: how many block-table widths to compile, and their ratio (the
        largest covers max_model_len; every step pays attention for its bucket's width).
      min_token_bucket: the smallest prefill T bucket.
      prefill_growth: ratio between consecutive prefill T buckets (2 = powers of two; 4
        compiles fewer prefill shapes, padding a prefill step more). S buckets are powers of two.
      enable_prefix_caching / admission_watermark: scheduler policy knobs.
      platform: "cpu", "gpu", "tpu" or None for jax's default.
    """
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_bytes: int = 512 << 20
    num_blocks: int | None = None
    block_buckets: int = 2
    block_growth: int = 4
    min_token_bucket: int = 16
    prefill_growth: int = 2
    enable_prefix_caching: bool = True
    admission_watermark: float = 0.01
    platform: str | None = None


def build_engine(artifact_path: str, config: EngineConfig = EngineConfig(), *, strict: bool = True):
    """Load an LLM artifact and wire runner, block manager, tokenizer and scheduler.

    Returns (engine, tokenizer); the tokenizer is None when the artifact ships none.
    The engine is not started and not warmed up: call `engine.warmup()` (every
    bucket compiles; /ready waits for it), then `engine.start()`.
    """
    import os

    from hloserve.exporter import artifact

    from .model_runner import ModelRunner, RunnerConfig
    from .tokenizer import Tokenizer

    manifest = artifact.read_manifest(artifact_path)
    llm = manifest.model.get("llm")
    if not isinstance(llm, dict):
        raise ValueError(f"artifact {artifact_path} is not an LLM step artifact (no model['llm'] in its manifest); "
                         f"serve it with the predict API instead")
    bs, max_ctx = int(llm["block_size"]), int(llm["max_context"])
    max_len = min(config.max_model_len or max_ctx, max_ctx)
    if config.max_model_len and config.max_model_len > max_ctx:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the artifact's max_context {max_ctx}; "
                         f"re-export with a longer context or lower max_model_len")
    if config.max_num_seqs > int(llm["max_seqs"]) or config.max_num_batched_tokens > int(llm["max_tokens"]):
        raise ValueError(f"max_num_seqs={config.max_num_seqs} / max_num_batched_tokens={config.max_num_batched_tokens} "
                         f"exceed the artifact's max_seqs={llm['max_seqs']} / max_tokens={llm['max_tokens']}")
    rcfg = RunnerConfig.for_limits(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_blocks=-(-max_len // bs), num_blocks=config.num_blocks,
                                   kv_cache_bytes=config.kv_cache_bytes, min_tokens=config.min_token_bucket,
                                   block_buckets=config.block_buckets, prefill_growth=config.prefill_growth,
                                   block_growth=config.block_growth)
    runner = ModelRunner.from_artifact(artifact_path, rcfg, platform=config.platform, strict=strict)
    tok_file = manifest.model.get("tokenizer")
    tokenizer = (Tokenizer.from_artifact(artifact_path, manifest.model)
                 if tok_file and os.path.exists(os.path.join(artifact_path, tok_file)) else None)
    eos = tokenizer.eos_token_ids if tokenizer else tuple(llm.get("eos_token_ids") or ())
    sched = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                      config.admission_watermark),
                      BlockManager(runner.num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching),
                      decoder=tokenizer, eos_token_ids=eos)
    return Engine(sched, runner, vocab_size=runner.vocab_size), tokenizer
