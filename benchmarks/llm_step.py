"""LLM step benchmark: hloserve's paged-cache step vs transformers eager, and scan vs unrolled layers.

    python benchmarks/llm_step.py [--model smollm2|random] [--steps N] [--skip-unrolled]
    python benchmarks/llm_step.py --generic      # the generic transformers step vs the hand-written one

Model: SmolLM2-135M-Instruct from the `smollm2-135m-instruct` preset GGUF, dequantized to
f32 (both sides run the same weights); `--model random` (or no GGUF loader) uses a
random-init model of the same config (hidden 576, 30 layers, 9 heads, 3 kv heads,
intermediate 1536, vocab 49152, tied embeddings).

Measured in one run, on whatever jax's default backend is:
  * decode step latency at batch 1, 8, 32 (context 120 tokens = 8 blocks of 16), ours through
    `hloserve.runtime.load` (cache donated, weights on device) vs transformers eager (sdpa,
    DynamicCache) doing the same one-token step; ratio = HF / ours (> 1: we are faster);
  * prefill throughput for one 512-token prompt, tokens/s, both sides;
  * layers scanned vs unrolled (decode function only): export time, StableHLO text and
    bytecode size, XLA compile time of one shape (persistent compile cache off), step latency.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from hloserve.exporter.models.llama import LlamaConfig, LlamaWeights, llm_spec
from hloserve.exporter.models.step import StepExportOptions
from hloserve.runtime.artifact.llm import pack_step

SMOLLM2_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                      rms_norm_eps=1e-5, rope_theta=100000.0, vocab_size=49152, max_position_embeddings=8192,
                      tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2)
BLOCK = 16
DECODE_CONTEXT = 120     # tokens already in each sequence: 8 blocks of 16 after the new one
PREFILL_LEN = 512


def load_model(kind: str):
    """(HF config dict, HF state dict, description)."""
    if kind == "smollm2":
        try:
            from hloserve.exporter import presets
            from hloserve.exporter.models.gguf import load_gguf
            ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
            sd = ckpt.materialize(reporter=_quiet())
            return dict(ckpt.config), sd, "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to f32)"
        except ImportError as e:
            print(f"[llm_step] GGUF loader unavailable ({e}); using a random-init model", file=sys.stderr)
    import transformers
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_CONFIG))
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    return dict(SMOLLM2_CONFIG), sd, "random-init model of the SmolLM2-135M config"


def _quiet():
    from hloserve.runtime.progress import QUIET
    return QUIET


def hf_model(config: dict, sd: dict):
    import transformers
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def export(weights: LlamaWeights, out: str, *, scan: bool, functions=("prefill", "decode")) -> float:
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.models.llama import step_entries
    opts = StepExportOptions(block_size=BLOCK, max_context=2048, scan=scan)
    entries = [e for e in step_entries(weights, opts) if e.name in functions]
    t0 = time.perf_counter()
    export_artifact(out, entries, source="benchmark", model={"task": "causal-lm",
                                                             "llm": llm_spec(weights.cfg, opts, torch.float32).to_json()})
    return time.perf_counter() - t0


def timed(fn, steps: int) -> float:
    """Median seconds of fn() over `steps` runs after one warm run."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class OurDecode:
    """Decode steps of `batch` sequences at DECODE_CONTEXT through the runtime (cache donated)."""

    def __init__(self, model, cfg: LlamaConfig, batch: int, fn: str = "decode"):
        import jax.numpy as jnp

        from hloserve.runtime.artifact.llm import LLMSpec
        self.fn = model.functions[fn]
        blocks_per_seq = -(-(DECODE_CONTEXT + 1) // BLOCK)
        num_blocks = batch * blocks_per_seq + 1
        kv = LLMSpec.from_json(model.manifest.model["llm"]).kv_cache if model.manifest.model.get("llm") else None
        self.cache = jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, BLOCK, cfg.head_dim),
                               kv.numpy_dtype if kv is not None else jnp.float32)
        tables = [list(range(1 + s * blocks_per_seq, 1 + (s + 1) * blocks_per_seq)) for s in range(batch)]
        self.inputs = pack_step([([5 + s], DECODE_CONTEXT, tables[s]) for s in range(batch)], BLOCK)

    def __call__(self):
        out = self.fn(**self.inputs, kv_cache=self.cache)
        self.cache = out["kv_cache"]
        return np.asarray(out["logits"])       # waits for the step


def hf_decode(hf, batch: int, vocab: int):
    """transformers eager: one-token steps of `batch` sequences after a DECODE_CONTEXT prefill."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, DECODE_CONTEXT), generator=g)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    state = {"past": out.past_key_values, "pos": DECODE_CONTEXT}
    nxt = torch.full((batch, 1), 5)

    def step():
        with torch.no_grad():
            o = hf(nxt, past_key_values=state["past"], use_cache=True,
                   cache_position=torch.tensor([state["pos"]]))
        state["pos"] += 1
        return o.logits
    return step


def pick_torch_threads(hf, vocab: int) -> int:
    """Give the baseline its best thread count: intra-op threads can be far slower than one
    thread on a busy machine (OpenMP barriers), so time one batch-8 decode step both ways."""
    best = None
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        t = timed(hf_decode(hf, 8, vocab), 2)
        if best is None or t < best[1]:
            best = (n, t)
    torch.set_num_threads(best[0])
    return best[0]


def compare_layouts(weights: LlamaWeights, out: str) -> None:
    """One artifact with the three attention layouts as functions; time a prompt and a mixed step."""
    import jax.numpy as jnp
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.models.llama import step_entries
    from hloserve.runtime import load
    cfg = weights.cfg
    layouts = ("flat", "gather", "paged")
    opts = StepExportOptions(block_size=BLOCK, max_context=2048, functions=tuple((a, a) for a in layouts))
    export_artifact(out, step_entries(weights, opts), source="benchmark")
    model = load(out, cache_dir=None)
    g = np.random.default_rng(0)
    cases = {
        "one 512-token prompt (S=1, 32 blocks)": [(g.integers(3, cfg.vocab_size, 512).tolist(), 0, list(range(1, 33)))],
        "31 decodes at context 1000 + one 256-token chunk (S=32, T=287)":
            [([5], 1000, list(range(1 + 64 * s, 64 + 64 * s))) for s in range(31)]
            + [(g.integers(3, cfg.vocab_size, 256).tolist(), 700, list(range(1 + 64 * 31, 64 + 64 * 31)))],
    }
    print("\nattention layouts (every one exact for any step), median of 3 after one warm call:")
    for name, chunks in cases.items():
        inputs = pack_step(chunks, BLOCK)
        row = []
        for att in layouts:
            state = {"cache": jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, 64 * 32 + 1, BLOCK, cfg.head_dim),
                                        jnp.float32)}

            def call():
                o = model.functions[att](**inputs, kv_cache=state["cache"])
                state["cache"] = o["kv_cache"]
                return np.asarray(o["logits"])
            row.append(f"{att} {timed(call, 3):.2f} s")
        print(f"  {name}: " + ", ".join(row))


def compare_generic(args, cfg: LlamaConfig, hf, tmp: str) -> int:
    """The same HF directory exported both ways (--llm-step llama / generic), timed in one process."""
    import jax.numpy as jnp
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load
    from hloserve.runtime.artifact.llm import LLMSpec

    hf_dir = os.path.join(tmp, "hf")
    hf.save_pretrained(hf_dir)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (PREFILL_LEN,), generator=g).tolist()
    blocks = PREFILL_LEN // BLOCK
    batches = [int(x) for x in args.batches.split(",")]
    print(f"\ngeneric step (transformers' code, attention interface) vs hand-written Llama step; decode at "
          f"context {DECODE_CONTEXT}, prefill of one {PREFILL_LEN}-token prompt; median of {args.steps}:")
    print(f"  {'weights/KV':>10}  {'step':>11}  {'export s':>8}  " + "  ".join(f"{'decode b=' + str(b):>12}" for b in batches)
          + f"  {'prefill ms':>10}")
    rows = {}
    for label, kw in (("f32", {}), ("bf16", dict(weight_dtype="bfloat16", kv_cache_dtype="bfloat16"))):
        for step in ("llama", "generic"):
            out = os.path.join(tmp, f"{step}-{label}")
            t0 = time.perf_counter()
            src = load_source(hf_dir, llm_step=step, **kw)
            entries = src.entries
            export_artifact(out, entries, source="benchmark", model=src.model, files=src.files,
                            weight_quant=getattr(src, "weight_quant", None))
            export_s = time.perf_counter() - t0
            model = load(out, cache_dir=None, buckets={"num_tokens": sorted({*batches, PREFILL_LEN}),
                                                       "num_seqs": sorted({1, *batches}), "max_blocks": [8, 32]})
            decode = [timed(OurDecode(model, cfg, b), args.steps) for b in batches]
            kv = LLMSpec.from_json(model.manifest.model["llm"]).kv_cache
            inputs = pack_step([(prompt, 0, list(range(1, blocks + 1)))], BLOCK)
            state = {"cache": jnp.zeros(kv.concrete_shape(blocks + 1), kv.numpy_dtype)}

            def prefill():
                o = model.functions["prefill"](**inputs, kv_cache=state["cache"])
                state["cache"] = o["kv_cache"]
                return np.asarray(o["logits"])
            pre = timed(prefill, max(3, args.steps // 3))
            rows[label, step] = (decode, pre)
            print(f"  {label:>10}  {step:>11}  {export_s:>8.1f}  " + "  ".join(f"{d * 1e3:>12.2f}" for d in decode)
                  + f"  {pre * 1e3:>10.1f}", flush=True)
            model = None
            shutil.rmtree(out, ignore_errors=True)
        (dl, pl), (dg, pg) = rows[label, "llama"], rows[label, "generic"]
        print(f"  {label:>10}  {'generic/llama':>11}  {'':>8}  " + "  ".join(f"{g_ / l_:>12.2f}" for g_, l_ in zip(dg, dl))
              + f"  {pg / pl:>10.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "random"])
    ap.add_argument("--steps", type=int, default=10, help="timed repetitions per measurement (median)")
    ap.add_argument("--skip-unrolled", action="store_true", help="skip the scan vs unrolled comparison")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--generic", action="store_true",
                    help="only compare the generic transformers step (models/hf_causal.py) with the hand-written "
                         "Llama step, f32 and bf16 weights + KV cache")
    ap.add_argument("--layouts", action="store_true",
                    help="also time the flat / gather / paged attention layouts on a prompt and a mixed step")
    args = ap.parse_args(argv)

    import jax

    config, sd, desc = load_model(args.model)
    cfg = LlamaConfig.from_hf(config)
    weights = LlamaWeights.from_hf_tensors(cfg, sd.__getitem__, sd.keys())
    hf = hf_model(config, sd)
    del sd
    threads = pick_torch_threads(hf, cfg.vocab_size)
    print(f"model: {desc}; backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"torch threads {threads} (the faster of 1 and {os.cpu_count()}), load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")

    tmp = tempfile.mkdtemp(prefix="hloserve-llm-bench-")
    try:
        if args.generic:
            return compare_generic(args, cfg, hf, tmp)
        return _run(args, cfg, weights, hf, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # artifacts of ~0.5 GiB each


def _run(args, cfg: LlamaConfig, weights: LlamaWeights, hf, tmp: str) -> int:
    import jax.numpy as jnp
    from hloserve.runtime import load

    secs = export(weights, os.path.join(tmp, "scan"), scan=True)
    print(f"export (prefill + decode, scanned layers): {secs:.1f} s")
    model = load(os.path.join(tmp, "scan"), cache_dir=None,
                 buckets={"num_tokens": [1, 8, 32, PREFILL_LEN], "num_seqs": [1, 8, 32], "max_blocks": [8, 32]})

    print("\ndecode step latency (context %d tokens), median of %d:" % (DECODE_CONTEXT, args.steps))
    print(f"  {'batch':>5}  {'hloserve ms':>12}  {'HF eager ms':>12}  {'HF/ours':>8}  {'tok/s ours':>10}")
    for b in [int(x) for x in args.batches.split(",")]:
        ours = timed(OurDecode(model, cfg, b), args.steps)
        theirs = timed(hf_decode(hf, b, cfg.vocab_size), args.steps)
        print(f"  {b:>5}  {ours * 1e3:>12.2f}  {theirs * 1e3:>12.2f}  {theirs / ours:>8.2f}  {b / ours:>10.0f}")

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (PREFILL_LEN,), generator=g).tolist()
    blocks = PREFILL_LEN // BLOCK
    inputs = pack_step([(prompt, 0, list(range(1, blocks + 1)))], BLOCK)
    state = {"cache": jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, blocks + 1, BLOCK, cfg.head_dim), jnp.float32)}

    def ours_prefill():
        out = model.functions["prefill"](**inputs, kv_cache=state["cache"])
        state["cache"] = out["kv_cache"]
        return np.asarray(out["logits"])

    def hf_prefill():
        with torch.no_grad():
            return hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1).logits

    ours = timed(ours_prefill, max(3, args.steps // 3))
    theirs = timed(hf_prefill, max(3, args.steps // 3))
    print(f"\nprefill, one {PREFILL_LEN}-token prompt: hloserve {PREFILL_LEN / ours:.0f} tok/s ({ours * 1e3:.0f} ms), "
          f"HF eager {PREFILL_LEN / theirs:.0f} tok/s ({theirs * 1e3:.0f} ms), ratio HF/ours {theirs / ours:.2f}")
    compile_s = {n: f.stats.compile_seconds for n, f in model.functions.items()}
    print("compile seconds so far (all shapes): " + ", ".join(f"{n} {s:.1f}" for n, s in compile_s.items()))
    model = None   # frees the artifact's weights before the next export

    if args.layouts:
        compare_layouts(weights, os.path.join(tmp, "layouts"))
    if args.skip_unrolled:
        return 0
    print(f"\nlayers scanned vs unrolled ({cfg.num_layers} layers, decode function, batch 8):")
    rows = {}
    for scan in (True, False):
        out = os.path.join(tmp, "scan-decode" if scan else "unrolled-decode")
        export_s = export(weights, out, scan=scan, functions=("decode",))
        text = os.path.getsize(os.path.join(out, "functions", "decode.mlir"))
        bc = os.path.getsize(os.path.join(out, "functions", "decode.mlirbc"))
        m = load(out, cache_dir=None, buckets={"num_tokens": [8], "num_seqs": [8], "max_blocks": [8]})
        step = OurDecode(m, cfg, 8)
        t0 = time.perf_counter()
        m.warmup(sizes={"num_blocks": [int(step.cache.shape[2])]})
        compile_s = time.perf_counter() - t0
        latency = timed(step, args.steps)
        rows[scan] = (export_s, text, bc, compile_s, latency)
        del m, step
    print(f"  {'':>9}  {'export s':>9}  {'.mlir KiB':>10}  {'.mlirbc KiB':>11}  {'compile s':>9}  {'step ms':>8}")
    for scan, (e, t, b, c, lat) in rows.items():
        print(f"  {'scanned' if scan else 'unrolled':>9}  {e:>9.1f}  {t / 1024:>10.0f}  {b / 1024:>11.0f}  {c:>9.2f}  "
              f"{lat * 1e3:>8.2f}")
    s, u = rows[True], rows[False]
    print(f"  compile time scanned/unrolled = {s[3] / u[3]:.3f} (target <= 0.25); "
          f"StableHLO text scanned/unrolled = {s[1] / u[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
