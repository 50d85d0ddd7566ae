"""What the HTTP app serves: an LLM engine (OpenAI API) or a predict model (TF Serving API).

Both are built from an artifact by `build_service` and own their device work:
the LLM engine's loop thread, or the predict batcher's single worker. Both
start "not ready" and become ready after warm-up has compiled every bucket.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np
from hloserve import runtime
from hloserve.runtime.artifact import LLMArtifact, read_manifest
from hloserve.runtime.artifact.errors import HloserveError

from .config import ServeConfig
from .core.metrics import Exposition, engine_families, runner_families
from .embeddings import Embedder
from .wiring import build_engine

if TYPE_CHECKING:
    from hloserve.runtime.model import LoadedModel

    from .core.adapters import AdapterRef
    from .core.engine import Engine
    from .core.model_runner import ModelRunner
    from .text.tokenizer import Tokenizer

log = logging.getLogger("hloserve.server")
IN_FLIGHT_HELP = "Requests admitted and not yet answered (max_pending bounds it)."


class Readiness:
    """Ready once warm-up ends; `error` holds why warm-up failed, if it did."""

    def __init__(self):
        self._event = threading.Event()
        self.error: str | None = None
        self.progress = "starting"
        self.draining = False      # shutting down: /ready says 503 and new requests are refused

    def set(self) -> None:
        self._event.set()

    @property
    def ready(self) -> bool:
        return self._event.is_set() and self.error is None and not self.draining

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def run(self, warmup: Callable[[], None]) -> None:
        """Run a service's warm-up, record why it failed (if it did), then report done."""
        try:
            warmup()
        except Exception as e:  # noqa: BLE001 - reported on /ready and in the log
            self.error = f"warm-up failed: {type(e).__name__}: {e}"
            log.exception("warm-up failed")
        self.set()


class Admission:
    """Counts requests in flight; refuses past `limit` (the server answers 429)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._n = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self._n >= self.limit:
                return False
            self._n += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._n -= 1

    @property
    def in_flight(self) -> int:
        return self._n


@dataclasses.dataclass
class LLMService:
    engine: "Engine"
    tokenizer: "Tokenizer"
    runner: "ModelRunner"
    model_names: tuple[str, ...]        # served names; the first is reported
    max_model_len: int
    readiness: Readiness
    admission: Admission
    # sampling where a request is silent (request field names; ServeConfig.generation_defaults)
    generation_defaults: dict = dataclasses.field(default_factory=dict)
    max_output_tokens: int | None = None   # the operator's cap per request (ServeConfig)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    kind: str = "llm"

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters loaded now (each a name a request may give as `model`)."""
        table = self.runner.adapters
        return tuple(table.names()) if table is not None else ()

    def adapter_ref(self, model: str | None) -> "AdapterRef | None":
        """The adapter a request's `model` names (None: the base model, a served name)."""
        table = self.runner.adapters
        adapter = table.get(model) if table is not None and model not in self.model_names else None
        return adapter.ref if adapter is not None else None

    def warmup(self, report: Callable[[str], None] | None = None) -> None:
        """Compile every serving shape, then start the engine loop and report ready.

        Each progress line goes to /ready's detail and to `report` (e.g. the console).
        """
        def progress(msg: str) -> None:
            self.readiness.progress = msg
            if report is not None:
                report(msg)

        def warm() -> None:
            t0 = time.perf_counter()
            n = self.engine.warmup(progress)
            log.info("warm-up compiled %d executables in %.1f s; ready", n, time.perf_counter() - t0)
            self.engine.start()

        self.readiness.run(warm)

    def close(self) -> None:
        self.engine.stop()
        self.runner.close()   # a multi-host run's followers are released

    def end_all(self, reason: str) -> None:
        """End every running and waiting request now, with an error saying why (graceful shutdown's deadline)."""
        self.engine.end_all(reason)

    def metrics_text(self) -> str:
        exp = Exposition(self.model_name)
        engine_families(exp, self.engine.metrics())
        exp.gauge("hloserve:requests_in_flight", IN_FLIGHT_HELP, self.admission.in_flight)
        return exp.text()


class PredictBatcher:
    """Batches concurrent predict calls of one function along their shared leading dim.

    Requests wait at most `timeout_s` for company, up to `max_batch_size` rows;
    requests with different non-batch shapes run in separate batches. One worker
    thread owns the device, as the LLM engine loop does.
    """

    def __init__(self, model: "LoadedModel", max_batch_size: int, timeout_s: float):
        self.model = model
        self.max_batch_size = max_batch_size
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hloserve-predict")
        self.batches = 0
        self.batched_requests = 0

    def batch_dim(self, function: str) -> str | None:
        """The symbol every input shares as dim 0, if the function is batchable."""
        spec = self.model.functions[function].spec
        firsts = {t.shape[0] if t.shape else None for t in spec.inputs}
        (first,) = firsts if len(firsts) == 1 else (None,)
        return first if isinstance(first, str) and first.isidentifier() else None

    async def run(self, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._collect())
        if self.batch_dim(function) is None:
            return await loop.run_in_executor(self._pool, self._call, function, dict(inputs))
        fut = loop.create_future()
        await self._queue.put((function, dict(inputs), fut))
        return await fut

    def _call(self, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.model.functions[function](**inputs)
        return {k: np.asarray(v) for k, v in out.items()}

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            batch = [first]
            rows = len(next(iter(first[1].values())))
            deadline = loop.time() + self.timeout_s
            while rows < self.max_batch_size:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), left)
                except asyncio.TimeoutError:
                    break
                batch.append(item)
                rows += len(next(iter(item[1].values())))
            for group in self._groups(batch):
                loop.create_task(self._run_group(group))

    @staticmethod
    def _groups(batch: list) -> list[list]:
        groups: dict[tuple, list] = {}
        for item in batch:
            fn, inputs, _ = item
            key = (fn, tuple((k, v.shape[1:], str(v.dtype)) for k, v in sorted(inputs.items())))
            groups.setdefault(key, []).append(item)
        return list(groups.values())

    async def _run_group(self, group: list) -> None:
        loop = asyncio.get_running_loop()
        fn = group[0][0]
        sizes = [len(next(iter(inputs.values()))) for _, inputs, _ in group]
        merged = {k: np.concatenate([inputs[k] for _, inputs, _ in group]) for k in group[0][1]}
        try:
            out = await loop.run_in_executor(self._pool, self._call, fn, merged)
        except Exception as e:  # noqa: BLE001 - handed to each waiting request
            for _, _, fut in group:
                if not fut.done():
                    fut.set_exception(e)
            return
        self.batches += 1
        self.batched_requests += len(group)
        start = 0
        for (_, _, fut), n in zip(group, sizes):
            if not fut.done():
                fut.set_result({k: v[start:start + n] for k, v in out.items()})
            start += n

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclasses.dataclass
class PredictService:
    model: "LoadedModel"
    model_name: str
    batcher: PredictBatcher
    readiness: Readiness
    admission: Admission
    version: int = 1
    kind: str = "predict"
    embedder: "Embedder | None" = None   # /v1/embeddings, for sentence-transformers encoders

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name,)

    def warmup(self) -> None:
        """Compile every bucket when all symbolic dims are paddable (bucketed).

        A dim that is not paddable (e.g. a sequence length without a mask) compiles
        per exact size on first use instead: its sizes are the clients' to choose.
        """
        def warm() -> None:
            fixed = {d for fn in self.model.functions.values() for t in fn.spec.inputs for d in t.shape
                     if isinstance(d, str) and d.isidentifier() and d not in fn.spec.paddable}
            if not fixed:
                self.model.warmup(progress=lambda m: setattr(self.readiness, "progress", m))

        self.readiness.run(warm)

    def close(self) -> None:
        self.batcher.close()

    def metrics_text(self) -> str:
        exp = Exposition(self.model_name)
        exp.counter("hloserve:predict_batches_total", "Batches the predict batcher ran.", self.batcher.batches)
        exp.counter("hloserve:predict_requests_total", "Predict requests answered through the batcher.",
                    self.batcher.batched_requests)
        stats = self.model.stats().values()
        runner_families(exp, {"compiles_total": sum(s.compiles for s in stats),
                              "compiles_after_warmup_total": sum(s.compiles_after_warmup for s in stats)})
        exp.gauge("hloserve:requests_in_flight", IN_FLIGHT_HELP, self.admission.in_flight)
        return exp.text()


def build_service(artifact_path: str, config: ServeConfig) -> LLMService | PredictService:
    """Load the artifact and build the service that fits it (LLM or predict). Does not warm up.

    manifest.json is read here, once; an LLM artifact's contract is typed once (LLMArtifact) and
    handed down through server/wiring.py."""
    manifest = read_manifest(artifact_path)
    names = config.served_model_names or (os.path.basename(os.path.normpath(artifact_path)),)
    readiness, admission = Readiness(), Admission(config.max_pending)
    if not manifest.is_llm:
        model = runtime.load(artifact_path, platform=config.platform, strict=False, verify=config.load_verify,
                             manifest=manifest)
        return PredictService(model, names[0], PredictBatcher(model, config.max_batch_size, config.batch_timeout_s),
                              readiness, admission, embedder=Embedder.from_artifact(artifact_path, manifest))
    art = LLMArtifact.read(artifact_path, manifest)   # a malformed contract fails here, before anything loads
    config.check_kv_cache(art.llm, artifact_path)
    defaults, where = config.generation_defaults(artifact_path)
    log.info("generation defaults: %s (%s); a request's own fields win",
             json.dumps(defaults) if defaults else "neutral, temperature 1 and top_p 1", where)
    try:
        engine, tokenizer = build_engine(art, config)
    except ValueError as e:
        raise HloserveError(str(e)) from None
    if tokenizer is None:
        raise HloserveError(f"artifact {artifact_path} ships no tokenizer; re-export it from a checkpoint with "
                            f"tokenizer.json to serve text")
    max_len = engine.scheduler.config.max_model_len
    return LLMService(engine, tokenizer, engine.runner, names, max_len, readiness, admission,
                      generation_defaults=defaults,
                      max_output_tokens=config.max_output_tokens)
