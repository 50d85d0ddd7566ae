"""Load on the real server (127.0.0.1 only, bounded): concurrency, disconnects (mid-stream, and
non-streaming clients that give up), overload.

The model is the tiny random-init Llama of conftest.py (real SmolLM2 tokenizer). The KV cache
is kept small (31 blocks of 16 tokens for up to 8 running sequences of up to ~220 tokens), so
the load also runs through preemption (recompute) and prefix-cache hits (prompts repeat). Greedy outputs
under load must equal the same request's output when it ran alone, and a few of those equal
transformers' greedy generation on the same weights.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest

from tests.support.launch import http

from .servers import hf_greedy, metric, running_server

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
NUM_REQUESTS = 200
CONCURRENCY = 32
DISCONNECT_EVERY = 5          # every 5th request (20%) leaves: alternately a stream closed after a few
                              # chunks and a non-streaming client that times out
CHUNKS_BEFORE_DISCONNECT = 3
REQUEST_TIMEOUT = 60.0        # seconds, per request
LOAD_TIMEOUT = 150.0          # seconds, the whole load phase


def make_prompts(seed: int = 0, n: int = 40) -> list[tuple[str, int]]:
    """(prompt text, max_tokens): mixed lengths, from a few words to ~150 tokens."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
             "under bright autumn skies near old stone bridges and busy harbour markets").split()
    out = []
    for i in range(n):
        length = rng.choice([3, 8, 20, 45, 90, 140])
        out.append((f"Request {i}: " + " ".join(rng.choice(words) for _ in range(length)), rng.choice([4, 12, 24])))
    return out


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, *,
                            disconnect_after: int | None = None) -> tuple[str, str | None, int]:
    """Stream one greedy completion over SSE; returns (text, finish_reason, chunks read).

    With `disconnect_after`, leaves after that many chunks; the connection is closed because
    the response body was not read to the end (httpx never reuses such a connection).
    """
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, reason, chunks = [], None, 0
    async with client.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            text.append(choice["text"])
            reason = choice["finish_reason"] or reason
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                break
    return "".join(text), reason, chunks


async def give_up_waiting(client: httpx.AsyncClient) -> tuple[str, str | None, int]:
    """A non-streaming completion whose client leaves as soon as the request is sent: the server
    must notice and abort it. The connection is closed right after the last byte of the request,
    so the server sees the disconnect before it could have generated the 250 tokens asked for,
    however fast it is (no timer decides it)."""
    url = httpx.URL(str(client.base_url))
    body = json.dumps({"model": MODEL, "prompt": "Leave", "max_tokens": 250, "temperature": 0,
                       "ignore_eos": True}).encode()
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (url.host.encode(), len(body), body))
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return "", None, 0


@pytest.fixture(scope="module")
def load_server(tiny_chat_llm):
    _, art = tiny_chat_llm
    with running_server(art, "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "256",
                        "--num-blocks", "32", "--max-pending", "256", "--model-name", MODEL) as (base, proc):
        yield base


def test_load_with_disconnects_frees_every_block_and_never_recompiles(load_server, tiny_chat_llm):
    base = load_server
    prompts = make_prompts()

    async def run() -> tuple[dict, list, float]:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=base, limits=limits) as client:
            # references: each distinct prompt alone on the idle server
            ref = {}
            for p, n in prompts:
                text, reason, _ = await stream_completion(client, p, n)
                assert reason == "length"
                ref[p, n] = text
            sem = asyncio.Semaphore(CONCURRENCY)
            rng = random.Random(1)
            plan = [(rng.choice(prompts), i % DISCONNECT_EVERY == 0) for i in range(NUM_REQUESTS)]

            async def one(i, pn, leave):
                async with sem:
                    if leave and i % (2 * DISCONNECT_EVERY):
                        return pn, leave, await give_up_waiting(client)
                    if leave:   # long enough that it cannot finish before the server sees the disconnect
                        return pn, leave, await stream_completion(client, pn[0], 64,
                                                                  disconnect_after=CHUNKS_BEFORE_DISCONNECT)
                    return pn, leave, await stream_completion(client, *pn)

            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(one(i, pn, leave) for i, (pn, leave) in enumerate(plan))),
                                             LOAD_TIMEOUT)
            return ref, results, time.monotonic() - t0

    ref, results, seconds = asyncio.run(run())
    completed = [(pn, out) for pn, leave, out in results if not leave]
    assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // DISCONNECT_EVERY
    wrong = [(pn, out[0], ref[pn]) for pn, out in completed if out[0] != ref[pn] or out[1] != "length"]
    assert not wrong, f"{len(wrong)} of {len(completed)} differ from the request alone, e.g. {wrong[0]}"

    # all requests finished or were aborted: nothing runs, waits or holds a block or an admission slot
    deadline = time.monotonic() + 120   # a hang detector, not a speed bound: aborts are waited for
    while True:
        text = http().get(f"{base}/metrics", timeout=10).text
        idle = (metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
                and metric(text, "hloserve:requests_in_flight") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, text
    assert metric(text, "hloserve:kv_cache_used_blocks") == 0
    assert metric(text, "hloserve:kv_cache_free_blocks") == metric(text, "hloserve:kv_cache_total_blocks") == 31
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    assert metric(text, "hloserve:compiles_after_warmup_total") == 0
    aborted = re.search(r'vllm:request_success_total{[^}]*finished_reason="abort"} (\S+)', text)
    assert aborted and float(aborted.group(1)) == NUM_REQUESTS // DISCONNECT_EVERY   # disconnects reached the engine
    assert metric(text, "vllm:prefix_cache_hits_total") > 0
    assert metric(text, "vllm:num_preemptions_total") > 0       # the small cache forced recomputation
    print(f"\n{NUM_REQUESTS} requests at concurrency {CONCURRENCY} in {seconds:.1f} s; "
          f"preemptions {metric(text, 'vllm:num_preemptions_total'):.0f}, "
          f"prefix-cache hits {metric(text, 'vllm:prefix_cache_hits_total'):.0f} tokens")

    # the references themselves are transformers' greedy tokens on the same weights (a few, short ones)
    hf, art = tiny_chat_llm
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    for p, n in [pn for pn in ref if pn[1] <= 12][:3]:
        assert ref[p, n] == tok.decode(hf_greedy(hf, tok.encode(p), n)), p


def test_overload_answers_429_with_retry_after(tiny_chat_llm):
    """Three long streams fill the admission (--max-pending 3, one sequence at a time); every request
    sent while they hold it is answered 429 with Retry-After in OpenAI's error format; after them the
    server admits again. The streams are waited for on /metrics, not on a clock."""
    _, art = tiny_chat_llm
    with running_server(art, "--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--max-model-len", "256",
                        "--max-pending", "3", "--model-name", MODEL) as (base, _):
        async def run():
            async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT,
                                         limits=httpx.Limits(max_connections=16)) as client:
                # 3 x 240 tokens, one sequence at a time: the slots stay taken for 720 decode steps
                holders = [asyncio.create_task(stream_completion(client, f"Hold {i}", 240)) for i in range(3)]
                deadline = time.monotonic() + REQUEST_TIMEOUT   # a hang detector
                while metric((await client.get("/metrics")).text, "hloserve:requests_in_flight") < 3:
                    assert time.monotonic() < deadline and not any(h.done() for h in holders)
                    await asyncio.sleep(0.01)
                body = {"model": MODEL, "prompt": "Tell me a long story about a harbour", "max_tokens": 48,
                        "temperature": 0, "ignore_eos": True}
                refused = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(13)))
                in_flight = metric((await client.get("/metrics")).text, "hloserve:requests_in_flight")
                held = await asyncio.wait_for(asyncio.gather(*holders), LOAD_TIMEOUT)
                return refused, in_flight, held

        refused, in_flight, held = asyncio.run(run())
        assert in_flight == 3, "the holders finished while the burst was sent (not an overload)"
        assert [r.status_code for r in refused] == [429] * 13
        assert all(r.headers.get("retry-after") for r in refused)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)
        assert [reason for _, reason, _ in held] == ["length"] * 3          # the admitted ones all completed
        # slots are released: once the burst is over the server admits again
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert metric(httpx.get(f"{base}/metrics").text, "hloserve:requests_in_flight") == 0


def test_kv_cache_exhaustion_preempts_and_every_request_finishes(tiny_chat_llm):
    """A KV cache far too small for the load: 40 blocks of 16 tokens, while the 8 sequences a step
    runs (32 requests in flight) of ~210 tokens each need 112 (--kv-cache-mib cannot go that low
    here: 1 MiB is 128 blocks of this tiny model). Sequences are preempted and recomputed, every
    request finishes with its full length and the text it gets alone, nothing answers 5xx, and
    every block comes back."""
    _, art = tiny_chat_llm
    with running_server(art, "--max-num-seqs", "32", "--max-num-batched-tokens", "64", "--max-model-len", "256",
                        "--num-blocks", "40", "--model-name", MODEL) as (base, _):
        prompts = [(f"Story {i}: the harbour at dawn", 200) for i in range(4)]

        async def run():
            async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=32)) as client:
                alone = {p: (await stream_completion(client, p, n))[0] for p, n in prompts}
                plan = [prompts[i % len(prompts)] for i in range(32)]
                got = await asyncio.wait_for(asyncio.gather(*(stream_completion(client, p, n) for p, n in plan)),
                                             LOAD_TIMEOUT * 2)
                return alone, plan, got

        alone, plan, got = asyncio.run(run())
        assert all(reason == "length" for _, reason, _ in got), [g[1] for g in got]
        wrong = [p for (p, _), (text, _, _) in zip(plan, got) if text != alone[p]]
        assert not wrong, f"{len(wrong)} of 32 differ from the request alone"
        text = httpx.get(f"{base}/metrics", timeout=30).text
        total = metric(text, "hloserve:kv_cache_total_blocks")
        assert total * 16 < 8 * 210, total   # the cache really is too small for the load
        assert metric(text, "vllm:num_preemptions_total") > 0
        assert metric(text, "hloserve:kv_cache_used_blocks") == 0
        assert metric(text, "hloserve:kv_cache_free_blocks") == total
