"""vLLM's own load generator against hloserve: `vllm bench serve` with its completions and chat
backends, the client people use to compare servers. Fails (exit 1) on any failed request.

    .venv/bin/python benchmarks/vllm_client.py [--vllm /work/vllm-venv/bin/vllm] [--num-prompts 32]

Needs vLLM's CPU build in its own venv (`bash benchmarks/vllm_env.sh`; never a dependency) and the
Hugging Face copy of SmolLM2 that benchmarks/serve.py makes (its tokenizer is the client's).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.launch import free_port, server_process  # noqa: E402

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default="/work/vllm-venv/bin/vllm")
    ap.add_argument("--hf-dir", default=os.path.expanduser("~/.cache/hloserve/bench/smollm2-hf"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    args = ap.parse_args()
    for path, how in ((args.vllm, "bash benchmarks/vllm_env.sh"), (args.hf_dir, "python benchmarks/serve.py once")):
        if not os.path.exists(path):
            print(f"vllm_client: {path} is missing; make it with `{how}`", file=sys.stderr)
            return 2
    port = free_port()
    cmd = [sys.executable, "-m", "hloserve.server.cli", "serve", "--port", str(port)]
    failures = 0
    print(f"starting `hloserve serve` (the default model) on port {port}", flush=True)
    with server_process(cmd, f"http://127.0.0.1:{port}/ready", "/tmp/hloserve-vllm-client.log", timeout=1200):
        for backend, endpoint in BACKENDS.items():
            print(f"vllm bench serve --backend {backend} ({args.num_prompts} prompts, "
                  f"concurrency {args.max_concurrency})", flush=True)
            out = subprocess.run(
                [args.vllm, "bench", "serve", "--backend", backend, "--endpoint", endpoint,
                 "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2-135m-instruct",
                 "--tokenizer", args.hf_dir, "--dataset-name", "random", "--random-input-len", "128",
                 "--random-output-len", "32", "--num-prompts", str(args.num_prompts),
                 "--max-concurrency", str(args.max_concurrency)],
                capture_output=True, text=True, timeout=1200)
            ok = re.search(r"Successful requests:\s+(\d+)", out.stdout)
            failed = re.search(r"Failed requests:\s+(\d+)", out.stdout)
            tput = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", out.stdout)
            if not ok or not failed:
                print(out.stdout[-2000:], out.stderr[-2000:], sep="\n")
                failures += 1
                continue
            print(f"  {ok.group(1)} successful, {failed.group(1)} failed, {tput.group(1) if tput else '?'} "
                  f"output tok/s", flush=True)
            failures += int(failed.group(1))
    print("vllm bench serve against hloserve: " + ("OK (0 failed requests)" if not failures
                                                   else f"{failures} failure(s)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
