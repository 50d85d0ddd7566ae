"""Speculative decoding's effect: output tok/s with and without `--speculative-config`, same run.

    python benchmarks/spec_decode.py [--levels 1:8,16:32] [--spec JSON | --draft int8|int4|DRAFT [--draft-k K]]
                                     [--workloads copy,random] [--artifact DIR] [--json PATH]

Two `hloserve serve` processes on the default artifact (SmolLM2-135M-Instruct, bf16 weights and KV
cache), one plain and one with --spec (default: n-gram, 7 tokens, lookup 4..2; its
disable_by_batch_size is the server's default unless the JSON names it), both started before any
level runs and idle while the other is measured; each level runs on the plain server, then on the
speculating one, so load drift hits both alike. Workloads, greedy:

  * copy: chat requests asking to repeat a passage word for word, or to rewrite it with one word
    replaced (passages of 4..6 sentences drawn from SENTENCES, seeded, distinct per request), up to
    192 output tokens, ending at EOS: answers that copy from their prompts;
  * random: random-token prompts of 128..384 tokens (benchmarks/serve.py's random_prompt), 128 output
    tokens, EOS ignored: prompts that give nothing to copy (the model's answers to them, though, tend
    to repeat themselves, which prompt lookup catches);
  * open (--workloads copy,random,open): chat requests for new text (a short story, an explanation,
    a poem, facts about one of TOPICS), up to 128 output tokens, ending at EOS: little to copy, so
    most proposals miss: what speculation costs.

--draft speculates with a draft model instead: `int8` / `int4` the default preset exported with those
weights (and the default's bf16 KV cache) into the cache, anything else an artifact, GGUF file or preset
(`{"model": DRAFT, "num_speculative_tokens": K}`, K = --draft-k, default 4).

Levels: CONCURRENCY:REQUESTS pairs (default 1:8 and 16:32), c clients sending back to back. Per level
and server: output tok/s (completion tokens over the level's wall time), and for the speculating one the
drafts' acceptance from /metrics (accepted / drafted tokens, tokens per verifying step); then the ratio
spec / plain and whether every greedy answer was the same text. --levels 1:6,2:6,4:8,8:16,16:32 with
"disable_by_batch_size": 16 in --spec is the sweep that places the default threshold
(docs/performance.md, "Speculative decoding").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import cpu_description, free_port, random_prompt, server  # noqa: E402

MODEL = "smollm2-135m-instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SENTENCES = [
    "The old lighthouse stood at the edge of the cliff for nearly two hundred years.",
    "Every night its keeper climbed the narrow spiral stairs and trimmed the wick.",
    "Ships passing in the dark relied on its steady beam to guide them past the rocks.",
    "The village market opens at dawn, when the farmers arrive with their carts.",
    "Fresh bread, cheese and apples are sold from wooden stalls along the square.",
    "By noon the crowd thins out and the merchants begin to pack their goods.",
    "Our team released the new version of the software on Tuesday morning.",
    "It fixes a memory leak in the cache and makes the start-up twice as fast.",
    "Users who upgrade should read the notes about the changed configuration file.",
    "The river rises every spring when the snow melts in the mountains to the north.",
    "Farmers along its banks plant their crops late to avoid the floods.",
    "In autumn the water is low and children can walk across the stones.",
    "The museum's new exhibition shows paintings from the early twentieth century.",
    "Most of the works were lent by private collectors and have never been shown before.",
    "Tickets can be bought online or at the entrance, and students enter for free.",
    "Please send the signed contract to the office before the end of the month.",
    "If anything in the agreement is unclear, call us and we will explain it.",
    "The first payment is due thirty days after the contract is signed.",
    "A healthy breakfast gives you the energy to start the day well.",
    "Oats with fruit and a glass of water are a simple and cheap choice.",
    "Skipping breakfast often leads to eating too much later in the day.",
    "The train to the coast leaves every hour from platform four.",
    "On weekends an extra train runs in the evening for late travellers.",
    "Bicycles may be taken on board outside the morning and evening rush hours.",
]
SWAPS = [("the", "a"), ("and", "or"), ("is", "was"), ("every", "each"), ("in", "inside")]
TOPICS = ["a lighthouse keeper", "the water cycle", "a city bus network", "how bread is baked", "a chess club",
          "the moon landing", "a mountain village", "how a compiler works", "a lost umbrella", "bees in winter",
          "a night train", "the history of maps", "a robot gardener", "how vaccines work", "a rainy market day",
          "the first computers"]
ASKS = ["Write a short story about {}.", "Explain {} to a ten-year-old.", "Write a short poem about {}.",
        "Give three interesting facts about {}."]


def copy_requests(n: int, rng: random.Random) -> list[dict]:
    """n chat bodies: repeat or edit a passage drawn from SENTENCES (distinct passages)."""
    bodies, seen = [], set()
    while len(bodies) < n:
        k = rng.randint(4, 6)
        passage = " ".join(rng.sample(SENTENCES, k))
        if passage in seen:
            continue
        seen.add(passage)
        if len(bodies) % 2 == 0:
            ask = f"Repeat the following passage exactly, word for word:\n\n{passage}"
        else:
            a, b = rng.choice(SWAPS)
            ask = (f"Rewrite the following passage, replacing the word \"{a}\" with \"{b}\" and changing "
                   f"nothing else:\n\n{passage}")
        bodies.append({"messages": [{"role": "user", "content": ask}], "max_tokens": 192})
    return bodies


def open_requests(n: int, rng: random.Random) -> list[dict]:
    """n chat bodies asking for new text (a story, an explanation): answers that owe little to their prompts."""
    asks = [a.format(t) for a in ASKS for t in TOPICS]
    return [{"messages": [{"role": "user", "content": ask}], "max_tokens": 128} for ask in rng.sample(asks, n)]


def random_requests(n: int, rng: random.Random, tok) -> list[dict]:
    return [{"prompt": random_prompt(tok, rng, rng.randint(128, 384))[0], "max_tokens": 128, "ignore_eos": True}
            for _ in range(n)]


async def one(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(path, json={"model": MODEL, "temperature": 0, **body})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    out = r.json()
    choice = out["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], out["usage"]["completion_tokens"]


async def level(base: str, bodies: list[dict], c: int) -> tuple[list[tuple[str, int]], float]:
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=c)) as cl:
        async def run(body):
            async with sem:
                return await one(cl, body)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(run(b) for b in bodies))
        return list(out), time.perf_counter() - t0


def spec_counters(base: str) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics (empty where speculation is off)."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_per_pos" not in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            out[name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")] = float(value)
    return out


def measure(base: str, bodies: list[dict], c: int, spec: bool) -> dict:
    before = spec_counters(base) if spec else {}
    answers, secs = asyncio.run(level(base, bodies, c))
    row = {"tok_s": sum(n for _, n in answers) / secs, "seconds": secs, "tokens": sum(n for _, n in answers),
           "texts": [t for t, _ in answers]}
    if spec:
        after = spec_counters(base)
        d = {k: after[k] - before.get(k, 0) for k in after}
        row["acceptance"] = d["accepted_tokens"] / d["draft_tokens"] if d.get("draft_tokens") else float("nan")
        row["tokens_per_verify"] = 1 + d["accepted_tokens"] / d["drafts"] if d.get("drafts") else float("nan")
        row["drafts"] = d.get("drafts", 0)
    return row


def compare(plain: str, spec: str, w: str, c: int, bodies: list[dict], spec_first: bool) -> dict:
    """One level on both servers (in the order given), printed as one line."""
    if spec_first:
        s = measure(spec, bodies, c, True)
        p = measure(plain, bodies, c, False)
    else:
        p = measure(plain, bodies, c, False)
        s = measure(spec, bodies, c, True)
    same = sum(a == b for a, b in zip(p["texts"], s["texts"]))
    print(f"{w:6s} c={c:2d} ({len(bodies)} requests{', spec first' if spec_first else ''}): plain {p['tok_s']:6.1f} "
          f"tok/s, spec {s['tok_s']:6.1f} tok/s, ratio {s['tok_s'] / p['tok_s']:.2f}; acceptance "
          f"{s['acceptance']:.2f}, {s['tokens_per_verify']:.2f} tokens per verifying step ({s['drafts']:.0f} drafts); "
          f"same greedy text {same}/{len(bodies)}", flush=True)
    return {"workload": w, "concurrency": c, "requests": len(bodies), "spec_first": spec_first, "plain": p, "spec": s,
            "ratio": s["tok_s"] / p["tok_s"], "same_text": same}


def batching_baseline(plain: str, results: list[dict], c: int) -> None:
    """The plain server alone: each c=1 level's requests again at concurrency c, its greedy texts against
    its own c=1 texts (how much batching alone moves greedy text on this machine)."""
    for r in results:
        if r["concurrency"] != 1 or r.get("spec_first"):
            continue
        bodies = r["bodies"]
        texts = [t for t, _ in asyncio.run(level(plain, bodies, c))[0]]
        same = sum(a == b for a, b in zip(texts, r["plain"]["texts"]))
        print(f"{r['workload']:6s} plain alone, c={c} against c=1: same greedy text {same}/{len(bodies)}", flush=True)


def draft_model(name: str) -> str:
    """--draft's model: int8 / int4 the default preset exported with those weights, else `name` itself."""
    if name in ("int8", "int4"):
        from hloserve.server.serve import DEFAULT_PRESET, default_artifact
        return default_artifact(DEFAULT_PRESET, name, "bfloat16")
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1:8,16:32", help="CONCURRENCY:REQUESTS,... (default 1:8,16:32)")
    ap.add_argument("--spec", default=json.dumps(SPEC), help="the --speculative-config JSON of the second server")
    ap.add_argument("--draft", help="a draft model instead of --spec: int8 or int4 (the default preset exported so), "
                    "or an artifact, GGUF file or preset")
    ap.add_argument("--draft-k", type=int, default=4, help="--draft's num_speculative_tokens (default 4)")
    ap.add_argument("--workloads", default="copy,random")
    ap.add_argument("--rounds", type=int, default=1, help="each level this many times, the servers' order "
                    "swapped every other round")
    ap.add_argument("--batching", type=int, default=0, metavar="C", help="also run each c=1 level on the plain "
                    "server at concurrency C and compare its greedy texts with its own c=1 ones")
    ap.add_argument("--artifact", help="LLM artifact (default: the default model's)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.draft:
        args.spec = json.dumps({"model": draft_model(args.draft), "num_speculative_tokens": args.draft_k})
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    workloads = args.workloads.split(",")
    print(f"machine: {cpu_description()}; {time.strftime('%Y-%m-%d')}; spec {args.spec}", flush=True)
    rng = random.Random(0)
    from tokenizers import Tokenizer

    from hloserve.server.serve import default_artifact
    art = args.artifact or default_artifact()
    tok = Tokenizer.from_file(os.path.join(art, "tokenizer.json"))
    make = {"copy": lambda n: copy_requests(n, rng), "open": lambda n: open_requests(n, rng),
            "random": lambda n: random_requests(n, rng, tok)}
    sets = {(w, c): make[w](n) for w in workloads for c, n in levels}
    common = [sys.executable, "-m", "hloserve.server.cli", "serve", art, "--served-model-name", MODEL,
              "--max-num-seqs", str(args.max_num_seqs)]
    results = []
    with server("plain", [*common, "--port", str(free_port())], "/ready", "/tmp/hloserve-spec-plain.log") as (plain, _), \
            server("spec", [*common, "--port", str(free_port()), "--speculative-config", args.spec], "/ready",
                   "/tmp/hloserve-spec-spec.log") as (spec, _):
        for base in (plain, spec):   # one untimed request of each shape
            for w in workloads:
                asyncio.run(level(base, sets[(w, levels[0][0])][:1], 1))
        for rnd in range(args.rounds):
            for (w, c), bodies in sets.items():
                results.append({**compare(plain, spec, w, c, bodies, spec_first=rnd % 2 == 1), "bodies": bodies})
        if args.batching:
            batching_baseline(plain, results, args.batching)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_description(), "spec": args.spec,
                       "results": [{k: v for k, v in r.items() if k != "bodies"} for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
