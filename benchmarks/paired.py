"""Servers measured in turn within the same minutes: every system up at once, the work alternated.

    python benchmarks/paired.py --hloserve ART [--hloserve ART2] [--baseline TREE] [--llama-server GGUF]
                                [--vllm-dir HF_DIR] --tokenizer DIR [--concurrency 1] [--rounds 12] [--output-len 64]

benchmarks/serve.py serves one system after the other, minutes apart; on a shared machine whose read
bandwidth moves by half within an hour (29 to 50 GB/s, docs/performance.md) that puts the machine's
minute into every ratio. Here all servers are started first (an idle server sleeps: hloserve's
engine waits on its queue, llama-server's slots and vLLM's engine core block), then each round runs
the same work on every system back to back, the order rotated round by round: at c=1 one request
(the same prompt for every system), above that one level of --requests requests at that concurrency.
Every round also reads the machine's bandwidth (benchmarks/read_bandwidth.cc, both cores), so a
round's ratio can be read against the minute it ran in.

Prints per round each system's c=1 TPOT (above c=1 output tok/s) and TTFT p50, with the ratio to the
first system; then per metric the medians, the median of the per-round ratios and the rounds the
first system was ahead in; writes them as JSON (--json). Prompts: random
vocabulary tokens of --min-input..--max-input tokens (serve.py's way), EOS ignored, greedy. Systems
are named by kind and file; the servers are serve.py's (the same flags: llama-server -t <cores>
--no-repack, vLLM one compute thread bound to core 0).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve as S  # noqa: E402  (benchmarks/serve.py: its servers, client and prompts)


def bandwidth_reader(workdir: str) -> str | None:
    """benchmarks/read_bandwidth.cc built once (None without a C++ compiler)."""
    exe = os.path.join(workdir, "read_bandwidth")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_bandwidth.cc")
    try:
        subprocess.run(["g++", "-O2", "-march=native", "-pthread", src, "-o", exe], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return exe


def read_bandwidth(exe: str | None) -> float | None:
    """The machine's read bandwidth now, GB/s (the median of read_bandwidth.cc's runs)."""
    if exe is None:
        return None
    out = subprocess.run([exe], capture_output=True, text=True, check=False).stdout
    _, found, rest = out.partition("median ")
    with contextlib.suppress(ValueError):
        return float(rest.split()[0]) if found else None
    return None


def commands(args, max_len: int, logs: str) -> list[tuple[str, list[str], str, dict]]:
    """(name, command, ready path, environment) of every system, in the order given."""
    out = []
    base_args = args.hloserve_args if args.baseline_args is None else args.baseline_args
    trees = [("hloserve", {}, args.hloserve_args)] + (
        [("hloserve (baseline)", {"PYTHONPATH": S.baseline_path(args.baseline, logs)}, base_args)] if args.baseline else [])
    for art in args.hloserve:
        for label, env, flags in trees:
            out.append((f"{label} {os.path.basename(art.rstrip('/'))}",
                        [sys.executable, "-m", S.HLOSERVE_CLI, "serve", art, "--port", str(S.free_port()),
                         "--model-name", S.MODEL, "--max-model-len", str(max_len), *flags.split()],
                        "/ready", env))
    for gguf in args.llama_server:
        out.append((f"llama-server {os.path.basename(gguf)}", S.llama_server_command(
            args.llama_server_bin, gguf, max(args.concurrency), max_len, args.llama_server_args), "/health", {}))
    if args.vllm_dir:   # serve.py's defaults: one compute thread bound to core 0, a 2 GiB KV cache
        out.append(("vLLM", S.vllm_command(args.vllm, args.vllm_dir, max_len, ""), "/v1/models",
                    S.vllm_setup("1", 2)[0]))
    return out


# what a round records of each system at c=1 (key 1) and above (0): the Level.summary() field it is
# read from, and whether lower is better
METRICS = {1: {"tpot_ms": ("tpot_p50_ms", True), "ttft_ms": ("ttft_p50_ms", True)},
           0: {"output_tok_s": ("output_tok_s", False), "ttft_ms": ("ttft_p50_ms", True)}}


def run_round(bases: dict[str, str], order: list[str], reqs: list[S.Request], c: int) -> dict[str, dict[str, float]]:
    """One round: the same requests on every system in `order`; per system its c=1 TPOT and TTFT (ms),
    above c=1 its output tok/s and TTFT p50."""
    got = {}
    for name in order:
        results, secs = asyncio.run(S.run_level_http(bases[name], reqs, c, {"ignore_eos": True}, f"{name} c={c}"))
        summary = S.Level(name, "paired", c, results, secs).summary()
        got[name] = {metric: summary[field] for metric, (field, _) in METRICS[int(c == 1)].items()}
    return got


def summarize(names: list[str], rounds: list[dict], c: int) -> dict:
    """Per metric: each system's median, and per other system the median of the per-round ratios first /
    other and the rounds the first system was ahead in; printed as it goes."""
    out = {}
    for metric, (_, lower) in METRICS[int(c == 1)].items():
        med = {n: statistics.median(rd["values"][n][metric] for rd in rounds) for n in names}
        ratio = {n: statistics.median(rd["values"][names[0]][metric] / rd["values"][n][metric] for rd in rounds)
                 for n in names[1:]}
        ahead = {n: sum((rd["values"][names[0]][metric] < rd["values"][n][metric]) == lower for rd in rounds)
                 for n in names[1:]}
        for n in names[1:]:
            print(f"  c={c} {metric}: {names[0]} {med[names[0]]:.1f}, {n} {med[n]:.1f} (medians); ratio first / other, "
                  f"median of the rounds: {ratio[n]:.3f}; {names[0]} ahead in {ahead[n]} of {len(rounds)} rounds", flush=True)
        out[metric] = {"medians": med, "ratio_first_to": ratio, "first_ahead_rounds": ahead}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hloserve", action="append", default=[], help="an artifact `hloserve serve` serves (repeatable)")
    p.add_argument("--hloserve-args", default="", help="extra `hloserve serve` flags, for every artifact")
    p.add_argument("--baseline", metavar="DIR",
                   help="also serve every --hloserve artifact from the hloserve checkout at DIR (a `git worktree` of "
                        "the base revision), as 'hloserve (baseline) ART', right after this tree's")
    p.add_argument("--baseline-args", metavar="FLAGS",
                   help="`hloserve serve` flags for the baseline instead of --hloserve-args (e.g. this checkout with a "
                        "feature off: --baseline . --baseline-args=--no-async-scheduling)")
    p.add_argument("--llama-server", action="append", default=[], help="a GGUF file llama-server serves (repeatable)")
    p.add_argument("--llama-server-bin", default=S.LLAMA_SERVER)
    p.add_argument("--llama-server-args", default="--no-repack")
    p.add_argument("--vllm-dir", help="a Hugging Face directory vLLM serves (with --vllm, its venv's binary)")
    p.add_argument("--vllm", default="/work/vllm-venv/bin/vllm")
    p.add_argument("--tokenizer", required=True, help="a directory with the model's tokenizer.json")
    p.add_argument("--concurrency", default="1", help="comma-separated levels, each its own rounds")
    p.add_argument("--requests", type=int, default=32, help="requests a round above c=1")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-input", type=int, default=128)
    p.add_argument("--max-input", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rounds and medians here")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if len(args.hloserve) * (1 + bool(args.baseline)) + len(args.llama_server) + bool(args.vllm_dir) < 2:
        p.error("name two systems or more (--hloserve, --baseline, --llama-server, --vllm-dir)")
    import tokenizers
    try:
        tok = tokenizers.Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own exception types)
        p.error(f"--tokenizer {args.tokenizer}: no readable tokenizer.json ({e})")
    rng = random.Random(args.seed)

    def request() -> S.Request:
        return S.Request(*S.random_prompt(tok, rng, rng.randint(args.min_input, args.max_input)), args.output_len)

    max_len = 2048 if args.max_input + args.output_len + 16 <= 2048 else -(-(args.max_input + args.output_len + 16) // 256) * 256
    logs = tempfile.mkdtemp(prefix="hloserve-paired-")
    bw = bandwidth_reader(logs)
    print(f"logs: {logs}; CPU: {S.cpu_description()}", flush=True)
    systems = commands(args, max_len, logs)
    report = {"cpu": S.cpu_description(), "concurrency": {}}
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, cmd, ready, env in systems:
            bases[name], _ = stack.enter_context(S.server(name, cmd, ready, os.path.join(logs, f"{len(bases)}.log"), env))
        names = [n for n, *_ in systems]
        warm = request()
        for name in names:                                   # one untimed request each
            asyncio.run(S.run_level_http(bases[name], [warm], 1, {"ignore_eos": True}))
        for c in args.concurrency:
            key = "tpot_ms" if c == 1 else "output_tok_s"
            print(f"c={c}: {key} (ttft_ms) per round, the ratio to {names[0]} after each", flush=True)
            rounds = []
            for r in range(args.rounds):
                reqs = [request() for _ in range(1 if c == 1 else args.requests)]
                order = names[r % len(names):] + names[:r % len(names)]
                got = run_round(bases, order, reqs, c)
                gbs = read_bandwidth(bw)
                rounds.append({"order": order, "values": got, "read_gb_s": gbs})
                cells = " | ".join(f"{n} {got[n][key]:.1f} ({got[n]['ttft_ms']:.0f})" + (
                    "" if n == names[0] else f" {got[n][key] / got[names[0]][key]:.3f}x") for n in names)
                print(f"  round {r + 1}/{args.rounds}: {cells} | read {gbs if gbs is None else f'{gbs:.1f}'} GB/s",
                      flush=True)
            report["concurrency"][str(c)] = {"rounds": rounds, **summarize(names, rounds, c)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
