"""Runtime benchmark on all-MiniLM-L6-v2: cold vs warm start, and latency vs torch eager.

    .venv/bin/python benchmarks/runtime.py [--artifact DIR] [--seq 128] [--iters 30]

1. Time to first result, cold vs warm: separate processes load the artifact and
   run one call; the cold one starts with an empty compilation cache, the warm
   ones reuse the directory the cold one filled. Timed from just before
   `runtime.load` to the first result on the host (imports are reported apart).
2. Latency of the runtime vs torch eager (transformers, same weights, same
   inputs) in this process at batch 1 and 32, with the max abs difference of
   the outputs, so the two run the same computation. torch runs with 1 thread
   and with all cores; the faster is the baseline.

Prints one line per measurement and the ratios; numbers go to docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from hloserve import runtime
t1 = time.perf_counter()
model = runtime.load(sys.argv[1], cache_dir=sys.argv[2])
t2 = time.perf_counter()
ids = np.full((int(sys.argv[3]), int(sys.argv[4])), 2023, np.int32)
out = model.functions["forward"](input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))
np.asarray(out["last_hidden_state"])
t3 = time.perf_counter()
st = model.functions["forward"].stats
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_call_s": t3 - t2, "ttfr_s": t3 - t1,
                  "compile_s": st.compile_seconds, "from_disk": st.persistent_cache_hits}))
"""


def ttfr(art: str, cache: str, batch: int, seq: int) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, art, cache, str(batch), str(seq)], capture_output=True,
                          text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["process_s"] = wall
    return r


def export_minilm(out: str) -> None:
    from hloserve.exporter import presets
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    src = load_source(presets.resolve("all-minilm-l6-v2", quiet=True))
    export_artifact(out, src.entries, source="all-minilm-l6-v2", model=src.model)


def p50_ms(fn, iters: int) -> float:
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", help="an exported MiniLM artifact (default: export one to a temp dir)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warm-runs", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hloserve-bench-")
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: str) -> None:
    art = args.artifact
    if art is None:
        art = os.path.join(tmp, "minilm")
        t0 = time.perf_counter()
        export_minilm(art)
        print(f"exported MiniLM to {art} in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}", flush=True)

    # 1. cold vs warm time to first result, separate processes
    cache = os.path.join(tmp, "cache")
    cold = ttfr(art, cache, 1, args.seq)
    warm = [ttfr(art, cache, 1, args.seq) for _ in range(args.warm_runs)]
    w = min(warm, key=lambda r: r["ttfr_s"])
    wm = statistics.median(r["ttfr_s"] for r in warm)
    for name, r in [("cold", cold), ("warm (best)", w)]:
        print(f"{name:12s} load {r['load_s']:.2f} s, first call {r['first_call_s']:.2f} s "
              f"(compile {r['compile_s']:.2f} s, from disk: {bool(r['from_disk'])}), time to first result "
              f"{r['ttfr_s']:.2f} s; process {r['process_s']:.2f} s (imports {r['import_s']:.2f} s)")
    print(f"time to first result cold/warm: {cold['ttfr_s'] / w['ttfr_s']:.1f}x best, "
          f"{cold['ttfr_s'] / wm:.1f}x median of {len(warm)} (whole process: "
          f"{cold['process_s'] / statistics.median(r['process_s'] for r in warm):.1f}x)", flush=True)
    # what the caches control: load + getting the executable (the first run after it is XLA's kernel set-up)
    ready = [r["load_s"] + r["compile_s"] for r in (cold, w)]
    print(f"time to executable ready (load + compile) cold/warm: {ready[0]:.2f} s / {ready[1]:.2f} s = "
          f"{ready[0] / ready[1]:.1f}x; first run after it: cold {cold['first_call_s'] - cold['compile_s']:.2f} s, "
          f"warm {w['first_call_s'] - w['compile_s']:.2f} s", flush=True)

    # 2. runtime vs torch eager, same inputs, this process
    import jax
    import torch
    import transformers

    from hloserve import runtime
    from hloserve.exporter import presets
    ref = transformers.AutoModel.from_pretrained(presets.resolve("all-minilm-l6-v2", quiet=True),
                                                 attn_implementation="sdpa").eval()
    model = runtime.load(art, cache_dir=cache)
    fn = model.functions["forward"]
    model.warmup(sizes={"batch": [1, 32], "seq": [args.seq]})
    for batch in (1, 32):
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(1000, 29000, (batch, args.seq), generator=g)
        mask = torch.ones_like(ids)
        tt = torch.zeros_like(ids)
        np_in = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": tt.numpy()}

        def run_ours():
            return jax.block_until_ready(fn(**np_in))["last_hidden_state"]

        def run_torch():
            with torch.inference_mode():
                return ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state

        diff = float(np.abs(np.asarray(run_ours()) - run_torch().numpy()).max())
        run_ours()
        ours = p50_ms(run_ours, args.iters)
        # torch's OpenMP pool collapses on an oversubscribed machine; the baseline is its best thread count
        eager_by_threads = {}
        for threads in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            run_torch()
            eager_by_threads[threads] = p50_ms(run_torch, args.iters)
        threads, eager = min(eager_by_threads.items(), key=lambda kv: kv[1])
        shown = ", ".join(f"{t} thread(s) {ms:.2f} ms" for t, ms in eager_by_threads.items())
        print(f"batch {batch:2d} x seq {args.seq}: runtime p50 {ours:.2f} ms, torch eager p50 {eager:.2f} ms "
              f"(best of: {shown}), eager/runtime {eager / ours:.2f}x (max abs diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
