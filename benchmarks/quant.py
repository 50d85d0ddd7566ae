"""Quantization benchmark: size, quality and decode speed of SmolLM2-135M-Instruct artifacts,
MiniLM int8 embedding similarity, and the in-graph dequantization formulations on XLA.

    python benchmarks/quant.py [--out DIR] [--variants f32,bf16w,int8,int4-g32,int4-g128,gguf|formats]
                               [--source S] [--skip-ppl] [--skip-speed] [--skip-minilm] [--skip-micro]
                               [--window 256] [--max-tokens N] [--steps 300] [--rounds 20] [--batches 1,16]

    # every format a user serves, one table (docs/quantization.md, "Every format in one run"):
    python benchmarks/quant.py --variants formats --batches 1,16 --skip-minilm --skip-micro

All measured on jax's default backend (CPU here); runs into the same --out add up in its
results.json (perplexity in one run, speed in another: the artifacts are exported once):
  * variants of the `smollm2-135m-instruct` preset (the Q4_1 GGUF): f32 = the GGUF dequantized
    (the float reference), bf16w = its weight matrices stored in bf16 (`--weight-dtype bfloat16`,
    what `hloserve serve` serves), int8 / int4-g32 (asymmetric, the default) / int4-g32-sym (scales
    searched for least squared error) / int4-g32-sym-minmax (llama.cpp's Q4_0 rule) / int4-g128
    = requantized from that f32 (g128 falls back to g64 where the input dim is 576), gguf = the
    file's own Q4_1 (layers) and Q8_0 (tied embedding) blocks imported as int4 g32 asym / int8 g32;
    `--source` takes another GGUF of the same model instead (e.g. a K-quant file made by
    llama-quantize), whose f32 is then that file dequantized; bf16 = bf16 weights and KV (what
    `hloserve serve` serves), bf16-kvint8 = the same with `--kv-cache-dtype int8`;
  * made from the preset first (MADE): q4_k_m = its matrices requantized as llama.cpp's Q4_K_M
    (the K-quant blocks kept), ct-w4a16-g64 / ct-w8a8 = compressed-tensors checkpoints of its bf16
    weights as llm-compressor writes them (tests/support: the same makers the tests use);
  * artifact bytes (weights.safetensors + functions/), and the ratio to f32;
  * perplexity on tests/data/web_genesis.txt (World English Bible, Genesis 1-19, public domain)
    through the exported `decode` function via hloserve.runtime: each window of W tokens is one
    step in which token i is the last token of its own "sequence" i, all sequences sharing one
    block table, so token i attends to tokens 0..i and its logits predict token i+1 (exact causal
    LM scoring, logits of every position in one call). Windows do not overlap and each starts
    with an empty context;
  * decode tokens/s at each of --batches sequences (1: the latency of one request; 16: what a busy
    server's decode step gives): one token per sequence and step at context 120 .. 120+steps
    (runtime, cache donated), median and 10th/90th percentile step latency; the variants run interleaved
    (--rounds rounds of steps/rounds steps each) so load from other processes on a shared
    machine falls on all of them alike;
  * MiniLM (all-MiniLM-L6-v2): cosine similarity of mean-pooled sentence embeddings, int8 vs f32;
  * micro: a 30-layer SmolLM2-shaped stack of 4 GEMVs under lax.scan at batch 1 in several
    dequantization formulations (f32, dequantize-then-dot, scale after the dot, unrolled int8,
    int8 x int8 dot with dynamic activation quantization, int4 g32 interleaved vs even/odd
    halves), and the 49152 x 576 LM head GEMV (f32, int8 whole, int8 in row blocks). "ours" is
    the lowering in exporter/composites/quant_linear.py called directly.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from hloserve.runtime.artifact.llm import LLMSpec, pack_step
from hloserve.runtime.artifact.manifest import read_manifest
from hloserve.runtime.artifact.text import TextSpec

# variant -> load_source options
VARIANTS = {"f32": {}, "bf16w": {"weight_dtype": "bfloat16"}, "int8": {"quantize": "int8"},
            "int8-channel": {"quantize": "int8:channel"},
            "int4-g32": {"quantize": "int4:32"}, "int4-g32-sym": {"quantize": "int4:32:sym"},
            "int4-g32-sym-minmax": {"quantize": "int4:32:sym:minmax"}, "int4-g128": {"quantize": "int4:128"},
            "gguf": {"quantize": "gguf"},
            # what `hloserve serve` serves (bf16 weights and KV), and the same with the int8 KV cache
            "bf16": {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
            "bf16-kvint8": {"weight_dtype": "bfloat16", "kv_cache_dtype": "int8"},
            # the quantized weights with bf16's KV cache (the variants above keep it in f32): the same
            # cache as "bf16", so that decode speeds at many sequences compare the weights alone
            "int8-kvbf16": {"quantize": "int8", "kv_cache_dtype": "bfloat16"},
            "int4-g32-kvbf16": {"quantize": "int4:32", "kv_cache_dtype": "bfloat16"},
            "int4-g32-sym-kvbf16": {"quantize": "int4:32:sym", "kv_cache_dtype": "bfloat16"}}
# variants whose source is made from the preset first (made_source): a Q4_K_M GGUF as llama.cpp's
# llama-quantize lays it out, and compressed-tensors checkpoints as llm-compressor writes them
MADE = {"q4_k_m": {"quantize": "gguf"},
        "ct-w4a16-g64": {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
        "ct-w8a8": {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}}
# `--variants formats`: one row per format a user would serve (docs/quantization.md, "Every format in one run")
FORMATS = "f32,bf16,bf16-kvint8,int8,int4-g32,gguf,q4_k_m,ct-w4a16-g64,ct-w8a8"
TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "web_genesis.txt")
BLOCK = 16


def export_variant(name: str, out: str, source: str = "smollm2-135m-instruct") -> dict:
    """Export the decode function of SmolLM2 (from `source`, or the source made_source makes for a
    MADE variant) in one variant (reused when already there)."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source

    if os.path.exists(os.path.join(out, "manifest.json")):
        return {"export_s": None}
    t = time.perf_counter()
    if name in MADE:
        source = made_source(name, out + ".source", source)
    src = load_source(source, **(MADE.get(name) or VARIANTS[name]))
    entries = [e for e in src.entries if e.name == "decode"]
    export_artifact(out, entries, source=f"{source} ({name})", model=src.model, files=src.files,
                    weight_quant=src.weight_quant)
    return {"export_s": time.perf_counter() - t}


def made_source(name: str, root: str, source: str) -> str:
    """The checkpoint a MADE variant exports, made from `source` (a GGUF or the preset) in `root`: its
    matrices requantized as Q4_K_M (tests/support/kquants.py), or its f32 weights in bf16 quantized
    by compressed-tensors as llm-compressor does (tests/support/ct_checkpoints.py; the tied embedding
    left 16-bit there, stored once in int8 by the import)."""
    import shutil

    import torch
    import transformers

    from hloserve.exporter import presets
    from hloserve.exporter.gguf.checkpoint import load_gguf, write_hf_directory
    from hloserve.runtime.progress import QUIET
    from tests.support import ct_checkpoints, kquants

    gguf_path = presets.resolve(source, quiet=True) if not source.endswith(".gguf") else source
    os.makedirs(root, exist_ok=True)
    if name == "q4_k_m":
        out = os.path.join(root, "model.Q4_K_M.gguf")
        kquants.q4_k_m_copy(gguf_path, out)
        return out
    gg = load_gguf(gguf_path)
    hf_dir = write_hf_directory(gg, os.path.join(root, "hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(None, config=transformers.AutoConfig.from_pretrained(hf_dir),
                                                       state_dict=gg.materialize(QUIET), dtype=torch.bfloat16)
    path = ct_checkpoints.make_checkpoint(root, name.removeprefix("ct-").replace("-", "_"), model=hf.eval())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(hf_dir, f), path)
    return path


def artifact_bytes(path: str) -> int:
    total = os.path.getsize(os.path.join(path, "weights.safetensors"))
    fdir = os.path.join(path, "functions")
    return total + sum(os.path.getsize(os.path.join(fdir, f)) for f in os.listdir(fdir))


def text_tokens(path: str) -> list[int]:
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(TextSpec.of(read_manifest(path), path).tokenizer_path(path))
    with open(TEXT) as f:
        return tok.encode(f.read()).ids


def window_inputs(window: list[int]) -> dict[str, np.ndarray]:
    """One step scoring every position of `window` (see the module docstring)."""
    W = len(window)
    nb = -(-W // BLOCK)
    table = np.arange(1, nb + 1, dtype=np.int32)                          # blocks 1..nb, 0 is null
    pos = np.arange(W, dtype=np.int32)
    return dict(tokens=np.asarray(window, np.int32), positions=pos, seq_ids=pos.copy(),
                slot_mapping=(table[pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int32),
                block_tables=np.broadcast_to(table, (W, nb)).copy(), context_lens=pos + 1, last_token=pos.copy())


def perplexity(path: str, window: int, max_tokens: int | None) -> dict:
    import jax.numpy as jnp
    from hloserve.runtime import load

    ids = text_tokens(path)
    if max_tokens:
        ids = ids[:max_tokens]
    nb = -(-window // BLOCK)
    m = load(path, buckets={"num_tokens": [window], "num_seqs": [window], "max_blocks": [nb]})
    llm = m.manifest.model["llm"]
    decode = m.functions["decode"]
    nll, count = 0.0, 0
    t = time.perf_counter()
    for start in range(0, len(ids) - window + 1, window):
        w = ids[start:start + window]
        cache = jnp.zeros(LLMSpec.from_json(llm).kv_cache.concrete_shape(nb + 1), LLMSpec.from_json(llm).kv_cache.numpy_dtype)
        logits = np.asarray(decode(**window_inputs(w), kv_cache=cache)["logits"], np.float64)   # [W, V]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(window - 1), w[1:]].sum())
        count += window - 1
    return {"ppl": float(np.exp(nll / count)), "scored_tokens": count, "text_tokens": len(ids),
            "ppl_s": time.perf_counter() - t}


class _Decoder:
    """One variant's decode function at `batch` sequences, each stepping one token at a time from
    `context` on in its own blocks."""

    def __init__(self, path: str, context: int, max_steps: int, batch: int = 1):
        import jax.numpy as jnp
        from hloserve.runtime import load

        self.context, self.nb, self.batch = context, -(-(context + max_steps + 1) // BLOCK), batch
        m = load(path, buckets={"num_tokens": [batch], "num_seqs": [batch], "max_blocks": [self.nb]})
        kv = LLMSpec.from_json(m.manifest.model["llm"]).kv_cache
        self.decode = m.functions["decode"]
        self.cache = jnp.zeros(kv.concrete_shape(batch * self.nb + 1), kv.numpy_dtype)
        self.tables = [list(range(1 + b * self.nb, 1 + (b + 1) * self.nb)) for b in range(batch)]
        self.pos, self.toks = context, [1 + b for b in range(batch)]

    def step(self) -> float:
        inputs = pack_step([([t], self.pos, table) for t, table in zip(self.toks, self.tables)], BLOCK,
                           pad_blocks=self.nb)
        t = time.perf_counter()
        out = self.decode(**inputs, kv_cache=self.cache)
        out["logits"].block_until_ready()
        dt = time.perf_counter() - t
        self.cache = out["kv_cache"]
        self.toks = [int(i) for i in np.argmax(np.asarray(out["logits"]), axis=-1)[:self.batch]]
        self.pos += 1
        return dt


def decode_speed(paths: dict[str, str], steps: int, context: int = 120, rounds: int = 20,
                 batch: int = 1) -> dict[str, dict]:
    """Decode step latency per variant at `batch` sequences, interleaved: `rounds` rounds, each running
    steps/rounds steps of every variant in turn, so a busy moment of a shared machine hits all
    variants alike. Keys: decode_ms (batch 1) or decode{batch}_ms, and the like."""
    decoders = {v: _Decoder(p, context, steps + 2, batch) for v, p in paths.items()}
    for d in decoders.values():      # compile + warm up
        d.step(), d.step()
    times: dict[str, list[float]] = {v: [] for v in decoders}
    per = max(1, steps // rounds)
    for i in range(rounds):
        for v, d in decoders.items():
            times[v] += [d.step() for _ in range(per)]
        print(f"[quant] decode b={batch} round {i + 1}/{rounds}: " + ", ".join(
            f"{v} {statistics.median(ts[-per:]) * 1e3:.1f} ms" for v, ts in times.items()), file=sys.stderr, flush=True)
    tag = "decode" if batch == 1 else f"decode{batch}"
    out = {}
    for v, ts in times.items():
        med = statistics.median(ts)
        p10, p90 = np.percentile(ts, [10, 90])
        out[v] = {f"{tag}_ms": med * 1e3, f"{tag}_min_ms": min(ts) * 1e3, f"{tag}_p10_ms": p10 * 1e3,
                  f"{tag}_p90_ms": p90 * 1e3, f"{tag}_tokens_per_s": batch / med, f"{tag}_steps": len(ts)}
    return out


def minilm_similarity(out: str) -> dict:
    """Mean-pooled MiniLM embeddings of a few sentences, int8 artifact vs f32 artifact."""
    import tokenizers

    from hloserve.exporter import presets
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    sentences = ["In the beginning God created the heavens and the earth.",
                 "The quick brown fox jumps over the lazy dog.",
                 "Weight-only quantization stores int8 values with one scale per output channel.",
                 "A man is playing a guitar on the street.",
                 "Paris is the capital of France.",
                 "How do I export a PyTorch model to StableHLO?",
                 "The weather will be sunny tomorrow with a light breeze.",
                 "She sold seashells by the seashore."]
    hf_dir = presets.resolve("all-minilm-l6-v2")
    tok = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    tok.enable_padding(pad_id=0)
    enc = tok.encode_batch(sentences)
    ids = np.asarray([e.ids for e in enc], np.int32)
    mask = np.asarray([e.attention_mask for e in enc], np.int32)
    embs, sizes = {}, {}
    for name, q in (("f32", None), ("int8", "int8")):
        path = os.path.join(out, f"minilm-{name}")
        if not os.path.exists(os.path.join(path, "manifest.json")):
            src = load_source("all-minilm-l6-v2", quantize=q)
            export_artifact(path, src.entries, source=f"all-minilm-l6-v2 ({name})", model=src.model,
                            weight_quant=src.weight_quant)
        m = load(path)
        fn = m.functions["forward"]
        names = [t.name for t in fn.spec.inputs]
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = np.asarray(fn(**{k: feed[k] for k in names})["last_hidden_state"])   # [B, S, 384]
        e = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        embs[name] = e / np.linalg.norm(e, axis=-1, keepdims=True)
        sizes[name] = artifact_bytes(path)
    cos = (embs["f32"] * embs["int8"]).sum(-1)
    return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "sentences": len(sentences),
            "bytes_f32": sizes["f32"], "bytes_int8": sizes["int8"]}


# -- micro: formulations of the dequantization on XLA ---------------------------------------
def micro(steps: int = 30) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from hloserve.exporter.composites.quant_linear import _lower_quantized_linear as _quantized_linear, dequantize
    from hloserve.quantization import primitives
    from hloserve.quantization.schemes import INT8, WeightScheme

    L, H, I, QKV = 30, 576, 1536, 960
    shapes = [(QKV, H), (H, H), (2 * I, H), (H, I)]
    rng = np.random.default_rng(0)
    W = [(rng.standard_normal((L, o, i)) * 0.05).astype(np.float32) for o, i in shapes]
    q8 = [primitives.quantize(w, INT8) for w in W]
    q4 = [primitives.quantize(w, WeightScheme(4, 32, True, "f16")) for w in W]
    x = rng.standard_normal((1, H)).astype(np.float32)
    dn = (((1,), (1,)), ((), ()))

    def layer(h, lin, ws):
        a = lin(h, ws[0])[:, :H]
        h = h + lin(a, ws[1])
        g = lin(h, ws[2])
        return h + 0.1 * lin(jax.nn.silu(g[:, :I]) * g[:, I:], ws[3])

    def stack(lin, scan=True):
        def f(h, ws):
            if scan:
                return lax.scan(lambda h, w: (layer(h, lin, w), None), h, ws)[0]
            for i in range(L):
                h = layer(h, lin, jax.tree.map(lambda a: a[i], ws))
            return h
        return jax.jit(f)

    def f32(x, w):
        return lax.dot_general(x, w, dn)

    def deq_dot(x, w):          # what composites/quant_linear.py emits
        q, s = w
        return lax.dot_general(x, dequantize(q, s, None, 8, 0), dn)

    def scale_after(x, w):      # per-channel scale moved past the dot
        q, s = w
        return lax.dot_general(x, q.astype(jnp.float32), dn) * s

    def i8_dot(x, w):           # dynamic per-token activation quantization, int32 accumulation
        q, s = w
        xs = jnp.max(jnp.abs(x), -1, keepdims=True) / 127.0
        xq = jnp.round(x / jnp.where(xs == 0, 1.0, xs)).astype(jnp.int8)
        return lax.dot_general(xq, q, dn, preferred_element_type=jnp.int32).astype(jnp.float32) * xs * s

    class _Ctx:   # what the lowering reads from its LoweringContext
        out_dtype = jnp.float32

    def ours(bits, group):
        def lin(x, w):
            return _quantized_linear(_Ctx, x, w[0], w[1], None, None, bits, group)
        return lin

    def int4_interleaved(x, w):   # unpack to element order first (a concatenate XLA does not fuse)
        p, s = w
        return lax.dot_general(x, dequantize(p, s, None, 4, 32), dn)

    V = 49152                    # the tied LM head, outside the scan
    head = (rng.standard_normal((V, H)) * 0.05).astype(np.float32)
    head8 = primitives.quantize(head, INT8)
    head8 = (jnp.asarray(head8.qweight), jnp.asarray(head8.scale))

    w8 = [(jnp.asarray(a.qweight), jnp.asarray(a.scale)) for a in q8]
    w4 = [(jnp.asarray(a.qweight), jnp.asarray(a.scale)) for a in q4]
    cases = {"f32 scan": (stack(f32), [jnp.asarray(w) for w in W]),
             "f32 unrolled": (stack(f32, False), [jnp.asarray(w) for w in W]),
             "int8 dequantize-then-dot, scan (ours)": (stack(ours(8, 0)), w8),
             "int8 scale after dot, scan": (stack(scale_after), w8),
             "int8 dequantize-then-dot, unrolled": (stack(deq_dot, False), w8),
             "int8 x int8 dot (dynamic act. quant), scan": (stack(i8_dot), w8),
             "int4 g32 interleaved unpack-then-dot, scan": (stack(int4_interleaved), w4),
             "int4 g32 even/odd halves, two dots, scan (ours)": (stack(ours(4, 32)), w4),
             "LM head 49152x576 f32": (jax.jit(f32), jnp.asarray(head)),
             "LM head int8 dequantize-then-dot (whole)": (jax.jit(deq_dot), head8),
             "LM head int8 row blocks in a loop (ours)": (jax.jit(ours(8, 0)), head8)}
    res = {}
    for name, (fn, ws) in cases.items():
        fn(x, ws).block_until_ready()
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            fn(x, ws).block_until_ready()
            ts.append(time.perf_counter() - t)
        res[name] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/hloserve-quant-bench")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, or `formats` for one row per servable format ({FORMATS})")
    ap.add_argument("--source", default="smollm2-135m-instruct",
                    help="the SmolLM2 checkpoint: the preset (default) or another GGUF file of it")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batches", default="1", help="decode batch sizes timed, e.g. 1,16")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-minilm", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import jax
    saved = os.path.join(args.out, "results.json")     # runs into one --out add up (e.g. ppl, then speed)
    results: dict = json.load(open(saved)) if os.path.exists(saved) else {"variants": {}}
    results.update(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()])
    variants = (FORMATS if args.variants == "formats" else args.variants).split(",")
    unknown = [v for v in variants if v not in VARIANTS and v not in MADE]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}: use {', '.join([*VARIANTS, *MADE])} or `formats`")
    label = "smollm2" if args.source == "smollm2-135m-instruct" else os.path.basename(args.source).removesuffix(".gguf")
    paths = {v: os.path.join(args.out, f"{label}-{v}") for v in variants}
    for v, path in paths.items():
        r = results["variants"].setdefault(v, {})
        r.update({k: x for k, x in export_variant(v, path, args.source).items() if x is not None})
        r["bytes"] = artifact_bytes(path)
        print(f"[quant] {v}: exported, {r['bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        if not args.skip_ppl:
            r.update(perplexity(path, args.window, args.max_tokens))
            print(f"[quant] {v}: ppl {r['ppl']:.4f}", file=sys.stderr, flush=True)
        json.dump(results, open(saved, "w"), indent=2)
    if not args.skip_speed:
        for batch in (int(b) for b in args.batches.split(",")):
            for v, r in decode_speed(paths, args.steps, rounds=args.rounds, batch=batch).items():
                results["variants"][v].update(r)
            json.dump(results, open(saved, "w"), indent=2)
    if not args.skip_minilm:
        results["minilm"] = minilm_similarity(args.out)
    if not args.skip_micro:
        results["micro"] = micro()
    json.dump(results, open(saved, "w"), indent=2)
    print(json.dumps(results, indent=2))
    print(table(results["variants"], variants))
    return 0


def table(rows: dict[str, dict], order: list[str]) -> str:
    """The markdown table of `order`'s rows: size and perplexity against f32, decode speed against bf16
    (the served default) where those rows were measured."""
    nan = float("nan")
    f32, bf16 = rows.get("f32", {}), rows.get("bf16", {})

    def ratio(r: dict, base: dict, key: str) -> float:
        return r[key] / base[key] if key in r and key in base else nan

    lines = ["| variant | MiB | vs f32 | perplexity | vs f32 | b=1 ms/token p50 [p10, p90] | vs bf16 | "
             "b=16 tokens/s | vs bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for v in order:
        r = rows[v]
        lines.append(
            f"| {v} | {r['bytes'] / 2**20:.1f} | {ratio(r, f32, 'bytes'):.3f} | {r.get('ppl', nan):.3f} | "
            f"{ratio(r, f32, 'ppl'):.4f} | {r.get('decode_ms', nan):.2f} [{r.get('decode_p10_ms', nan):.1f}, "
            f"{r.get('decode_p90_ms', nan):.1f}] | {ratio(r, bf16, 'decode_ms'):.2f}x | "
            f"{r.get('decode16_tokens_per_s', nan):.1f} | {ratio(r, bf16, 'decode16_tokens_per_s'):.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
