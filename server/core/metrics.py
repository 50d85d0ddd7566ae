"""Engine metrics and the one Prometheus exposition builder of the server.

`Exposition` writes the text format (one HELP and one TYPE line per family, refusing a family twice);
`engine_families` adds the engine's families, with vLLM's metric names where they exist. Both services
(server/services.py) build their /metrics text with it.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .spec_decode import SpecDecodeStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
# an engine step's parts: from a tenth of a millisecond (a small model's host work) to seconds (a long chunk)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
      device_memory: (device, "weights" | "kv_cache") -> bytes held there, if the runner has
        `device_memory()` (a tensor-parallel step holds 1/N of each split array per device).
      step_host / step_device: per engine step that ran the model, the seconds the host waited on the
        device (the step functions' calls until their logits were on the host) and the rest of the
        step (scheduling, building inputs, sampling, detokenizing, streaming: the engine's own work,
        which nothing overlaps with the device today).
      step_seconds: "chunk" | "decode" -> wall seconds of the steps that computed a prompt chunk (decodes
        beside it or not) and of those that ran decodes only (benchmarks/serve.py: the chunks' share).
      spec: speculative decoding's counters (drafts, drafted and accepted tokens, accepted per
        position), None when it is off.
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
    device_memory: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    step_host: Histogram = dataclasses.field(default_factory=lambda: Histogram(STEP_BUCKETS))
    step_device: Histogram = dataclasses.field(default_factory=lambda: Histogram(STEP_BUCKETS))
    step_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    spec: "SpecDecodeStats | None" = None


# What the runner's stats() keys mean (a key without an entry is exported with a generic help line).
RUNNER_HELP = {
    "compiles_total": "XLA compiles since start (warm-up included).",
    "compiles_after_warmup_total": "Compiles after warm-up (should stay 0: every serving shape is warmed).",
    "runner_steps_total": "Engine steps the runner executed.",
    "runner_step_seconds_total": "Seconds the runner spent executing steps.",
}


class Exposition:
    """Prometheus text exposition (format 0.0.4) for one model: every sample carries model_name."""

    def __init__(self, model_name: str):
        self._label = f'model_name="{model_name}"'
        self._lines: list[str] = []
        self._names: set[str] = set()

    def _family(self, name: str, kind: str, help_: str) -> None:
        if name in self._names:
            raise ValueError(f"metric family {name} exposed twice")
        self._names.add(name)
        self._lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]

    def _labels(self, extra: Mapping[str, str]) -> str:
        return ",".join([self._label] + [f'{k}="{v}"' for k, v in extra.items()])

    def _samples(self, name: str, value: float | Mapping[tuple[tuple[str, str], ...], float]) -> None:
        samples = value if isinstance(value, Mapping) else {(): value}
        for extra, v in samples.items():
            self._lines.append(f"{name}{{{self._labels(dict(extra))}}} {v}")

    def gauge(self, name: str, help_: str, value: float | Mapping[tuple[tuple[str, str], ...], float]) -> None:
        """A gauge; `value` is a number, or samples keyed by their extra labels ((("device", "0"),): v)."""
        self._family(name, "gauge", help_)
        self._samples(name, value)

    def counter(self, name: str, help_: str, value: float | Mapping[tuple[tuple[str, str], ...], float]) -> None:
        """A counter; `value` is a number, or samples keyed by their extra labels ((("reason", "stop"),): n)."""
        self._family(name, "counter", help_)
        self._samples(name, value)

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        self._family(name, "histogram", help_)
        for bound, cum in zip(list(h.buckets) + ["+Inf"], itertools.accumulate(h.counts)):
            self._lines.append(f"{name}_bucket{{{self._labels({'le': bound})}}} {cum}")
        self._lines += [f"{name}_sum{{{self._label}}} {h.sum}", f"{name}_count{{{self._label}}} {h.count}"]

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def engine_families(exp: Exposition, m: MetricsSnapshot) -> None:
    """The LLM engine's families: queues, KV cache, prefix cache, tokens, latencies, runner counters."""
    exp.gauge("vllm:num_requests_running", "Requests running on the device.", m.num_running)
    exp.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", m.num_waiting)
    exp.gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full): blocks held by requests; blocks kept "
              "only for prefix-cache reuse count as free.", m.kv_usage)
    exp.gauge("hloserve:kv_cache_used_blocks", "KV blocks held by requests (reference count > 0).",
              m.kv_total_blocks - m.kv_free_blocks)
    exp.gauge("hloserve:kv_cache_free_blocks", "KV blocks free to allocate (prefix-cached ones included).",
              m.kv_free_blocks)
    exp.gauge("hloserve:kv_cache_total_blocks", "Allocatable KV blocks (the null block excluded).", m.kv_total_blocks)
    exp.counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", m.prefix_cache_queries)
    exp.counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", m.prefix_cache_hits)
    exp.counter("vllm:num_preemptions_total", "Requests preempted (recomputed later).", m.num_preemptions)
    exp.counter("vllm:prompt_tokens_total", "Prompt tokens processed.", m.prompt_tokens)
    exp.counter("vllm:generation_tokens_total", "Tokens generated.", m.generation_tokens)
    exp.counter("vllm:request_success_total", "Finished requests by finish reason.",
                {(("finished_reason", reason),): n for reason, n in sorted(m.finished.items())})
    exp.histogram("vllm:time_to_first_token_seconds", "Time to first token.", m.ttft)
    exp.histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m.itl)
    exp.histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", m.e2e)
    exp.histogram("hloserve:step_host_seconds", "Per engine step, the engine's own work the device does not "
                  "overlap: scheduling, inputs, sampling, detokenizing, streaming.", m.step_host)
    exp.histogram("hloserve:step_device_seconds", "Per engine step, the time the host waited on the device: "
                  "the step functions' calls, input and output transfers included.", m.step_device)
    exp.counter("hloserve:step_seconds_total", "Engine steps' wall seconds by what they run: kind=\"chunk\", "
                "steps that compute a prompt chunk (or a preempted request's tokens again), decodes or not beside "
                "it; kind=\"decode\", steps of decodes only.",
                {(("kind", k),): v for k, v in sorted(m.step_seconds.items())})
    if m.spec is not None:
        spec_decode_families(exp, m.spec)
    runner_families(exp, m.runner)
    if m.device_memory:
        exp.gauge("hloserve:device_memory_bytes", "Bytes of weights and KV cache held on each device.",
                   {(("device", d), ("kind", k)): v for (d, k), v in sorted(m.device_memory.items())})


def spec_decode_families(exp: Exposition, spec: "SpecDecodeStats") -> None:
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py, whose prometheus_client
    Counters are exposed with `_total`). Acceptance rate: accepted / draft tokens; mean tokens per
    verifying step: 1 + accepted / drafts; per position: accepted_per_pos / drafts."""
    exp.counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", spec.num_drafts)
    exp.counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", spec.num_draft_tokens)
    exp.counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", spec.num_accepted_tokens)
    exp.counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.",
                {(("position", str(i)),): n for i, n in enumerate(spec.accepted_per_pos)})


def runner_families(exp: Exposition, stats: Mapping[str, float]) -> None:
    for k, v in sorted(stats.items()):
        help_ = RUNNER_HELP.get(k, f"Runner counter {k}.")
        (exp.counter if k.endswith("_total") else exp.gauge)(f"hloserve:{k}", help_, v)


def prometheus_text(m: MetricsSnapshot, *, model_name: str = "model") -> str:
    """The engine's families alone (the services add theirs through an Exposition)."""
    exp = Exposition(model_name)
    engine_families(exp, m)
    return exp.text()
