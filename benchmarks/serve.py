"""Serving benchmark, vLLM-style: hloserve's server vs transformers eager and llama-cpp-python's server.

    python benchmarks/serve.py [--concurrency 1,4,16,32] [--output-len 48] [--skip-llamacpp]
                               [--llamacpp-python /tmp/llamacpp-venv/bin/python] [--write-docs]

One fixed random prompt set (seeded: random vocabulary tokens decoded to text, mixed lengths),
the same requests for every system, greedy, every request generating exactly --output-len tokens
(EOS ignored). For each max concurrency c, c clients send the level's requests back to back over
HTTP streaming (SSE) and measure, per request: TTFT (time to the first token), ITL (time between
consecutive streamed tokens), TPOT ((e2e - TTFT) / (tokens - 1)) and e2e latency; per level: output
tokens/s over the level's wall time. Systems, run one at a time on the same SmolLM2-135M-Instruct:

  * hloserve: `hloserve serve` on the default artifact (the preset's GGUF Q4_1 dequantized; weight
    matrices and KV cache in bf16, activations f32: `--weight-dtype bfloat16 --kv-cache-dtype
    bfloat16`), default settings;
  * transformers eager `generate` (f32, the same dequantized weights), the same requests in static
    batches of up to c, left-padded; a batch starts when the previous one ends, so a request's
    latencies count from its batch's start (queueing before it is not counted), and ITL is the time
    between decode steps of the batch;
  * llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on the same Q4_1 GGUF, installed
    in a separate venv (benchmark only, never a dependency): `python -m venv /tmp/llamacpp-venv &&
    /tmp/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'` (builds llama.cpp, ~10 minutes).
    EOS is suppressed with logit_bias.

`--write-docs` replaces the "## Serving" section of docs/performance.md and writes docs/serving.png.
The total runtime is bounded by the request counts per level (--requests, default 4,8,32,32).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

import httpx

from hloserve.server.launch import free_port, server_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2"
EOS_IDS = (0, 2)        # SmolLM2: <|endoftext|>, <|im_end|>


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int
    output_len: int


@dataclasses.dataclass
class Result:
    ttft: float
    e2e: float
    itls: list[float]
    tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


@dataclasses.dataclass
class Level:
    system: str
    concurrency: int
    results: list[Result]
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results) / self.seconds

    def summary(self) -> dict:
        def pct(xs, q):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1000 if xs else float("nan")
        itl = [x for r in self.results for x in r.itls]
        out = {"system": self.system, "concurrency": self.concurrency, "requests": len(self.results),
               "output_tok_s": self.output_tokens_per_s, "seconds": self.seconds}
        for name, xs in (("ttft", [r.ttft for r in self.results]), ("tpot", [r.tpot for r in self.results]),
                         ("itl", itl), ("e2e", [r.e2e for r in self.results])):
            out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = pct(xs, 50), pct(xs, 99)
        return out


# -- the prompt set ------------------------------------------------------------------------------
def make_requests(tokenizer, n: int, output_len: int, *, min_len: int, max_len: int, seed: int = 0) -> list[Request]:
    """n prompts of random vocabulary tokens (mixed lengths in [min_len, max_len]), decoded to text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        text = tokenizer.decode([rng.randrange(1000, 40000) for _ in range(length)])
        out.append(Request(text, len(tokenizer.encode(text)), output_len))
    return out


# -- HTTP clients ----------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, req: Request, extra: dict) -> Result:
    body = {"model": MODEL, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0, "stream": True,
            **extra}
    t0 = time.perf_counter()
    times, reason = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not choices:
                continue
            if choices[0].get("text"):
                times.append(time.perf_counter())
            reason = choices[0].get("finish_reason") or reason
    end = time.perf_counter()
    tokens = req.output_len if reason == "length" else len(times)
    ttft = (times[0] if times else end) - t0
    return Result(ttft, end - t0, [b - a for a, b in zip(times, times[1:])], tokens)


async def run_level_http(base: str, requests: list[Request], concurrency: int, extra: dict) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def one(req):
            async with sem:
                return await stream_one(client, req, extra)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - t0


@contextlib.contextmanager
def server_at(cmd: list[str], port: int, ready_path: str, log_path: str, env: dict | None = None):
    """The server of `cmd` on 127.0.0.1:port, once GET ready_path answers 200; yields its base URL."""
    base = f"http://127.0.0.1:{port}"
    with server_process(cmd, base + ready_path, log_path, timeout=1800, env=env, poll=1.0, grace=30,
                        on_ready=lambda s: print(f"  ready after {s:.0f} s", flush=True)):
        yield base


def bench_server(name: str, base: str, sets: dict[int, list[Request]], warm: Request, extra: dict) -> list[Level]:
    levels = []
    asyncio.run(run_level_http(base, [warm], 1, extra))     # one untimed request
    for c, reqs in sets.items():
        results, secs = asyncio.run(run_level_http(base, reqs, c, extra))
        levels.append(Level(name, c, results, secs))
        print(f"  {name:13s} c={c:2d}: {levels[-1].output_tokens_per_s:6.1f} output tok/s "
              f"(TTFT p50 {levels[-1].summary()['ttft_p50_ms']:.0f} ms, TPOT p50 "
              f"{levels[-1].summary()['tpot_p50_ms']:.0f} ms) in {secs:.0f} s", flush=True)
    return levels


# -- transformers eager, static batches -----------------------------------------------------------
def bench_transformers(gguf: str, tokenizer_json: str, sets: dict[int, list[Request]], warm: Request) -> list[Level]:
    import torch
    import transformers

    from hloserve.exporter.models.gguf import load_gguf
    from hloserve.exporter.progress import QUIET

    ckpt = load_gguf(gguf)
    cfg = transformers.LlamaConfig(**{k: v for k, v in ckpt.config.items() if k not in ("architectures", "model_type")})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(ckpt.materialize(reporter=QUIET), strict=False)
    hf.tie_weights()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
    tok.pad_token_id, tok.padding_side = 0, "left"

    class Clock(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run_batch(batch: list[Request]) -> list[Result]:
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        n = batch[0].output_len
        clock = Clock()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                        pad_token_id=0, eos_token_id=None)
        end = time.perf_counter()
        steps = clock.times[1:]          # the first put() is the prompt; then one per generated token
        ttft = steps[0] - t0
        itls = [b - a for a, b in zip(steps, steps[1:])]
        return [Result(ttft, end - t0, itls, n) for _ in batch]

    run_batch([warm])      # untimed
    levels = []
    for c, reqs in sets.items():
        t0 = time.perf_counter()
        results = []
        for i in range(0, len(reqs), c):
            results += run_batch(reqs[i:i + c])
        levels.append(Level("transformers", c, results, time.perf_counter() - t0))
        s = levels[-1].summary()
        print(f"  {'transformers':13s} c={c:2d}: {s['output_tok_s']:6.1f} output tok/s (TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
              f"TPOT p50 {s['tpot_p50_ms']:.0f} ms) in {s['seconds']:.0f} s", flush=True)
    return levels


# -- report ----------------------------------------------------------------------------------------
def table(summaries: list[dict]) -> str:
    rows = ["| system | max concurrency | requests | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
            "ITL p50 / p99 (ms) | e2e p50 / p99 (s) |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        rows.append(f"| {s['system']} | {s['concurrency']} | {s['requests']} | {s['output_tok_s']:.1f} | "
                    f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.0f} / {s['tpot_p99_ms']:.0f} | "
                    f"{s['itl_p50_ms']:.0f} / {s['itl_p99_ms']:.0f} | {s['e2e_p50_ms'] / 1000:.1f} / "
                    f"{s['e2e_p99_ms'] / 1000:.1f} |")
    return "\n".join(rows)


def ratios(summaries: list[dict]) -> list[str]:
    by = {(s["system"], s["concurrency"]): s for s in summaries}
    lines = []
    for c in sorted({s["concurrency"] for s in summaries}):
        ours = by.get(("hloserve", c))
        if not ours:
            continue
        for other in ("transformers", "llama-cpp-python"):
            o = by.get((other, c))
            if o:
                lines.append(f"c={c}: hloserve / {other} output tok/s = {ours['output_tok_s'] / o['output_tok_s']:.2f}x "
                             f"({ours['output_tok_s']:.1f} vs {o['output_tok_s']:.1f}); TPOT p50 "
                             f"{ours['tpot_p50_ms']:.0f} vs {o['tpot_p50_ms']:.0f} ms")
    return lines


def targets(summaries: list[dict]) -> list[str]:
    """The issue's targets, each with its measured ratio and whether it was met."""
    by = {(s["system"], s["concurrency"]): s for s in summaries}
    out = []

    def check(label, num, den, goal, key, higher_is_better=True):
        if num and den:
            r = num[key] / den[key] if higher_is_better else den[key] / num[key]
            out.append(f"{label}: {r:.2f}x (target >= {goal}x): {'met' if r >= goal else 'NOT met'}")
    ours16 = by.get(("hloserve", 16))
    check("c=16 output tok/s vs llama-cpp-python's server", ours16, by.get(("llama-cpp-python", 16)), 3,
          "output_tok_s")
    check("c=16 output tok/s vs transformers static batches", ours16, by.get(("transformers", 16)), 1.5,
          "output_tok_s")
    check("batch-1 decode speed (1 / TPOT p50) vs transformers eager f32", by.get(("hloserve", 1)),
          by.get(("transformers", 1)), 2, "tpot_p50_ms", higher_is_better=False)
    return out


def plot(summaries: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(s["system"] for s in summaries):
        xs = [s for s in summaries if s["system"] == system]
        a.plot([s["concurrency"] for s in xs], [s["output_tok_s"] for s in xs], "o-", label=system)
        b.plot([s["concurrency"] for s in xs], [s["tpot_p50_ms"] for s in xs], "o-", label=system)
    for ax, ylabel in ((a, "output tokens/s"), (b, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_docs(section: str) -> None:
    path = os.path.join(ROOT, "docs", "performance.md")
    text = open(path).read()
    start = text.find("\n## Serving\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + 1)
        text = text[:start + 1] + section + (text[nxt:] if nxt >= 0 else "")
    open(path, "w").write(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests", default="4,8,32,32", help="requests per concurrency level")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--min-input", type=int, default=16)
    p.add_argument("--max-input", type=int, default=384)
    p.add_argument("--artifact", help="hloserve artifact (default: the smollm2-135m-instruct preset's, exported once)")
    p.add_argument("--serve-args", default="", help="extra `hloserve serve` flags")
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--llamacpp-threads", type=int, default=1,
                   help="llama.cpp threads (1 was its fastest here: 134 vs 89 tok/s with 2 at load 1; 55 vs 18 at load 8)")
    p.add_argument("--skip", default="", help="systems to skip: hloserve,transformers,llama-cpp-python")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()

    from hloserve.exporter import artifact, presets
    from hloserve.server.serve import default_artifact
    from hloserve.server.tokenizer import Tokenizer

    conc = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    gguf = presets.resolve("smollm2-135m-instruct")
    art = args.artifact or default_artifact()
    tok = Tokenizer.from_artifact(art, artifact.read_manifest(art).model)
    # disjoint prompts per level (and one more for the untimed first request): no level gets
    # prefix-cache hits from an earlier one
    pool = make_requests(tok, sum(counts) + 1, args.output_len, min_len=args.min_input, max_len=args.max_input)
    warm, sets, i = pool[0], {}, 1
    for c, n in zip(conc, counts):
        sets[c], i = pool[i:i + n], i + n
    print(f"prompt set: {len(pool)} prompts (1 untimed), {min(r.prompt_tokens for r in pool)}..{max(r.prompt_tokens for r in pool)} "
          f"tokens (mean {statistics.mean(r.prompt_tokens for r in pool):.0f}), {args.output_len} output tokens each; "
          f"levels {sets and {c: len(r) for c, r in sets.items()}}", flush=True)
    logs = os.path.join("/tmp", f"hloserve-bench-{os.getpid()}")
    os.makedirs(logs, exist_ok=True)
    levels: list[Level] = []
    t_start = time.time()

    if "hloserve" not in skip:
        print("hloserve: starting `hloserve serve` (warm-up compiles every bucket)", flush=True)
        port = free_port()
        cmd = [sys.executable, "-m", "hloserve.exporter.cli", "serve", art, "--port", str(port), "--model-name", MODEL,
               *args.serve_args.split()]
        with server_at(cmd, port, "/ready", os.path.join(logs, "hloserve.log")) as base:
            levels += bench_server("hloserve", base, sets, warm, {"ignore_eos": True})
            metrics = httpx.get(base + "/metrics").text
            rec = [ln for ln in metrics.splitlines() if ln.startswith("hloserve:recompiles_after_warmup_total")]
            print(f"  {rec[0] if rec else 'no recompile metric'}", flush=True)

    if "llama-cpp-python" not in skip:
        if not os.path.exists(args.llamacpp_python):
            print(f"llama-cpp-python: skipped ({args.llamacpp_python} not found; see the module docstring)", flush=True)
        else:
            print("llama-cpp-python: starting its OpenAI server on the same GGUF", flush=True)
            port = free_port()
            cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
                   "--port", str(port), "--n_ctx", "2048", "--n_threads", str(args.llamacpp_threads),
                   "--interrupt_requests", "False"]   # else a new request cuts off the one streaming
            env = {"OMP_WAIT_POLICY": "PASSIVE"}   # spinning OpenMP threads crawl on a shared machine
            with server_at(cmd, port, "/v1/models", os.path.join(logs, "llamacpp.log"), env=env) as base:
                levels += bench_server("llama-cpp-python", base, sets, warm,
                                       {"logit_bias": {str(t): -100 for t in EOS_IDS}})

    if "transformers" not in skip:
        print("transformers: eager generate, static left-padded batches of up to c", flush=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads its OpenMP (see llama.cpp above)
        levels += bench_transformers(gguf, os.path.join(art, "tokenizer.json"), sets, warm)

    summaries = [lv.summary() for lv in levels]
    print("\n" + table(summaries) + "\n")
    for line in ratios(summaries) + targets(summaries):
        print(line)
    print(f"\ntotal {time.time() - t_start:.0f} s")
    json_path = os.path.join(logs, "results.json")
    json.dump(summaries, open(json_path, "w"), indent=1)
    print(f"results: {json_path}")

    if args.write_docs:
        import jax
        import torch
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"load average {os.getloadavg()[0]:.1f} at the end")
        date = datetime.date.today().isoformat()
        title = f"SmolLM2-135M-Instruct, {args.output_len} output tokens/request, {machine}, {date}"
        plot(summaries, os.path.join(ROOT, "docs", "serving.png"), title)
        section = SECTION.format(
            date=date, machine=machine, jax=jax.__version__, torch=torch.__version__,
            cmd=" ".join(["python", "benchmarks/serve.py", *sys.argv[1:]]), n=len(pool),
            lo=min(r.prompt_tokens for r in pool), hi=max(r.prompt_tokens for r in pool),
            mean=statistics.mean(r.prompt_tokens for r in pool), out=args.output_len,
            levels=", ".join(f"{len(r)} at c={c}" for c, r in sets.items()),
            notes=NOTES_TEXT, table=table(summaries), ratios="\n".join(f"- {x}" for x in ratios(summaries)),
            targets="\n".join(f"- {x}" for x in targets(summaries)))
        write_docs(section)
        print("wrote docs/performance.md (Serving) and docs/serving.png")
    return 0


SECTION = """## Serving

`{cmd}` (`benchmarks/serve.py`). Machine: {machine}; shared with other jobs, so absolute
numbers are pessimistic and vary run to run. Date: {date}. jax {jax}, torch {torch}.

Workload: {n} fixed random prompts ({lo}..{hi} tokens, mean {mean:.0f}), {out} greedy output tokens
each (EOS ignored), streamed over HTTP (SSE) by c concurrent clients; requests per level: {levels}.
Same SmolLM2-135M-Instruct weights everywhere: transformers runs the GGUF's Q4_1 weights dequantized
to f32; hloserve serves its default artifact of them (weight matrices and K/V stored in bf16,
matmuls on bf16-rounded activations with f32 sums, everything else f32; perplexity 13.512 against
f32's 13.514, see below); llama-cpp-python's server runs the Q4_1 GGUF itself. transformers eager
`generate` gets the same requests in static left-padded batches of up to c (latencies count from
the batch's start).

{table}

{ratios}

Targets of the serving issue:

{targets}

![serving throughput and TPOT](serving.png)
{notes}"""


NOTES_TEXT = """
### Serving defaults and warm-up

`hloserve serve` defaults (server/services.py `ServeConfig`): 16 sequences and 256 tokens a step,
context 2048 (the artifact allows 8192; `--max-model-len` raises it), 1 GiB of KV cache (2912 blocks
of 16 tokens for SmolLM2 with its bf16 cache, 46k tokens). Buckets: decode S 1, 2, 4, 8, 16; prefill T 32, 128, 256 and
S 1, 2, 4, 8, 16; block-table widths 8, 16, 32, 64, 128 blocks: 100 executables, each compiled and
run once before /ready. Measured on this machine (2026-11-22, load ~1): warm-up 74 s with an empty
XLA cache, 29 s on later starts (persistent compilation cache). The first `hloserve serve` with no
artifact also exports the preset into `~/.cache/hloserve/artifacts` (about 10 s).

### Where the time goes

Load on this shared machine swings within minutes, and step times are bimodal on it (the same
decode call measures ~36 or ~64 ms from one process to the next), so every number here moves run
to run; ratios come from systems measured in the same run. llama.cpp runs with 1 thread and passive
OpenMP waits, its fastest setting here (a bare generate loop: 134 tok/s with 1 thread, 89 with 2 at
load 1); transformers gets passive waits too.

The serving path is not the bottleneck: in process (`benchmarks/engine_level.py`, the c=16 level
driven by hand) the step calls take 98-99% of the level's wall time. Per call shape at c=16 (one
run, mean ms, current defaults): decode S=16, B=32: 96 calls, 43 ms; prefill T=256: S=1, B=16 99 ms;
S=1, B=32 115 ms; S=2, B=32 165 ms; S=4, B=32 257 ms. Decode is ~45% of the level, prefill ~55%.

Repeat c=16 runs right after the full run (hloserve and llama-cpp-python only, same build,
2026-11-22): 3.70x (184.1 vs 49.7 tok/s) and 3.74x (188.0 vs 50.3). The build before the bf16 KV
cache measured 2.96x (173.2 vs 58.6) in its full run, and 3.39x (186.2 vs 54.9) in a c=16-only run:
with this machine's noise the target is met by a margin of 5-25%, not more.

What moved c=16 from 96 to ~180 output tok/s this session, each measured in process:

* bf16 weight matrices (`--weight-dtype bfloat16`, the default artifact). This CPU (AMD EPYC,
  avx512_bf16) runs XLA:CPU's bf16 dots at ~1.7x the f32 rate (a 512x576 @ 576x1536 product: 837
  vs 491 GFLOPS) and reads half the weight bytes. Getting there took three fixes, each found in the
  optimized HLO: (1) a bf16 stack sliced inside the layer loop made XLA widen the whole stack to
  f32 before the loop on every call, and a bitcast of a bf16 parameter to integers is a full copy,
  so the stacked matrices are stored as int16 bits and each layer's slice is viewed as bf16;
  (2) a transposed bf16 operand (torch's linear is `x @ W.T`) is widened too, so
  `hloserve::mixed_linear` contracts the weight's dim 1 in place; (3) a one-row product is
  rewritten into an f32 vector product on a widened weight (13x slower for the LM head), so one
  row is padded to two. Also 16-bit dots no longer ask for HIGHEST precision (which widened them).
  Step times (quiet mode): decode S=16, B=32 55 -> 31 ms; prefill T=128, S=4, B=32 153 -> 109 ms;
  the c=16 level in process 113 -> 161 tok/s. Perplexity on tests/data's 13,515 tokens: 13.509
  against f32's 13.514.
* Buckets: prefill S in powers of two (S=2 ran padded to 4) and block-table widths 2x apart (a
  205-token prompt pays attention for 16 blocks, not 32): each padded sequence or block costs the
  flat prefill attention a whole T x context product (prefill T=128, S=2: B=16 86 ms, B=32 109 ms).
* A bf16 KV cache (`--kv-cache-dtype bfloat16`), stored as int16 bits for the same reason as the
  weights and widened to f32 inside the gather: decode's K/V gathers read half the bytes (K and V
  gathers at S=16, B=32: 7.3 + 4.3 -> ~3.5 + <2 ms; the decode step 29.6 -> 27.7 ms at best), and
  the same memory holds twice the blocks. Attention itself stays f32. Perplexity 13.512.
* 256 tokens a step instead of 128: with cheaper matmuls each step's fixed costs (the weights read
  twice, decode and prefill calls) weigh more; fewer, fuller prefill chunks. c=16 in process, two
  interleaved runs each: 195 / 173 tok/s against 154 / 155. 512 tokens: 170 (flat attention over 4
  sequences of 512-token chunks grows faster than the saving).

Tried and dropped: attention's two products in bf16 too (over the f32 cache, and over the bf16
cache with an einsum-shaped op): XLA:CPU widened the batched bf16 dots back to f32 (a transposed or
non-canonical 16-bit operand), decode 30 -> 52 ms and 40 vs 40 ms; no gain.
Serving the GGUF's own Q4_1/Q8_0 blocks (`--quantize gguf`), measured in the f32 era: faster at c=1
(TPOT 13 vs 19 ms) but slower at c=16 (71 vs 96 tok/s), dequantization being extra work once the
matmuls are compute-bound.

What is left, in order of size: decode reads every sequence's context padded to the batch's
widest bucket (the K/V gathers and attention dots are ~12 of a ~28 ms step at B=32); prefill's flat attention
scores every token against all S contexts of the step; XLA:CPU copies each layer's weight slice
out of the stack before its dot (~6 ms a step). A step mixing decodes and prefill chunks runs as
two calls (decode rows through `decode`, chunks through `prefill`), since the flat prefill
attention costs T x S x context.
"""


if __name__ == "__main__":
    sys.exit(main())
