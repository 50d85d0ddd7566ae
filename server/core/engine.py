"""The engine: one loop thread owns the device and runs schedule -> execute -> update.

    HTTP handlers (any thread / event loop)          loop thread (owns the runner)
    ---------------------------------------          -----------------------------
    stream = engine.add_request(ids, params)  --->   inbox: AddRequest
    async for out in stream: ...              <---   outputs emitted per request
    engine.abort(request_id) / cancelled task --->   inbox: Abort(id), handled before the next step
    engine.end_all(reason)                    --->   inbox: EndAll(reason)

Handlers never touch the scheduler or the runner; they send typed messages
(frozen dataclasses, as vLLM's engine-core requests) and read per-request
streams. `add_request` validates on the caller's thread (the checks read only
immutable configuration) so a bad request fails at once, with a message fit
for a 400 answer.

With async scheduling the loop plans step N+1 while step N runs on the device (`Engine` says how,
and the rules that keep its outputs the serial loop's).

Metrics are kept by the loop thread and read through `metrics()`, a frozen
snapshot (server/core/metrics.py renders it with vLLM's metric names).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from .detokenizer import Detokenizer, TextState
from .metrics import STEP_BUCKETS, Histogram, MetricsSnapshot
from .outputs import FinishReason, RequestOutput, RunnerOutput, SchedulerPlan
from .sampling import SamplingParams
from .scheduler import Scheduler
from .stream import RequestStream, put_all
from .structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from ..text.grammar import Grammars, Matcher
    from ..text.tokenizer import Decoder

log = logging.getLogger("hloserve.server.engine")


class Runner(Protocol):
    """Executes plans on the device (ModelRunner; tests/support/mock_runner.py's MockRunner)."""

    def execute(self, plan: SchedulerPlan) -> RunnerOutput:
        """One step: the model call(s) for the plan, then sampling."""

    def dispatch(self, plan: SchedulerPlan) -> object:
        """Send a step to the device without waiting for it (async scheduling); `collect` finishes it."""

    def collect(self, pending: object) -> RunnerOutput:
        """A dispatched step's tokens: wait for its logits, sample."""

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile every shape `execute` can be asked for; returns the compiles done."""

    def device_memory(self) -> Mapping[tuple[str, str], int]:
        """(device, "weights" | "kv_cache") -> bytes held (fixed after construction)."""

    def stats(self) -> Mapping[str, float]:
        """Counters for /metrics (compiles, steps)."""

    def close(self) -> None:
        """Release what the runner holds beyond its arrays (a multi-host run's followers)."""


class EngineError(RuntimeError):
    """The engine failed a request (the runner raised, or the engine stopped)."""


STOPPED = "the engine stopped"
COMPILE = object()   # add_request's default: make the grammar matcher there


# -- messages from handlers to the loop thread (vLLM's typed engine-core requests) --------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class AddRequest:
    """Admit a request: validated on the caller's thread, added to the scheduler on the loop thread."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: RequestStream
    arrival: float
    matcher: "Matcher | None" = None     # its grammar position, when it asks for structured output

    def refuse(self, error: str) -> None:
        """End its stream before it ran (the scheduler refused it, or the engine stopped)."""
        self.stream._put(RequestOutput.ended_before_start(self.request_id, prompt_len=len(self.prompt_token_ids),
                                                          reason=FinishReason.ERROR, error=error))


@dataclasses.dataclass(frozen=True)
class Abort:
    """End one request now (client disconnect): finish_reason "abort", its blocks freed."""
    request_id: str


@dataclasses.dataclass(frozen=True)
class EndAll:
    """End every request now with finish_reason "error" and `reason` (graceful shutdown's deadline)."""
    reason: str


EngineMessage = AddRequest | Abort | EndAll


@dataclasses.dataclass
class _Live:
    """The engine's entry for one admitted request (the scheduler keeps its token state by the same id)."""
    stream: RequestStream
    arrival: float
    text: "TextState | None"          # the detokenizer's state; None without a tokenizer
    matcher: "Matcher | None"          # structured output: its grammar position
    last_token_time: float | None = None


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A step dispatched and not yet collected (async scheduling)."""
    plan: SchedulerPlan
    pending: object           # the runner's handle
    sent: float               # time.perf_counter() when its dispatch began
    host_seconds: float       # the host work before it that the device did not overlap


# -- the engine --------------------------------------------------------------------
class Engine:
    """Scheduler + runner + the loop thread.

    `step()` can be driven by hand (tests, benchmarks) when the loop thread is
    not started; `start()` runs it in a thread until `stop()`.

    A request's life: `add_request` validates it (caller's thread) and sends an AddRequest;
    `_admit` hands it to the scheduler and opens its `_Live` entry; every output then passes
    `_emit` (text, metrics, stream), and the output that finishes it, whatever ended it (a
    token rule, a stop string, abort, an error, stop()), makes `_emit` call `_release`: the one
    place that removes it from the scheduler (freeing its blocks) and from `_live`.

    Async scheduling (`async_scheduling=True`, vLLM's --async-scheduling; SGLang's overlap
    scheduler) plans step N+1 while step N runs on the device (`_step_ahead`), as jax dispatches a
    step without waiting for it. The tokens N will sample are placeholders in N+1's plan until N's
    logits are read and sampled on the host; they are put into N+1's inputs before it is sent, so
    every step computes what the serial loop computes. The rules that keep it so:

    * A request whose token in flight is its last by length (max_tokens, the context) gets no row in
      N+1. One that N's token ends otherwise (EOS, a stop token) loses its N+1 row before N+1 is
      sent (`Scheduler.fill`), its blocks freed by `update` as in the serial loop.
    * Stop strings, a complete grammar and aborts end a request between turns, while N+1 may be
      computing a token for it: the stream ends at once, as in the serial loop, its blocks are freed
      then, and its N+1 token is discarded (`update` skips a request it no longer knows). Freeing
      blocks the device is still writing is safe: every later use of the cache (a step, a block
      copy) takes the cache N+1 returns, so it runs after N+1.
    * Preempting a request whose token is in flight drops that token; recomputing draws the same
      one (a draw depends only on the request's seed and the token's index).
    * A grammar's mask needs the tokens so far, and a draft proposer reads them: while a live
      request has a grammar, or speculative decoding is on, each step is planned after the last
      one's tokens are known (serially).
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, *, vocab_size: int | None = None,
                 decoder: "Decoder | None" = None, grammars: "Grammars | None" = None,
                 clock: Callable[[], float] = time.monotonic, async_scheduling: bool = False):
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self._in_flight: _InFlight | None = None
        self.runner = runner
        self.structured = StructuredOutputManager(grammars)
        self.detokenizer = Detokenizer(decoder)
        self.vocab_size = vocab_size
        self._clock = clock
        self._cv = threading.Condition()
        self._inbox: collections.deque[EngineMessage] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self._steps = 0
        self._finished: collections.Counter[str] = collections.Counter()
        self._ttft, self._itl, self._e2e = Histogram(), Histogram(), Histogram()
        self._step_host, self._step_device = Histogram(STEP_BUCKETS), Histogram(STEP_BUCKETS)
        self._device_seconds: float | None = None   # the running step's, from its RunnerOutput
        self._step_chunks = False                    # whether the running step computes a chunk
        self._step_seconds = {"chunk": 0.0, "decode": 0.0}   # steps' wall seconds, by what they run
        self._device_memory = dict(runner.device_memory())   # fixed after construction: read once
        self._snapshot_lock = threading.Lock()
        self._snapshot = self._take_snapshot()

    # -- the step: schedule, mask, execute, update ------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs: serially, or with async scheduling the outputs of the step that finished
        while the next one was planned (`_step_ahead`)."""
        if self.async_scheduling:
            return self._step_ahead()
        plan = self.scheduler.schedule()
        plan = self.structured.masks(plan, self._matcher_of)
        out = self.runner.execute(plan)
        self._device_seconds, self._step_chunks = out.device_seconds, any(s.is_chunk for s in plan.seqs)
        return self.scheduler.update(plan, out)

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: step N+1 planned while step N runs on the device.

        One turn: count N as run (`Scheduler.assume`: a placeholder for each token N samples), schedule
        N+1, read N's tokens (`collect`, the one wait on the device), apply them (`update`: the token
        rules), put them into N+1 (`fill`: the rows of requests that ended are dropped) and dispatch N+1;
        N's outputs then pass `_emit` (detokenizing, stop strings, streams) while N+1 runs. A turn with
        a grammar or a draft in play runs N+1 serially instead (see the class docstring).
        """
        t0, ahead, self._in_flight = time.perf_counter(), self._in_flight, None
        overlap = self._can_overlap()
        if ahead is not None and overlap:
            self.scheduler.assume(ahead.plan)
        plan = self.scheduler.schedule() if (overlap or ahead is None) and self.scheduler.has_work() else None
        outputs, ready = self._collect(ahead) if ahead is not None else ([], t0)
        if plan is None or (plan.is_empty and not plan.kv_saves and not plan.kv_loads):
            return outputs
        if ahead is not None:
            plan = self.scheduler.fill(plan)
        plan = self.structured.masks(plan, self._matcher_of)
        sent = time.perf_counter()
        self._in_flight = _InFlight(plan, self.runner.dispatch(plan), sent, sent - ready)
        if not overlap:   # nothing may be planned before its tokens are known: finish it now
            outputs, _ = self._collect(self._in_flight)
            self._in_flight = None
        return outputs

    def _collect(self, step: _InFlight) -> tuple[list[RequestOutput], float]:
        """A dispatched step's outputs, its time observed, and when its logits reached the host.

        Its device time runs from its dispatch to its logits on the host; its host time is the work
        between the previous step's logits and its dispatch (what the device waited for). Host work
        done while it ran (planning the next step, emitting the last one's outputs) is in neither:
        with a device slower than that work it is hidden; otherwise the device time includes it."""
        out = self.runner.collect(step.pending)
        ready = out.ready_at or time.perf_counter()
        if not step.plan.is_empty:
            self._observe_step(ready - step.sent, step.host_seconds, any(s.is_chunk for s in step.plan.seqs))
        return self.scheduler.update(step.plan, out), ready

    def _observe_step(self, device: float, host: float, chunk: bool) -> None:
        """A step that ran the model, in the step metrics: its device and host seconds (what each
        counts: `_collect` with async scheduling, `run_once` serially) and their sum by kind."""
        self._step_device.observe(device)
        self._step_host.observe(host)
        self._step_seconds["chunk" if chunk else "decode"] += device + host

    def _can_overlap(self) -> bool:
        """Whether the next step may be planned before the running one's tokens are known: not with a
        proposer (a draft reads the tokens so far) nor with a live grammar (its mask needs them)."""
        return self.scheduler.proposer is None and not any(live.matcher for live in self._live.values())

    def _has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- API for handlers (any thread) -----------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    request_id: str | None = None, matcher: "Matcher | None | object" = COMPILE) -> RequestStream:
        """Validate and enqueue a request; returns its stream of outputs.

        `matcher`: the request's grammar matcher when the caller made it already with
        `structured.matcher(params)` (the server does, on a worker thread: a grammar compiles in
        milliseconds to seconds, too long for the event loop that calls this); made here otherwise.
        Raises ValueError (say 400) for a request that can never run, and
        EngineError if the engine is stopped.
        """
        ids = tuple(int(t) for t in prompt_token_ids)
        self.check_token_ids(ids)
        self.check_token_ids([t for t, _ in params.logit_bias], what="logit_bias keys")
        self.check_token_ids(params.stop_token_ids, what="stop_token_ids")
        self.scheduler.check_request(ids, params)
        self.detokenizer.check(params)
        if matcher is COMPILE:
            matcher = self.structured.matcher(params)   # ValueError for a bad grammar
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self.abort)
        self._send(AddRequest(request_id=request_id, prompt_token_ids=ids, params=params, stream=stream,
                              arrival=self._clock(), matcher=matcher))
        return stream

    def check_token_ids(self, ids: Sequence[int], what: str = "token ids") -> None:
        """Raise ValueError naming the token ids outside the model's vocabulary."""
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def end_all(self, reason: str) -> None:
        """End every request with finish_reason "error" and `reason` before the next step (shutdown)."""
        self._send(EndAll(reason), always=True)

    def abort(self, request_id: str) -> None:
        """Abort a request (client disconnect); its blocks are freed before the next step."""
        self._send(Abort(request_id), always=True)

    def _send(self, msg: EngineMessage, *, always: bool = False) -> None:
        """Queue a message for the loop thread. Checked under the lock stop() takes, so nothing is
        queued after the loop's last look at the inbox (aborts and end_all are then no-ops)."""
        with self._cv:
            if self._stopping:
                if always:
                    return
                raise EngineError("the engine is stopped; it accepts no new requests")
            self._inbox.append(msg)
            self._cv.notify()

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile every shape the runner can be asked for (before /ready); returns compiles done."""
        n = self.runner.warmup(progress)
        if self.scheduler.proposer is not None:   # a draft model's shapes
            n += self.scheduler.proposer.warmup(progress)
        problem = self.structured.prepare()   # the grammar tokenizer (~0.5 s), not on the first structured request
        if problem:
            log.warning("%s; other requests are served", problem)
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
        """Stop the loop; every request queued or running ends with finish_reason "error"
        ("the engine stopped") and its blocks are freed. An engine driven by hand ends them here."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:
            self._shutdown()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._has_work() and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                self.run_once()
        except Exception:  # noqa: BLE001 (a bug in the loop itself: say so, and end every stream below)
            log.error("the engine loop failed:\n%s", traceback.format_exc())
            with self._cv:
                self._stopping = True
        finally:
            self._shutdown()

    def run_once(self) -> None:
        """Handle the inbox, then run one step if there is work (the loop body; drive it by hand
        only when the loop thread is not started)."""
        with self._cv:
            messages = list(self._inbox)
            self._inbox.clear()
        for msg in messages:
            self._handle(msg)
        if self._has_work():
            t0, self._device_seconds = time.perf_counter(), None
            try:
                outputs = self.step()
                self._steps += 1
            except Exception as e:  # noqa: BLE001 (the loop must survive a failing step)
                log.error("engine step failed; failing all in-flight requests:\n%s", traceback.format_exc())
                self._in_flight = None
                outputs = self.scheduler.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._emit(outputs)
            if self._device_seconds:   # a serial step that ran the model: the rest of its time is the host's
                host = time.perf_counter() - t0 - self._device_seconds
                self._observe_step(self._device_seconds, host, self._step_chunks)
            if not self.scheduler.num_running and self.scheduler.num_waiting:
                time.sleep(0.001)  # nothing could be admitted; don't spin (cannot persist: a lone request fits)
        with self._snapshot_lock:
            self._snapshot = self._take_snapshot()

    def _handle(self, msg: EngineMessage) -> None:
        match msg:
            case AddRequest():
                self._admit(msg)
            case Abort(request_id):
                self._emit([out] if (out := self.scheduler.abort(request_id)) is not None else [])
            case EndAll(reason):
                self._emit(self.scheduler.fail_all(reason))

    def _admit(self, msg: AddRequest) -> None:
        try:
            self.scheduler.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except ValueError as e:
            msg.refuse(str(e))
            return
        text = self.detokenizer.start(msg.prompt_token_ids, msg.params, self.scheduler.stop_token_ids(msg.params))
        self._live[msg.request_id] = _Live(msg.stream, msg.arrival, text, msg.matcher)

    def _matcher_of(self, request_id: str) -> "Matcher | None":
        live = self._live.get(request_id)
        return live.matcher if live is not None else None

    def _emit(self, outputs: Sequence[RequestOutput]) -> None:
        """Each output: its grammar advanced and its text (a complete grammar or a stop string may
        finish it here), the metrics, its stream; a finished one is released."""
        now = self._clock()
        delivered: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if live.matcher is not None:
                out = self.structured.accept(live.matcher, out)
            if live.text is not None:
                out = self.detokenizer.process(live.text, out)
            if out.new_token_ids:
                if live.last_token_time is None:
                    self._ttft.observe(now - live.arrival)
                else:
                    self._itl.observe(now - live.last_token_time)
                live.last_token_time = now
            if out.finished:
                self._release(out)
                if out.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
                    self._e2e.observe(now - live.arrival)
            delivered.append((live.stream, out))
        put_all(delivered)

    def _release(self, out: RequestOutput) -> None:
        """The one end of a request's life: the scheduler forgets it and frees its blocks (a no-op when
        its own token rules ended it), and its live entry, text state included, goes."""
        self.scheduler.finish(out.request_id, out.finish_reason)
        del self._live[out.request_id]
        self._finished[out.finish_reason.value] += 1

    def _shutdown(self) -> None:
        """End every request the loop will not run: queued ones before they start, admitted ones
        through the scheduler (blocks freed); both with finish_reason "error"."""
        with self._cv:
            messages = list(self._inbox)
            self._inbox.clear()
        for msg in messages:
            if isinstance(msg, AddRequest):
                msg.refuse(STOPPED)
        self._in_flight = None
        self._emit(self.scheduler.fail_all(STOPPED))
        with self._snapshot_lock:
            self._snapshot = self._take_snapshot()

    def _take_snapshot(self) -> MetricsSnapshot:
        s, b = self.scheduler.stats, self.scheduler.blocks
        return MetricsSnapshot(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting, kv_usage=b.usage,
            kv_free_blocks=b.num_free_blocks, kv_total_blocks=b.total_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
            finished=dict(self._finished), steps=self._steps, ttft=self._ttft.copy(), itl=self._itl.copy(),
            e2e=self._e2e.copy(), runner=dict(self.runner.stats()), device_memory=self._device_memory,
            step_host=self._step_host.copy(), step_device=self._step_device.copy(),
            step_seconds=dict(self._step_seconds),
            spec=s.spec.copy() if s.spec is not None else None,
            prefix_cache_hits_by_tier=dict(s.prefix_cache_hits_by_tier))
