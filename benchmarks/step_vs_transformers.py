"""The LLM step through hloserve's runtime against transformers eager: same weights, shapes and device.

    python benchmarks/step_vs_transformers.py [--shape llama-1b] [--vocab 49152] [--layers N]
        [--shapes 1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024] [--repeats 20] [--device cuda|cpu]
        [--work DIR] [--json PATH]

A random-init model of one of serve.py's shapes (`SHAPES`; `--layers` cuts its depth, `--vocab`
sets its vocabulary, default SmolLM2's as serve.py uses), saved in bf16 as real checkpoints are,
is exported as `hloserve export DIR` does (bf16 weight matrices and KV cache under f32 activations)
and timed in two processes, one after the other, each with the device to itself:

  * hloserve: `runtime.load` on jax's default backend, the artifact's `decode` called at each shape
    TxS@C as benchmarks/step_shapes.py does (T tokens over S sequences with C tokens cached);
  * transformers eager (`--device`; bf16 on cuda, f32 on cpu; sdpa, DynamicCache): the same shapes:
    S sequences prefilled to C tokens untimed, then one forward of their next T/S tokens each
    (logits of the last only), the cache cropped back to C after every call.

Each call ends with the last-token logits on the host (hloserve's server samples there); each row
is the median of --repeats calls after warm ones, and the ratio transformers / hloserve (> 1:
hloserve is faster). Both sides also give the last-token logits of one random 256-token prompt at
context 0; their agreement is printed (not asserted: transformers computes in bf16 throughout,
hloserve in f32 over bf16 weights). A side that fails (e.g. the export under another torch) is
reported and the other side still runs. `--json` writes every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import HLOSERVE_CLI, SHAPES  # noqa: E402
from step_shapes import Timer, parse_shapes  # noqa: E402

SMOLLM2_VOCAB = 49152
PARITY_TOKENS = 256


def parity_prompt(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(3, vocab, PARITY_TOKENS).astype(np.int32)


def make_model_dir(shape: str, vocab: int, layers: int | None, path: str) -> str:
    """A random-init model of SHAPES[shape] (seed 0), stored in bf16 under `path`."""
    import torch
    import transformers
    cls_name, cfg_name, kw = SHAPES[shape]
    kw = dict(kw, **({"num_hidden_layers": layers} if layers else {}))
    config = getattr(transformers, cfg_name)(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # built in bf16: never held in f32
    try:
        model = getattr(transformers, cls_name)(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    return path


def time_hloserve(art: str, shapes, repeats: int) -> dict:
    """Per shape the median ms of `decode` through runtime.load, and the parity prompt's logits."""
    import jax
    timer = Timer(art, "decode", shapes)
    rows = {f"{T}x{S}@{C}": timer.time(T, S, C, repeats) for T, S, C in shapes}
    out = {"device": f"{jax.default_backend()} ({jax.devices()[0].device_kind})", "ms": rows,
           "compile_s": round(timer.fn.stats.compile_seconds, 1), "kernels": timer.fn.kernels}
    if (PARITY_TOKENS, 1, 0) in shapes:
        ins = dict(timer.inputs(PARITY_TOKENS, 1, 0), tokens=parity_prompt(timer.llm.vocab_size))
        res = timer.fn(**ins, **{timer.llm.kv_cache.input: timer.cache})
        out["parity_logits"] = np.asarray(res["logits"])[0].astype(np.float32).tolist()
    return out


def time_transformers(model_dir: str, shapes, repeats: int, device: str) -> dict:
    """The same shapes through transformers eager on `device` (bf16 on cuda, f32 on cpu)."""
    import torch
    import transformers
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = {}
    with torch.no_grad():
        for T, S, C in shapes:
            per = T // S
            past = None                 # context 0: each call starts a fresh cache
            if C:
                past = hf(torch.randint(3, vocab, (S, C), generator=gen).to(device), use_cache=True).past_key_values
            ids = torch.randint(3, vocab, (S, per), generator=gen).to(device)
            where = torch.arange(C, C + per, device=device)
            times = []
            for i in range(repeats + 3):
                t0 = time.perf_counter()
                logits = hf(ids, past_key_values=past, use_cache=True, cache_position=where, logits_to_keep=1).logits
                logits[:, -1].float().cpu()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
                if past is not None:
                    past.crop(-per)      # back to C tokens (a negative count: transformers >= 5.17)
            rows[f"{T}x{S}@{C}"] = statistics.median(times) * 1e3
        out = {"device": f"{device} ({torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'})",
               "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
               "transformers": transformers.__version__, "ms": rows}
        if (PARITY_TOKENS, 1, 0) in shapes:
            prompt = torch.from_numpy(parity_prompt(vocab)).long()[None].to(device)
            out["parity_logits"] = hf(prompt, logits_to_keep=1).logits[0, -1].float().cpu().tolist()
    return out


def run_side(side: str, args: argparse.Namespace, model_dir: str, art: str, work: str) -> dict:
    """One side in its own process (the device to itself); its result dict, or {'error': ...}."""
    out = os.path.join(work, f"{side}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model-dir", model_dir, "--artifact", art,
           "--shapes", args.shapes, "--repeats", str(args.repeats), "--device", args.device, "--json", out]
    print(f"[step_vs_transformers] {side}: {' '.join(cmd[1:3])} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    took = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit status {proc.returncode} after {took:.0f} s (its output is above)"}
    with open(out) as f:
        result = json.load(f)
    result["process_s"] = round(took, 1)
    print(f"[step_vs_transformers] {side} on {result['device']} in {took:.0f} s: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in result["ms"].items()), file=sys.stderr, flush=True)
    return result


def compare_logits(a: list, b: list) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
    return {"max_abs_diff": float(np.abs(a - b).max()), "max_abs_logit": float(np.abs(b).max()),
            "cosine": cos, "same_argmax": bool(a.argmax() == b.argmax()),
            "top5_overlap": len(set(np.argsort(-a)[:5]) & set(np.argsort(-b)[:5]))}


def report(result: dict, shapes) -> None:
    ours, theirs = result.get("hloserve", {}), result.get("transformers", {})
    print(f"\nmodel: {result['model']}")
    for name, side in (("hloserve", ours), ("transformers", theirs)):
        if "error" in side:
            print(f"{name}: FAILED: {side['error']}")
        else:
            extra = {k: v for k, v in side.items() if k not in ("ms", "parity_logits")}
            print(f"{name}: {extra}")
    print("\n| T x S @ context | hloserve ms | transformers eager ms | transformers / hloserve |\n|---|---|---|---|")
    for T, S, C in shapes:
        key = f"{T}x{S}@{C}"
        a, b = ours.get("ms", {}).get(key), theirs.get("ms", {}).get(key)
        ratio = f"{b / a:.2f}" if a and b else "-"
        print(f"| {T} x {S} @ {C} | {f'{a:.2f}' if a else '-'} | {f'{b:.2f}' if b else '-'} | {ratio} |")
    if "parity" in result:
        print(f"\nlast-token logits of a {PARITY_TOKENS}-token prompt, hloserve vs transformers: {result['parity']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, default=SMOLLM2_VOCAB)
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--shapes", default="1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="transformers' torch device (default %(default)s)")
    ap.add_argument("--work", default=None, help="directory for the model and artifact (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--side", choices=["hloserve", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)

    if args.side:                       # a child: one side, its numbers to --json
        result = (time_hloserve(args.artifact, shapes, args.repeats) if args.side == "hloserve"
                  else time_transformers(args.model_dir, shapes, args.repeats, args.device))
        with open(args.json, "w") as f:
            json.dump(result, f)
        return 0

    work = args.work or tempfile.mkdtemp(prefix="hloserve-step-vs-hf-")
    model_dir, art = os.path.join(work, "hf"), os.path.join(work, "art")
    layers = f", {args.layers} layers" if args.layers else ""
    result = {"model": f"random-init {args.shape}{layers}, vocabulary {args.vocab}, bf16 checkpoint", "shapes": args.shapes,
              "repeats": args.repeats}
    t0 = time.perf_counter()
    make_model_dir(args.shape, args.vocab, args.layers, model_dir)
    result["build_s"] = round(time.perf_counter() - t0, 1)
    print(f"[step_vs_transformers] built and saved the model in {result['build_s']} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", HLOSERVE_CLI, "export", model_dir, "-o", art])
    result["export_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode == 0:
        print(f"[step_vs_transformers] exported in {result['export_s']} s", file=sys.stderr, flush=True)
        result["hloserve"] = run_side("hloserve", args, model_dir, art, work)
    else:
        result["hloserve"] = {"error": f"`hloserve export` failed with exit status {proc.returncode} "
                                       f"after {result['export_s']} s (its output is above)"}
    result["transformers"] = run_side("transformers", args, model_dir, art, work)
    if "parity_logits" in result["hloserve"] and "parity_logits" in result["transformers"]:
        result["parity"] = compare_logits(result["hloserve"]["parity_logits"], result["transformers"]["parity_logits"])
    report(result, shapes)
    for side in ("hloserve", "transformers"):
        result[side].pop("parity_logits", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if "error" not in result["hloserve"] and "error" not in result["transformers"] else 1


if __name__ == "__main__":
    sys.exit(main())
