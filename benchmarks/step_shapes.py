"""Step-function latency by call shape, for one or more LLM artifacts side by side.

    python benchmarks/step_shapes.py ART [ART ...] [--function decode] [--repeats 5]
                                     [--shapes 1x1@300,16x16@300,256x1@1024] [--json PATH]
                                     [--layouts on|off|both]

Each shape TxS@C is one call of the function with T tokens spread evenly over S sequences, each
sequence having C tokens already in its cache (T = S: a decode step; T > S: prompt chunks).
Every artifact is loaded in this process (runtime.load, weights on device, the CPU kernels where
they build) and timed in turn, shape by shape; each row prints the median of --repeats calls
after one untimed call, and the ratio to the first artifact. `--layouts both` loads each artifact
twice, its weights laid out for the kernels (runtime.load's default) and as the artifact has them
(`ART (artifact layouts)`), to time what the load-time layouts buy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

DEFAULT_SHAPES = "1x1@300,2x2@300,4x4@300,8x8@300,16x16@300,32x2@128,256x1@0,256x1@128,256x1@1024,256x1@1600"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        ts, _, ctx = part.partition("@")
        t, _, s = ts.partition("x")
        T, S, C = int(t), int(s), int(ctx or 0)
        if T % S:
            raise SystemExit(f"shape {part}: T={T} tokens do not spread evenly over S={S} sequences")
        out.append((T, S, C))
    return out


class Timer:
    """One artifact's function, called with synthetic steps over a private cache."""

    def __init__(self, path: str, function: str, shapes: list[tuple[int, int, int]], layouts: bool = True):
        import jax.numpy as jnp
        from hloserve import runtime
        from hloserve.runtime import host_pages
        from hloserve.runtime.artifact import read_manifest
        from hloserve.runtime.artifact.llm import LLMSpec

        self.llm = LLMSpec.of(read_manifest(path), path)
        self.vocab = int(self.llm.vocab_size)
        bs = self.llm.block_size
        longest = max(c + t // s for t, s, c in shapes)
        self.B = -(-longest // bs)                                       # table width: the longest context
        most = max(s for _, s, _ in shapes)
        self.model = runtime.load(path, buckets={"num_tokens": sorted({t for t, _, _ in shapes}),
                                                 "num_seqs": sorted({s for _, s, _ in shapes}),
                                                 "max_blocks": [self.B]}, layouts=layouts)
        self.fn = self.model.functions[function]
        kv = self.llm.kv_cache
        self.cache = jnp.zeros(kv.concrete_shape(1 + most * self.B), kv.numpy_dtype)
        host_pages.zeroed_in_huge_pages(self.cache)   # as the server's cache (server/core/model_runner.py)

    def inputs(self, T: int, S: int, C: int) -> dict:
        bs, per = self.llm.block_size, T // S
        table = (1 + np.arange(S)[:, None] * self.B + np.arange(self.B)[None, :]).astype(np.int32)   # [S, B]
        seq = np.repeat(np.arange(S, dtype=np.int32), per)                                         # [T]
        pos = np.tile(C + np.arange(per), S).astype(np.int32)                                      # [T]
        slot = (table[seq, pos // bs] * bs + pos % bs).astype(np.int32)
        # random ids (seeded): a mixture of experts routes them as it would a real step's, where one
        # repeated id would send every row to the same few experts
        tokens = np.random.default_rng(T * 1_000_003 + C).integers(0, self.vocab, T, dtype=np.int32)
        return dict(tokens=tokens, positions=pos, seq_ids=seq, slot_mapping=slot,
                    block_tables=table, context_lens=np.full(S, C + per, np.int32),
                    last_token=(np.arange(S) * per + per - 1).astype(np.int32))

    def time(self, T: int, S: int, C: int, repeats: int) -> float:
        ins = self.inputs(T, S, C)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = self.fn(**ins, **{self.llm.kv_cache.input: self.cache})
            self.cache = out[self.llm.kv_cache.output]
            np.asarray(out["logits"])
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--function", default="decode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated TxS@C (default %(default)s)")
    ap.add_argument("--json", help="also write {artifact: {shape: ms}} here")
    ap.add_argument("--layouts", choices=("on", "off", "both"), default="on",
                    help="weights laid out for the kernels at load (on), as the artifact has them (off), or each "
                         "artifact both ways")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    timers, names = [], []
    for path in args.artifacts:
        for laid_out in {"on": (True,), "off": (False,), "both": (True, False)}[args.layouts]:
            print(f"[step_shapes] loading {path}", file=sys.stderr, flush=True)
            timers.append(Timer(path, args.function, shapes, laid_out))
            names.append(path if laid_out or args.layouts == "off" else f"{path} (artifact layouts)")
    args.artifacts = names
    print("| T x S @ context | " + " | ".join(f"artifact {i + 1} (ms)" for i in range(len(timers)))
          + "".join(f" | {i + 1} / 1" for i in range(1, len(timers))) + " |")
    print("|---" * (1 + 2 * len(timers) - 1) + "|")
    table: dict[str, dict[str, float]] = {path: {} for path in args.artifacts}
    for n, (T, S, C) in enumerate(shapes, 1):
        print(f"[step_shapes] shape {n}/{len(shapes)}: {T}x{S}@{C}", file=sys.stderr, flush=True)
        ms = [t.time(T, S, C, args.repeats) for t in timers]
        for path, m in zip(args.artifacts, ms):
            table[path][f"{T}x{S}@{C}"] = m
        print(f"| {T} x {S} @ {C} | " + " | ".join(f"{m:.1f}" for m in ms)
              + "".join(f" | {m / ms[0]:.2f}" for m in ms[1:]) + " |", flush=True)
    for i, path in enumerate(args.artifacts, 1):
        print(f"artifact {i}: {path}")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
