"""What adapter slots cost: start time and c=16 throughput of an artifact exported with --lora-slots,
against the same model exported without them (docs/performance.md, "LoRA").

    hloserve export smollm2-135m-instruct -o BASE --weight-dtype bfloat16 --kv-cache-dtype bfloat16
    hloserve export smollm2-135m-instruct -o SLOTS --weight-dtype bfloat16 --kv-cache-dtype bfloat16 \\
        --lora-slots 4 --max-lora-rank 16
    python benchmarks/lora.py --base BASE --slots SLOTS [--adapters 4] [--starts 3]

Writes --adapters random PEFT adapters (rank = the artifact's max rank, every slot target, seed
fixed) beside SLOTS, then measures (1) `hloserve serve` from its start to /ready, alternating SLOTS
without adapters and SLOTS with every adapter (--lora-modules), --starts times each, the executable
cache warm; (2) benchmarks/engine_level.py's level at concurrency 16 on BASE, on SLOTS with no
adapter in use and on SLOTS with the requests spread over the adapters.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def write_adapters(slots: str, n: int) -> list[tuple[str, str]]:
    """n PEFT LoRA directories for the artifact's slots: (name, path)."""
    from safetensors.numpy import save_file

    from hloserve.runtime.artifact import LLMArtifact
    spec = LLMArtifact.read(slots).llm.lora
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        path = os.path.join(os.path.dirname(os.path.normpath(slots)), f"adapter{k}")
        os.makedirs(path, exist_ok=True)
        r = spec.max_rank
        tensors = {}
        for layer in range(spec.num_layers):
            for t, (fan_in, fan_out) in spec.targets.items():
                owner = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                stem = f"base_model.model.model.layers.{layer}.{owner}.{t}"
                tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((r, fan_in)) * 0.02).astype(np.float32)
                tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((fan_out, r)) * 0.02).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(spec.targets)}, f)
        out.append((f"adapter{k}", path))
    return out


def start_seconds(artifact: str, *extra: str) -> float:
    """`hloserve serve` from its launch to /ready answering 200."""
    sys.path.insert(0, os.path.dirname(HERE))
    import httpx

    from tests.support.launch import free_port, http
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hloserve.server.cli", "serve", artifact, "--port", str(port),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if http().get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"hloserve serve {artifact} exited with {proc.returncode}")
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--slots", required=True)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--only", choices=("start", "level"), help="measure only the start or only the level")
    args = ap.parse_args(argv)
    adapters = write_adapters(args.slots, args.adapters)
    if args.only != "level":
        measure_start(args, adapters)
    if args.only != "start":
        measure_level(args, adapters)
    return 0


def measure_start(args, adapters) -> None:
    modules = ["--lora-modules", *(f"{n}={p}" for n, p in adapters)]
    start_seconds(args.slots, *modules)          # fills the executable cache
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.starts):
        times["without"].append(start_seconds(args.slots))
        times["with"].append(start_seconds(args.slots, *modules))
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"start to /ready (median of {args.starts}): without adapters {med['without']:.2f} s, with "
          f"{args.adapters} {med['with']:.2f} s: {med['with'] / med['without']:.2f}x "
          f"({json.dumps({k: [round(x, 2) for x in v] for k, v in times.items()})})", flush=True)


def measure_level(args, adapters) -> None:
    sys.path.insert(0, HERE)
    import engine_level
    level = ["--requests", str(args.requests), "--concurrency", "16"]
    for what, extra in (("base artifact", ["--artifact", args.base]), ("slots, no adapter", ["--artifact", args.slots]),
                        ("slots, adapters in use", ["--artifact", args.slots, "--lora-modules",
                                                    *(f"{n}={p}" for n, p in adapters)])):
        print(f"== {what}", flush=True)
        engine_level.main(level + extra)


if __name__ == "__main__":
    sys.exit(main())
