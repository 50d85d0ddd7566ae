"""KV cache dtype benchmark: decode time per output token (TPOT) at a long context, bf16 cache against
int8 (`--kv-cache-dtype int8`), on the default model (SmolLM2-135M-Instruct) as `hloserve serve`
exports it.

    python benchmarks/kv_cache.py [--context 2000] [--batch 1,8] [--steps 64] [--rounds 8]

Each artifact's `decode` function is loaded through hloserve.runtime (the CPU attention kernel where
it runs, as served), and every sequence of the batch decodes one token per step at positions
context .. context + steps (the cache donated, as the server does). The variants run interleaved,
`--rounds` rounds of steps/rounds steps each, so load from other processes on a shared machine falls
on both alike; reported: median step time and the 10th/90th percentiles, per batch size. The
cache's contents do not change the work (every visible block is read), so it starts as zeros.
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
    for _ in range(rounds):
        for name, d in decoders.items():
            times[name] += [d.step() for _ in range(steps // rounds)]
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        out[name] = {"p50_ms": 1e3 * statistics.median(ts), "p10_ms": 1e3 * q[0], "p90_ms": 1e3 * q[-1],
                     "steps": len(ts)}
    return out


def main(argv=None) -> int:
    from hloserve.server.serve import serve_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    paths = {kv: serve_target(None, kv_cache_dtype=kv)[0] for kv in ("bfloat16", "int8")}
    report = {"context": args.context, "date": time.strftime("%Y-%m-%d")}
    for b in (int(x) for x in args.batch.split(",")):
        report[f"batch {b}"] = tpot(paths, b, args.context, args.steps, args.rounds)
    print(json.dumps(report, indent=1))
    print("\n| batch | bf16 cache ms/token p50 [p10, p90] | int8 cache | int8 / bf16 |")
    print("|---|---|---|---|")
    for key, r in report.items():
        if key.startswith("batch"):
            b, i = r["bfloat16"], r["int8"]
            print(f"| {key[6:]} | {b['p50_ms']:.1f} [{b['p10_ms']:.1f}, {b['p90_ms']:.1f}] | "
                  f"{i['p50_ms']:.1f} [{i['p10_ms']:.1f}, {i['p90_ms']:.1f}] | {i['p50_ms'] / b['p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
