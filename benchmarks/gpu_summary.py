"""One GPU run's figures in one JSON (benchmarks/results/): what benchmarks/gpu_check.sh measured.

    python benchmarks/gpu_summary.py OUT ART --commit C [--served RESULTS_JSON] -o FILE

Reads from OUT what gpu_check.sh's steps wrote (bandwidth.json, step_vs_transformers.json,
quant_steps.json) and the served run's results.json, and writes: the date, the GPU, the commit, and
per model and precision the step's median ms by call shape, the c=1 TPOT p50 and the c=16 / c=64
output tok/s served, the anchors' figures (transformers eager; static cache under torch.compile)
and the bandwidth floor of each decode shape: (weights + the KV cache the step reads) bytes over
the card's measured copy bandwidth (bytes read and written by a large device copy, over its time).
A file that is missing leaves its part out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def kv_bytes_per_token(art: str) -> int:
    """Bytes of K and V one cached token holds over all layers (what a decode step reads per token)."""
    import numpy as np
    from hloserve.runtime.artifact import read_manifest
    from hloserve.runtime.artifact.llm import LLMSpec
    llm = LLMSpec.of(read_manifest(art), art)
    kv = llm.kv_cache
    one_block = kv.concrete_shape(1)
    return int(np.prod(one_block)) * np.dtype(kv.numpy_dtype).itemsize // llm.block_size


def weight_bytes(art: str) -> int:
    return sum(os.path.getsize(os.path.join(art, f)) for f in os.listdir(art) if f.endswith(".safetensors"))


def floors(art: str, bandwidth: float, shapes: list[str]) -> dict:
    """Per decode shape TxS@C (T == S), the ms a step needs to read its weights and S contexts of C."""
    w, per_token = weight_bytes(art), kv_bytes_per_token(art)
    out = {}
    for key in shapes:
        ts, _, c = key.partition("@")
        t, _, s = ts.partition("x")
        if t == s:
            out[key] = (w + int(s) * int(c) * per_token) / bandwidth * 1e3
    return {"weight_bytes": w, "kv_bytes_per_token": per_token, "ms": out}


def served(results: dict) -> dict:
    levels = [lv for lv in results.get("levels", []) if lv.get("system") == "hloserve" and lv.get("workload") == "main"]
    out = {}
    for lv in levels:
        c = lv.get("concurrency")
        out[f"c={c}"] = {k: lv.get(k) for k in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "itl_p50_ms", "requests")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="gpu_check.sh's OUT directory")
    ap.add_argument("art", help="the bf16 artifact the steps timed")
    ap.add_argument("--commit", default="?")
    ap.add_argument("--gpu", default="?")
    ap.add_argument("--served", help="benchmarks/serve.py's results.json of the served run")
    ap.add_argument("--anchors", help="an earlier run's step_vs_transformers.json (same GPU kind): its anchors "
                                      "stand in where this run has none, marked as taken from it")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    bw = load(os.path.join(args.out, "bandwidth.json"))
    steps = load(os.path.join(args.out, "step_vs_transformers.json"))
    quant = load(os.path.join(args.out, "quant_steps.json"))
    result = {"date": datetime.date.today().isoformat(), "gpu": args.gpu, "commit": args.commit,
              "copy_bandwidth_gb_s": bw.get("gb_s"), "model": steps.get("model")}
    ours = steps.get("hloserve", {})
    earlier = load(args.anchors) if args.anchors else {}
    for side in ("transformers", "compiled"):
        if not steps.get(side, {}).get("ms") and earlier.get(side, {}).get("ms"):
            steps[side] = dict(earlier[side], taken_from=f"an earlier run: {args.anchors}")
    taken = {side: steps[side]["taken_from"] for side in ("transformers", "compiled") if "taken_from" in steps.get(side, {})}
    bf16 = {"step_ms": ours.get("ms"), "xla_options": ours.get("best"), **({"anchors_from": taken} if taken else {}),
            "variants": {k: {kk: vv for kk, vv in v.items() if kk != "kernels"} for k, v in ours.get("variants", {}).items()},
            "anchors": {"transformers_eager_ms": steps.get("transformers", {}).get("ms"),
                        "torch_compile_static_ms": steps.get("compiled", {}).get("ms")}}
    if bw.get("gb_s") and os.path.isdir(args.art) and ours.get("ms"):
        try:
            bf16["floor"] = floors(args.art, bw["gb_s"] * 1e9, list(ours["ms"]))
        except Exception as e:          # the summary is a report: say why a part is missing
            bf16["floor"] = {"error": f"{type(e).__name__}: {e}"}
    if args.served:
        bf16["served"] = served(load(args.served))
    result["llama-1b"] = {"bf16": bf16}
    for path, table in quant.items():
        name = os.path.basename(path.rstrip("/"))
        precision = name.rsplit("-", 1)[-1] if "-" in name else "bf16"
        if precision in ("int8", "int4"):
            result["llama-1b"][precision] = {"step_ms": table}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
