"""Where a serving level's time goes: the engine in process, no HTTP, every step call timed by shape.

    python benchmarks/engine_level.py [--artifact DIR] [--requests 32] [--concurrency 16]
                                      [--output-len 48] [--min-input 35] [--max-input 414]
                                      [--serve FIELD=VALUE ...] [--dispatch]

Runs `benchmarks/serve.py`'s kind of level (random-token prompts of mixed lengths, greedy,
EOS ignored, at most --concurrency requests in flight, a new one as soon as one finishes) on the
engine `hloserve serve` builds (same defaults: server.services.ServeConfig), driving its loop by
hand, and prints output tokens/s and, per step-function call shape (function, T, S, B), the
number of calls, mean and total wall time. Timings include copying the logits to the host.
With --dispatch it times the engine thread inside `runner.dispatch` per step instead (the host
work a step waits for before it is sent; timing each call would make dispatch wait for the step).
The prefix cache's disk tier is a fresh directory, as in serve.py: the default one outlives the
process, and a repeated workload (the same seed) would be served from it.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np


class TimedFunction:
    """Wraps a runtime function: records the wall time of each call by (name, T, S, B)."""

    def __init__(self, name: str, fn, times: dict):
        self.name, self.fn, self.times = name, fn, times

    def __call__(self, **inputs):
        t0 = time.perf_counter()
        out = self.fn(**inputs)
        np.asarray(out["logits"])
        key = (self.name, inputs["tokens"].shape[0], *inputs["block_tables"].shape)
        self.times[key].append(time.perf_counter() - t0)
        return out

    def __getattr__(self, attr):
        return getattr(self.fn, attr)


def main(argv=None) -> int:
    from hloserve.server.serve import default_artifact_path
    from hloserve.server.wiring import build_engine
    from hloserve.server.services import ServeConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default=default_artifact_path())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--min-input", type=int, default=35)
    ap.add_argument("--max-input", type=int, default=414)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="LoRA adapters to load (an artifact with --lora-slots); the requests take them in turn")
    ap.add_argument("--serve", action="append", default=[], metavar="FIELD=VALUE",
                    help="a ServeConfig field to change, e.g. --serve prefill_growth=2 (repeatable)")
    ap.add_argument("--dispatch", action="store_true",
                    help="time runner.dispatch per step instead of each step call by shape")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.artifact, "manifest.json")):
        print(f"engine_level: no artifact at {args.artifact}; run `hloserve serve` once (it exports the default "
              f"model there) or pass --artifact", file=sys.stderr)
        return 2

    fields = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.serve)}
    modules = tuple(tuple(m.split("=", 1)) for m in args.lora_modules)
    kv_dir = tempfile.mkdtemp(prefix="hloserve-engine-level-kv-")
    try:
        engine, _ = build_engine(args.artifact, dataclasses.replace(ServeConfig(), lora_modules=modules,
                                                                    kv_disk_dir=kv_dir, **fields))
        return run_level(engine, args, modules)
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)


def run_level(engine, args, modules) -> int:
    from hloserve.server.core.sampling import SamplingParams

    t0 = time.perf_counter()
    engine.warmup(lambda line: print(f"  {line}", end="\r", flush=True))
    print(f"\nwarm-up {time.perf_counter() - t0:.1f} s", flush=True)

    times: dict = collections.defaultdict(list)
    dispatched: list[float] = []
    if args.dispatch:
        real = engine.runner.dispatch

        def dispatch(plan):
            t = time.perf_counter()
            pending = real(plan)
            dispatched.append(time.perf_counter() - t)
            return pending
        engine.runner.dispatch = dispatch      # execute() calls it too
    else:
        fns = engine.runner.model.functions
        for name in list(fns):
            fns[name] = TimedFunction(name, fns[name], times)

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    refs = [engine.runner.adapters.get(name).ref for name, _ in modules] or [None]
    pending, live, done, tokens = list(prompts), [], 0, 0
    t0 = time.perf_counter()
    while done < args.requests:
        while pending and len(live) < args.concurrency:
            adapter = refs[len(pending) % len(refs)]
            live.append(engine.add_request(pending.pop(0), dataclasses.replace(params, adapter=adapter)))
        engine.run_once()
        for stream in list(live):
            for out in stream.drain():
                tokens += len(out.new_token_ids)
                if out.finished:
                    live.remove(stream)
                    done += 1
                    print(f"  {done}/{args.requests} requests done", end="\r", flush=True)
    wall = time.perf_counter() - t0
    print(f"\nlevel: {args.requests} requests at concurrency {args.concurrency}: {wall:.2f} s, {tokens} output "
          f"tokens, {tokens / wall:.1f} tok/s")
    engine.runner.close()
    if args.dispatch:
        print(f"dispatch: {len(dispatched)} steps, {1e3 * sum(dispatched) / len(dispatched):.2f} ms a step, "
              f"{sum(dispatched):.2f} s of {wall:.2f} s")
        return 0
    print("| call (function, T, S, B) | calls | mean ms | total s |\n|---|---|---|---|")
    for key, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {key} | {len(ts)} | {1e3 * sum(ts) / len(ts):.1f} | {sum(ts):.2f} |")
    print(f"step calls: {sum(sum(ts) for ts in times.values()):.2f} s of {wall:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
