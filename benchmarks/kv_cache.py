"""KV cache dtype benchmark: decode time per output token (TPOT) at a long context, bf16 cache against
int8 and fp8 (`--kv-cache-dtype int8`, `fp8_e4m3`), on the default model (SmolLM2-135M-Instruct) as
`hloserve serve` exports it.

    python benchmarks/kv_cache.py [--context 2000] [--batch 1,8] [--steps 64] [--rounds 8] [--kv bfloat16,int8,fp8_e4m3]
                                  [--also NAME=ARTIFACT]

Each artifact's `decode` function is loaded through hloserve.runtime (the CPU attention kernel where
it runs, as served), and every sequence of the batch decodes one token per step at positions
context .. context + steps (the cache donated, as the server does). The variants run interleaved,
`--rounds` rounds of steps/rounds steps each, so load from other processes on a shared machine falls
on both alike; reported: median step time and the 10th/90th percentiles, per batch size, and each
variant's paired ratio to bf16 (the median over rounds of its round median / bf16's in the same
round). `--also NAME=ARTIFACT` adds another export of the model (an older int8 one: before/after in
one run). The cache's contents do not change the work (every visible block is read), so it starts
as zeros.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


class Decoder:
    """One artifact's decode step over `batch` sequences, each `context` tokens long and growing."""

    def __init__(self, path: str, batch: int, context: int, steps: int):
        import jax.numpy as jnp
        from hloserve.runtime import load
        from hloserve.runtime.artifact.llm import LLMSpec

        self.model = load(path)
        llm = LLMSpec.of(self.model.manifest, path)
        self.bs = llm.block_size
        self.nb = -(-(context + steps + 1) // self.bs)
        self.tables = [list(range(1 + s * self.nb, 1 + (s + 1) * self.nb)) for s in range(batch)]
        self.cache = jnp.zeros(llm.kv_cache.concrete_shape(batch * self.nb + 1), llm.kv_cache.numpy_dtype)
        self.pos = context
        self.tokens = [1] * batch

    def step(self) -> float:
        from hloserve.runtime.artifact.llm import pack_step

        inputs = pack_step([([t], self.pos, table) for t, table in zip(self.tokens, self.tables)], self.bs,
                           pad_blocks=self.nb)
        t0 = time.perf_counter()
        out = self.model.functions["decode"](**inputs, kv_cache=self.cache)
        out["logits"].block_until_ready()
        dt = time.perf_counter() - t0
        self.cache = out["kv_cache"]
        self.tokens = [int(i) for i in np.argmax(np.asarray(out["logits"]), axis=-1)[:len(self.tokens)]]
        self.pos += 1
        return dt


def tpot(paths: dict[str, str], batch: int, context: int, steps: int, rounds: int) -> dict[str, dict]:
    decoders = {name: Decoder(path, batch, context, steps) for name, path in paths.items()}
    for d in decoders.values():   # compile and first run
        d.step()
    times: dict[str, list[float]] = {name: [] for name in paths}
    medians: dict[str, list[float]] = {name: [] for name in paths}    # each round's median
    for _ in range(rounds):
        for name, d in decoders.items():
            ts = [d.step() for _ in range(steps // rounds)]
            times[name] += ts
            medians[name].append(statistics.median(ts))
    out = {}
    first = next(iter(paths))
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        # paired: the median over rounds of this variant's round median / the first variant's (bf16) in
        # the same round, so load that comes and goes between rounds falls out of the ratio
        ratio = statistics.median(m / b for m, b in zip(medians[name], medians[first]))
        out[name] = {"p50_ms": 1e3 * statistics.median(ts), "p10_ms": 1e3 * q[0], "p90_ms": 1e3 * q[-1],
                     "steps": len(ts), "paired_ratio": ratio}
    return out


def main(argv=None) -> int:
    from hloserve.server.serve import serve_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kv", default="bfloat16,int8,fp8_e4m3",
                    help="the --kv-cache-dtype exports to compare, bfloat16 first (the ratios' base)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=ARTIFACT",
                    help="another artifact of the same model to run interleaved (e.g. an older int8 export)")
    args = ap.parse_args(argv)
    kvs = args.kv.split(",")
    if kvs[0] != "bfloat16":
        ap.error("--kv: list bfloat16 first (the ratios are to it)")
    paths = {kv: serve_target(None, kv_cache_dtype=kv)[0] for kv in kvs}
    paths.update(a.split("=", 1) for a in args.also)
    report = {"context": args.context, "date": time.strftime("%Y-%m-%d")}
    for b in (int(x) for x in args.batch.split(",")):
        report[f"batch {b}"] = tpot(paths, b, args.context, args.steps, args.rounds)
    print(json.dumps(report, indent=1))
    print("\n| batch | cache | ms/token p50 [p10, p90] | / bf16 (p50s) | / bf16 (paired rounds) |")
    print("|---|---|---|---|---|")
    for key, r in report.items():
        if key.startswith("batch"):
            for name, x in r.items():
                print(f"| {key[6:]} | {name} | {x['p50_ms']:.1f} [{x['p10_ms']:.1f}, {x['p90_ms']:.1f}] | "
                      f"{x['p50_ms'] / r['bfloat16']['p50_ms']:.3f} | {x['paired_ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
