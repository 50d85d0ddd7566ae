"""Structured output's cost: json_schema requests vs unconstrained ones on the same server, same run.

    python benchmarks/structured.py [--requests 100] [--concurrency 16] [--artifact DIR]

`hloserve serve` on the default artifact (SmolLM2-135M-Instruct, bf16 weights and KV cache); chat
requests "Describe person N as JSON" at temperature 0.7 (seeded). Two levels of --requests at
--concurrency, interleaved in the order structured, plain, structured, plain (two rounds):
  * structured: response_format json_schema (an object with a name, an age and a list of up to
    three hobbies, llguidance-masked); every answer is parsed and validated with jsonschema;
  * plain: the same prompts, no grammar, max_tokens = the structured run's mean output length
    (rounded up), ignore_eos, so both levels generate about the same number of tokens.
Printed: output tokens/s, TPOT p50 and the ratio structured/plain per round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from serve import cpu_description, free_port, server  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


async def one(client, i: int, structured: bool, max_tokens: int):
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": f"Describe person {i} as JSON."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    times, text, tokens = [], "", 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                if c["delta"].get("content"):
                    times.append(time.perf_counter())
                    text += c["delta"]["content"]
    end = time.perf_counter()
    tpot = (end - times[0]) / max(1, tokens - 1) if times else float("nan")
    return text, tokens, tpot, end - t0


async def level(base: str, n: int, c: int, structured: bool, max_tokens: int):
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=c)) as client:
        async def run(i):
            async with sem:
                return await one(client, i, structured, max_tokens)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(run(i) for i in range(n)))
        return out, time.perf_counter() - t0


def main() -> int:
    import jsonschema
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--artifact", help="LLM artifact (default: the default model's)")
    args = ap.parse_args()
    print(f"machine: {cpu_description()}; {time.strftime('%Y-%m-%d')}", flush=True)
    port = str(free_port())
    cmd = [sys.executable, "-m", "hloserve.server.cli", "serve", *([args.artifact] if args.artifact else []),
           "--port", port, "--served-model-name", "smollm2-135m-instruct"]
    log = os.path.join("/tmp", f"hloserve-structured-{port}.log")
    with server("hloserve", cmd, "/ready", log) as (base, _):
        asyncio.run(level(base, 4, 4, True, 128))                           # warm the grammar path
        plain_len = None
        for rnd in (1, 2):
            res, wall = asyncio.run(level(base, args.requests, args.concurrency, True, 128))
            for text, _, _, _ in res:
                jsonschema.validate(json.loads(text), SCHEMA)
            s_tok = sum(t for _, t, _, _ in res)
            plain_len = plain_len or math.ceil(s_tok / len(res))
            pres, pwall = asyncio.run(level(base, args.requests, args.concurrency, False, plain_len))
            p_tok = sum(t for _, t, _, _ in pres)
            s_rate, p_rate = s_tok / wall, p_tok / pwall
            s_tpot = statistics.median(x for _, _, x, _ in res if x == x) * 1e3
            p_tpot = statistics.median(x for _, _, x, _ in pres if x == x) * 1e3
            print(f"round {rnd}: {args.requests} requests at c={args.concurrency}, all {len(res)} structured answers "
                  f"valid; structured {s_rate:.1f} output tok/s (TPOT p50 {s_tpot:.1f} ms, {s_tok / len(res):.1f} "
                  f"tokens/answer), plain {p_rate:.1f} tok/s (TPOT p50 {p_tpot:.1f} ms, {plain_len} tokens/answer); "
                  f"structured/plain throughput {s_rate / p_rate:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
