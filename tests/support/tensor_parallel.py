"""Run an LLM artifact at several tensor-parallel sizes in one fresh process (N virtual CPU devices).

`tp_report(art, sizes, prompts, new_tokens)` returns, per size: the greedy tokens of every prompt
(the engine: scheduler, block manager, runner, all real), how much of each split weight and of the
KV cache every device holds (read from the device buffers), and the collectives in the compiled
decode and prefill steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CODE = r'''
import json, re, sys
from hloserve.runtime.client import host_devices
art, sizes, prompts, new_tokens = json.loads(sys.argv[1])
host_devices(max(sizes))
from hloserve.runtime.artifact import LLMSpec, read_manifest
from hloserve.server.config import ServeConfig
from hloserve.server.wiring import build_engine
from hloserve.server.core.sampling import SamplingParams

tp = LLMSpec.of(read_manifest(art), art).tensor_parallel
report = {}
for n in sizes:
    eng, _ = build_engine(art, ServeConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                           min_token_bucket=64, block_buckets=1, num_blocks=96, platform="cpu",
                                           tensor_parallel_size=n))
    eng.warmup()
    with eng:
        streams = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
                   for p in prompts]
        tokens = [[t for o in s for t in o.new_token_ids] for s in streams]
    runner = eng.runner
    split = {}   # weight -> sorted set of (shard size along its split dim / full size)
    absent = sorted(set(tp.weights) - set(runner.model.weights))   # names the spec lists but the artifact lacks
    for name, dim in tp.weights.items():
        if name in absent:
            continue
        a = runner.model.weights[name]
        split[name] = sorted({s.data.shape[dim] / a.shape[dim] for s in a.addressable_shards})
    kv = runner.kv_cache
    split["kv_cache"] = sorted({s.data.shape[tp.kv_cache_dim] / kv.shape[tp.kv_cache_dim] for s in kv.addressable_shards})
    hlo = {}
    for fn, f in runner.model.functions.items():
        text = "\n".join(f._executable(dict(env)).as_text() for env in f.compiled_shapes)
        hlo[fn] = {"all-reduce": len(re.findall(r" all-reduce\(", text)),
                   "all-gather": sorted(set(re.findall(r"= (\S+?)\{[^}]*\} all-gather\(", text)))}
    report[n] = {"tokens": tokens, "split": split, "absent": absent, "hlo": hlo, "vocab": runner.vocab_size,
                 "devices": len({d for d, _ in runner.device_memory()}),
                 "memory": {f"{d}/{k}": v for (d, k), v in runner.device_memory().items()},
                 "compiles_after_warmup": runner.stats()["compiles_after_warmup_total"]}
print("REPORT " + json.dumps(report))
'''


def tp_report(art: str, sizes: list[int], prompts: list[list[int]], new_tokens: int, *,
              timeout: float = 1200) -> dict[int, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _CODE, json.dumps([art, sizes, prompts, new_tokens])],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    if proc.returncode != 0 or line is None:
        raise AssertionError(f"tensor-parallel run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(line[len("REPORT "):]).items()}
