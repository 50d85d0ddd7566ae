"""The LLM step through hloserve's runtime against transformers eager and compiled: same weights, shapes, device.

    python benchmarks/step_vs_transformers.py [--shape llama-1b] [--vocab 49152] [--layers N]
        [--shapes 1x1@300,16x16@300,64x64@300,256x1@0,256x1@1024] [--repeats 20] [--device cuda|cpu]
        [--sides hloserve,transformers,compiled] [--variants default,linear-kernel,dsfusion]
        [--work DIR] [--json PATH] [--tokenizer-dir TOK] [--side-timeout S]

A random-init model of one of serve.py's shapes (`SHAPES`; `--layers` cuts its depth, `--vocab`
sets its vocabulary, default SmolLM2's as serve.py uses), saved in bf16 as real checkpoints are,
is exported as `hloserve export DIR` does (bf16 weight matrices and KV cache under f32 activations)
and timed in one process per side, one after the other, each with the device to itself:

  * hloserve: `runtime.load` on jax's default backend, the artifact's `decode` called at each shape
    TxS@C as benchmarks/step_shapes.py does (T tokens over S sequences with C tokens cached), once
    per variant of --variants (`VARIANTS`: XLA options through $HLOSERVE_XLA_OPTIONS, the GPU's
    layer_linear kernel on or off) at the decode shapes, each with a jax profile of ten calls of
    the first: kernels per step, the share of the step some device stream is busy and the kernels
    that take the most time; the fastest variant then also at the prompt-chunk shapes;
  * transformers eager (`--device`; bf16 on cuda, f32 on cpu; sdpa, DynamicCache): the same shapes:
    S sequences prefilled to C tokens untimed, then one forward of their next T/S tokens each
    (logits of the last only), the cache cropped back to C after every call;
  * compiled: transformers with a static KV cache and its forward under
    torch.compile(mode="reduce-overhead") (CUDA graphs on a GPU), the decode shapes only.

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
import shutil
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


# What the hloserve side can time side by side (--variants): each a set of environment variables its
# load reads. HLOSERVE_XLA_OPTIONS: XLA options compiled into the executables (runtime.client);
# HLOSERVE_GPU_LAYER_LINEAR=1: a GPU runs layer_linear through its Triton kernel (off by default).
UNROLL = "xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"
GRAPHS = "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL;xla_gpu_graph_min_graph_size=1"
# cuBLAS reads a layer's weights where they lie in the stacked [layers, ...] array instead of a copy
# kernel slicing them out first (the scanned step's dynamic-slice feeding each GEMM)
DSFUSION = "xla_gpu_enable_dynamic_slice_fusion=True"
KERNEL = {"HLOSERVE_GPU_LAYER_LINEAR": "1"}
VARIANTS = {
    "default": {},
    "unroll": {"HLOSERVE_XLA_OPTIONS": UNROLL},
    "graphs": {"HLOSERVE_XLA_OPTIONS": GRAPHS},
    "unroll+graphs": {"HLOSERVE_XLA_OPTIONS": f"{UNROLL};{GRAPHS}"},
    "dsfusion": {"HLOSERVE_XLA_OPTIONS": DSFUSION},
    "unroll+dsfusion": {"HLOSERVE_XLA_OPTIONS": f"{UNROLL};{DSFUSION}"},
    "linear-kernel": KERNEL,
    "linear-kernel+dsfusion": {**KERNEL, "HLOSERVE_XLA_OPTIONS": DSFUSION},
}
VARIANT_ENV = ("HLOSERVE_XLA_OPTIONS", "HLOSERVE_GPU_LAYER_LINEAR")


def use_variant(name: str) -> None:
    """Set the variant's environment (and clear what other variants set)."""
    for key in VARIANT_ENV:
        os.environ.pop(key, None)
    os.environ.update(VARIANTS[name])


def describe(name: str) -> str:
    return " ".join(f"{k}={v!r}" for k, v in VARIANTS[name].items()) or "defaults"


def device_profile(timer: Timer, shape: tuple[int, int, int], steps: int = 10) -> dict:
    """`steps` calls of `shape` under jax's profiler: per step the device's kernels (and copies), the
    time some stream is busy, and the wall time; {} where the trace has no device plane (CPU)."""
    import glob
    import jax
    from jax.profiler import ProfileData
    T, S, C = shape
    timer.time(T, S, C, 1)                                   # warm: nothing compiles inside the trace
    trace = tempfile.mkdtemp(prefix="hloserve-trace-")
    jax.profiler.start_trace(trace)
    wall = timer.time(T, S, C, steps - 1) / 1e3              # `steps` calls, the median of the last steps - 1
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}
    spans, kernels, copies, names, by_name = [], 0, 0, set(), {}
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            names.add(f"{plane.name}: {line.name}")
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
                n, t = by_name.get(e.name[:100], (0, 0))
                by_name[e.name[:100]] = (n + 1, t + e.duration_ns)
                if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                    copies += 1
                else:
                    kernels += 1
    if not spans:
        return {"device_lines": sorted(names)[:20]} if names else {}
    spans.sort()
    busy, end = 0, spans[0][0]
    for a, b in spans:                                       # the union of the streams' busy intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"shape": f"{T}x{S}@{C}", "kernels_per_step": kernels / steps, "copies_per_step": copies / steps,
            "device_busy_ms_per_step": busy / steps / 1e6, "wall_ms_per_step": wall * 1e3,
            "busy_share": busy / steps / 1e9 / wall,
            "top": [{"name": k, "per_step": n / steps, "us_per_step": t / steps / 1e3}     # where the device time goes
                    for k, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]]}


def time_hloserve(art: str, shapes, repeats: int, variants: list[str], save=None) -> dict:
    """Per variant the median ms of `decode` through runtime.load at each decode shape (T == S), with
    a device profile of the first; then the fastest variant at the prompt-chunk shapes (T > S) and the
    parity prompt's logits. `save(out)` after each variant: a variant that kills the process (a kernel
    the device's compiler crashes on) leaves the ones before it on disk."""
    import jax
    out = {"device": f"{jax.default_backend()} ({jax.devices()[0].device_kind})", "variants": {}}
    decodes = [sh for sh in shapes if sh[0] == sh[1]] or shapes[:1]
    timers = {}
    for name in variants:
        use_variant(name)
        print(f"[step_vs_transformers] hloserve, variant {name!r}: {describe(name)}", file=sys.stderr, flush=True)
        try:
            timer = Timer(art, "decode", shapes)
            rows = {f"{T}x{S}@{C}": timer.time(T, S, C, repeats) for T, S, C in decodes}
            result = {"ms": rows, "compile_s": round(timer.fn.stats.compile_seconds, 1), "kernels": timer.fn.kernels}
            try:
                result["profile"] = device_profile(timer, decodes[0])
            except Exception as e:   # the profiler is a report, not the measurement
                result["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            timers[name] = timer
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"[step_vs_transformers] variant {name!r}: {result}", file=sys.stderr, flush=True)
        out["variants"][name] = result
        if save:
            save(out)
    if not timers:
        return out
    # the first decode shape decides (one decoding sequence), then the next
    best = min(timers, key=lambda k: tuple(out["variants"][k]["ms"].values()))
    use_variant(best)                                          # (read at load; set for any later load)
    timer = timers[best]
    rows = out["variants"][best]["ms"]
    for T, S, C in shapes:
        if f"{T}x{S}@{C}" not in rows:
            rows[f"{T}x{S}@{C}"] = timer.time(T, S, C, repeats)
    out["variants"][best]["compile_s"] = round(timer.fn.stats.compile_seconds, 1)
    out.update(best=best, ms={f"{T}x{S}@{C}": rows[f"{T}x{S}@{C}"] for T, S, C in shapes})
    if (PARITY_TOKENS, 1, 0) in shapes:
        ins = dict(timer.inputs(PARITY_TOKENS, 1, 0), tokens=parity_prompt(timer.llm.vocab_size))
        res = timer.fn(**ins, **{timer.llm.kv_cache.input: timer.cache})
        out["parity_logits"] = np.asarray(res["logits"])[0].astype(np.float32).tolist()
    for key in VARIANT_ENV:
        os.environ.pop(key, None)
    return out


def _hf_model(model_dir: str, device: str):
    """(model, dtype) of transformers on `device`: bf16 on cuda, f32 on cpu."""
    import torch
    import transformers
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval(), dtype


def time_compiled(model_dir: str, shapes, repeats: int, device: str) -> dict:
    """The decode shapes (T == S) through transformers with a static KV cache under
    torch.compile(mode="reduce-overhead") (CUDA graphs on a GPU): the gpt-fast class of decoder."""
    import torch
    import transformers
    hf, dtype = _hf_model(model_dir, device)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    step = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    rows, compile_s = {}, {}
    with torch.no_grad():
        for T, S, C in shapes:
            if T != S:
                continue
            cache = transformers.StaticCache(config=hf.config, max_cache_len=C + repeats + 8)
            hf(torch.randint(3, vocab, (S, C), generator=gen).to(device), past_key_values=cache, use_cache=True,
               cache_position=torch.arange(C, device=device), logits_to_keep=1)        # prefill, eager
            ids = torch.randint(3, vocab, (S, 1), generator=gen).to(device)
            times = []
            t_first = time.perf_counter()
            for i in range(repeats + 3):
                pos = torch.tensor([C + i], device=device)
                t0 = time.perf_counter()
                logits = step(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos,
                              position_ids=pos.expand(S, 1), logits_to_keep=1).logits
                logits[:, -1].float().cpu()
                if i == 2:
                    compile_s[f"{T}x{S}@{C}"] = round(time.perf_counter() - t_first, 1)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            rows[f"{T}x{S}@{C}"] = statistics.median(times) * 1e3
            print(f"[step_vs_transformers] compiled {T}x{S}@{C}: {rows[f'{T}x{S}@{C}']:.2f} ms "
                  f"(first 3 calls, compile included, {compile_s[f'{T}x{S}@{C}']} s)", file=sys.stderr, flush=True)
    return {"device": f"{device} ({torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'})",
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__, "ms": rows, "compile_s": compile_s}


def time_transformers(model_dir: str, shapes, repeats: int, device: str) -> dict:
    """The same shapes through transformers eager on `device` (bf16 on cuda, f32 on cpu)."""
    import torch
    import transformers
    hf, dtype = _hf_model(model_dir, device)
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
           "--shapes", args.shapes, "--repeats", str(args.repeats), "--device", args.device, "--json", out,
           "--variants", args.variants] + (["--compiled-shapes", args.compiled_shapes]
                                                    if args.compiled_shapes else [])
    print(f"[step_vs_transformers] {side}: {' '.join(cmd[1:3])} ...", file=sys.stderr, flush=True)
    if os.path.exists(out):
        os.remove(out)                          # an earlier run's numbers are not this one's
    t0 = time.perf_counter()
    limits = dict(p.split("=") if "=" in p else (side, p) for p in (args.side_timeout or "").split(",") if p)
    limit = float(limits[side]) if side in limits else None
    try:
        proc = subprocess.run(cmd, timeout=limit)
        status = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc, status = None, f"killed at its --side-timeout of {limit:.0f} s"
    took = time.perf_counter() - t0
    if not os.path.exists(out):
        return {"error": f"{status} after {took:.0f} s (its output is above)"}
    with open(out) as f:
        result = json.load(f)
    if proc is None or proc.returncode != 0:      # what it saved before it died (hloserve: each variant)
        result["error"] = f"{status} after {took:.0f} s (its output is above); what it saved before is kept"
    result["process_s"] = round(took, 1)
    print(f"[step_vs_transformers] {side} on {result['device']} in {took:.0f} s: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in result.get("ms", {}).items()), file=sys.stderr, flush=True)
    return result


def compare_logits(a: list, b: list) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
    return {"max_abs_diff": float(np.abs(a - b).max()), "max_abs_logit": float(np.abs(b).max()),
            "cosine": cos, "same_argmax": bool(a.argmax() == b.argmax()),
            "top5_overlap": len(set(np.argsort(-a)[:5]) & set(np.argsort(-b)[:5]))}


def report(result: dict, shapes) -> None:
    ours, eager, compiled = (result.get(k, {}) for k in ("hloserve", "transformers", "compiled"))
    print(f"\nmodel: {result['model']}")
    for name, side in (("hloserve", ours), ("transformers", eager), ("compiled", compiled)):
        if "error" in side:
            print(f"{name}: FAILED: {side['error']}")
        elif side:
            extra = {k: v for k, v in side.items() if k not in ("ms", "parity_logits", "variants")}
            print(f"{name}: {extra}")
    variants = ours.get("variants", {})
    if variants:
        print("\nhloserve by variant (ms; kernels and device busy share of one step of the first shape):\n")
        keys = [f"{T}x{S}@{C}" for T, S, C in shapes]
        print("| variant | " + " | ".join(keys) + " | kernels / step | device busy | compile s |")
        print("|---" * (len(keys) + 4) + "|")
        for name, v in variants.items():
            if "error" in v:
                print(f"| {name} | FAILED: {v['error'][:200]} |")
                continue
            cells = [f"{v['ms'][key]:.2f}" if key in v["ms"] else "-" for key in keys]
            prof = v.get("profile", {})
            k = f"{prof['kernels_per_step']:.0f}" if "kernels_per_step" in prof else "-"
            b = f"{prof['busy_share']:.0%}" if "busy_share" in prof else "-"
            print(f"| {name} | " + " | ".join(cells) + f" | {k} | {b} | {v['compile_s']} |")
        if "best" in ours:
            print(f"\nfastest variant: {ours['best']} ({describe(ours['best'])})")
    print("\n| T x S @ context | hloserve ms | transformers eager ms | eager / hloserve | torch.compile static ms "
          "| compiled / hloserve |\n|---|---|---|---|---|---|")
    for T, S, C in shapes:
        key = f"{T}x{S}@{C}"
        a, b, c = (side.get("ms", {}).get(key) for side in (ours, eager, compiled))
        cells = [f"{x:.2f}" if x else "-" for x in (a, b)] + [f"{b / a:.2f}" if a and b else "-"]
        cells += [f"{c:.2f}" if c else "-", f"{c / a:.2f}" if a and c else "-"]
        print(f"| {T} x {S} @ {C} | " + " | ".join(cells) + " |")
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
    ap.add_argument("--tokenizer-dir", help="copy this tokenizer (the same vocabulary) into the model, so that "
                                            "the artifact can be served")
    ap.add_argument("--after-build", help="a shell command started in the background once the model is saved "
                                          "(e.g. more exports of it, beside the bf16 one and the device's timing)")
    ap.add_argument("--variants", default="default",
                    help=f"hloserve: environment sets to time side by side, comma-separated ({', '.join(VARIANTS)})")
    ap.add_argument("--sides", default="hloserve,transformers",
                    help="which to run: hloserve, transformers (eager), compiled (static cache under "
                         "torch.compile reduce-overhead; decode shapes only)")
    ap.add_argument("--compiled-shapes", default=None,
                    help="the decode shapes the compiled side times (default: every T == S shape of --shapes; "
                         "each batch size is one more torch.compile)")
    ap.add_argument("--side-timeout", default=None,
                    help="seconds each side's process may take: one number, or side=S pairs (hloserve=170,compiled=90)")
    ap.add_argument("--side", choices=["hloserve", "transformers", "compiled"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [
        s for s in args.sides.split(",") if s not in ("hloserve", "transformers", "compiled")]
    if unknown:
        ap.error(f"unknown --variants / --sides entries: {', '.join(unknown)}")

    if args.side:                       # a child: one side, its numbers to --json
        if args.side == "hloserve":
            result = time_hloserve(args.artifact, shapes, args.repeats, variants,
                                   save=lambda partial: json.dump(partial, open(args.json, "w")))
        elif args.side == "compiled":
            result = time_compiled(args.model_dir, parse_shapes(args.compiled_shapes or args.shapes), args.repeats,
                                   args.device)
        else:
            result = time_transformers(args.model_dir, shapes, args.repeats, args.device)
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
    sides = args.sides.split(",")
    if args.after_build:
        subprocess.Popen(args.after_build, shell=True)
    if args.tokenizer_dir:              # a servable artifact: the same vocabulary's tokenizer beside the weights
        for name in os.listdir(args.tokenizer_dir):
            if name not in ("config.json", "generation_config.json") and not name.endswith(".safetensors"):
                shutil.copy(os.path.join(args.tokenizer_dir, name), model_dir)
    if "hloserve" in sides:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", HLOSERVE_CLI, "export", model_dir, "-o", art])
        result["export_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode == 0:
            print(f"[step_vs_transformers] exported in {result['export_s']} s", file=sys.stderr, flush=True)
            result["hloserve"] = run_side("hloserve", args, model_dir, art, work)
        else:
            result["hloserve"] = {"error": f"`hloserve export` failed with exit status {proc.returncode} "
                                           f"after {result['export_s']} s (its output is above)"}
    for side in ("transformers", "compiled"):
        if side in sides:
            result[side] = run_side(side, args, model_dir, art, work)
    if "parity_logits" in result.get("hloserve", {}) and "parity_logits" in result.get("transformers", {}):
        result["parity"] = compare_logits(result["hloserve"]["parity_logits"], result["transformers"]["parity_logits"])
    report(result, shapes)
    for side in ("hloserve", "transformers"):
        result.get(side, {}).pop("parity_logits", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if not any("error" in result.get(side, {}) for side in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
