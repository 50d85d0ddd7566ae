"""Tensor parallelism on this machine: engine throughput at 1 and N devices, same model, same run.

    python benchmarks/tensor_parallel.py [--sizes 1,2] [--model gqa|smollm2] [--requests 32]

Each size runs in its own process (a CPU host split into N devices with jax_num_cpu_devices, so a
size-1 run keeps every core for its one device). The engine (scheduler, block manager, runner) gets
--requests prompts of 128 random tokens at once, 64 greedy output tokens each (ignore_eos), at most
16 sequences a step (one block-table width), after a warm-up that compiles every shape. Printed: output tokens/s, step time,
per-device weight and KV bytes, and the ratio to size 1.

  * gqa (default): SmolLM2-135M's shape but 8 query heads of 72 over 4 KV heads (random init, bf16
    weights and cache), so 2 and 4 divide the KV heads;
  * smollm2: the default artifact itself (3 KV heads: sizes 1 and 3).

On a 2-core CPU this measures the cost of the split (collectives, no attention kernel over a mesh),
not a speed-up: tensor parallelism pays where one device lacks the memory or the bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve import cpu_description  # noqa: E402

_RUN = r'''
import json, sys, time
import numpy as np
art, n, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from hloserve.runtime.client import host_devices
host_devices(n)
from hloserve.server.config import ServeConfig
from hloserve.server.wiring import build_engine
from hloserve.server.core.sampling import SamplingParams
eng, _ = build_engine(art, ServeConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256,
                                       block_buckets=1, tensor_parallel_size=n, platform="cpu"))
t0 = time.perf_counter()
eng.warmup(lambda m: print(f"  [tp {n}] {m}", file=sys.stderr, flush=True))
warm = time.perf_counter() - t0
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, 128).tolist() for _ in range(requests)]
with eng:
    t0 = time.perf_counter()
    streams = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts]
    out = sum(len(o.new_token_ids) for s in streams for o in s)
    secs = time.perf_counter() - t0
stats = eng.runner.stats()
mem = eng.runner.device_memory()
print("RESULT " + json.dumps({"tok_s": out / secs, "secs": secs, "warmup_s": warm,
      "step_ms": 1000 * stats["runner_step_seconds_total"] / max(1, stats["runner_steps_total"]),
      "weights_mib": max(v for (d, k), v in mem.items() if k == "weights") / 2**20,
      "kv_mib": max(v for (d, k), v in mem.items() if k == "kv_cache") / 2**20}))
'''


def gqa_artifact(root: str) -> str:
    import torch
    import transformers

    from hloserve.server.cli import main
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=72,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(root, "hf"))
    out = os.path.join(root, "art")
    print("exporting the 4-KV-head model ...", file=sys.stderr, flush=True)
    assert main(["export", os.path.join(root, "hf"), "-o", out, "-q", "--weight-dtype", "bfloat16",
                 "--kv-cache-dtype", "bfloat16"]) == 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=None, help="tensor-parallel sizes (default: 1,2 for gqa, 1,3 for smollm2)")
    ap.add_argument("--model", default="gqa", choices=["gqa", "smollm2"])
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,2" if args.model == "gqa" else "1,3")).split(",")]
    print(cpu_description())
    with tempfile.TemporaryDirectory() as root:
        if args.model == "gqa":
            art = gqa_artifact(root)
        else:
            from hloserve.server.serve import default_artifact
            art = default_artifact()
        results = {}
        for n in sizes:
            print(f"tensor-parallel {n}: warming up and running {args.requests} requests ...", file=sys.stderr,
                  flush=True)
            proc = subprocess.run([sys.executable, "-c", _RUN, art, str(n), str(args.requests)], text=True,
                                  stdout=subprocess.PIPE)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(f"tensor-parallel {n} failed (rc {proc.returncode})", file=sys.stderr)
                return 1
            results[n] = json.loads(line[len("RESULT "):])
    print(f"\n{args.model}: {args.requests} requests x 64 output tokens, 128-token prompts, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| tensor-parallel | output tok/s | step ms | weights MiB / device | KV MiB / device | vs 1 |")
    print("|---|---|---|---|---|---|")
    base = results[sizes[0]]["tok_s"]
    for n, r in results.items():
        print(f"| {n} | {r['tok_s']:.1f} | {r['step_ms']:.1f} | {r['weights_mib']:.0f} | {r['kv_mib']:.0f} | "
              f"{r['tok_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
