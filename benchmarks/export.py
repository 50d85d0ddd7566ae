"""Export benchmarks: time, peak memory and StableHLO size.

    .venv/bin/python benchmarks/export.py                 # everything below
    .venv/bin/python benchmarks/export.py scan            # one or more of: scan minilm llama-1b

* scan: a 24-layer residual-MLP stack (hidden 256) written with torch `scan` over
  stacked weights vs the same stack unrolled vs one layer: .mlir bytes, StableHLO
  op count, and XLA (CPU) compile time of the exported module.
* minilm, llama-1b: `export_artifact` of all-MiniLM-L6-v2 (f32) and of a
  random-init ~1B-parameter Llama built directly in bf16. Each runs in its own
  subprocess so its peak RSS (VmHWM) is its own; weights must
  stream to disk, so peak RSS should stay at most 1.5x the weight bytes (for
  MiniLM the interpreter's own ~1 GB dominates, so the increment over the
  RSS before the model was built is reported as well).

Progress goes to stderr; tables (markdown, as in docs/performance.md) go to stdout.
Artifacts are written to a temporary directory under $HLOSERVE_BENCH_DIR (default:
the system temp dir) and removed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, vocab_size=32000,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)
GiB = 2**30
BENCHES = ("scan", "minilm", "llama-1b")


def _rss_now() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    # VmHWM is this address space's peak; ru_maxrss survives exec and would include the forking parent
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- scan vs unrolled --------------------------------------------------------
def residual_mlp_stack(layers: int, hidden: int, scanned: bool):
    """A stack of pre-norm residual MLP layers over stacked weights [layers, ...]."""
    import torch
    from torch._higher_order_ops.scan import scan

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.norm = torch.nn.Parameter(torch.ones(layers, hidden))
            self.w1 = torch.nn.Parameter(torch.randn(layers, hidden, 4 * hidden, generator=g) / hidden ** 0.5)
            self.b1 = torch.nn.Parameter(torch.zeros(layers, 4 * hidden))
            self.w2 = torch.nn.Parameter(torch.randn(layers, 4 * hidden, hidden, generator=g) / (4 * hidden) ** 0.5)
            self.b2 = torch.nn.Parameter(torch.zeros(layers, hidden))

        @staticmethod
        def layer(h, norm, w1, b1, w2, b2):
            x = torch.nn.functional.rms_norm(h, (h.shape[-1],), norm)
            return h + (torch.nn.functional.gelu(x @ w1 + b1) @ w2 + b2) / layers

        def forward(self, h):                      # h: (B, hidden)
            ws = (self.norm, self.w1, self.b1, self.w2, self.b2)
            if scanned:
                h, _ = scan(lambda c, w: (self.layer(c, *w), c.new_zeros(())), h, ws)
                return h
            for i in range(layers):
                h = self.layer(h, *(w[i] for w in ws))
            return h

    return Stack()


def stablehlo_op_count(text: str) -> int:
    """Operations in a .mlir module (`%x = stablehlo.op` and result-less `stablehlo.op`)."""
    return len(re.findall(r"^\s*(?:%[^=]+=\s*)?\"?(?:stablehlo|chlo|func|shape)\.\w+", text, re.M))


def bench_scan(batch: int = 8, hidden: int = 256, repeats: int = 3) -> list[dict]:
    import jax
    import torch
    from jax import export as jax_export

    from hloserve.exporter.export import EntryPoint, export_artifact

    jax.jit(lambda x: x + 1).lower(np.ones(2, np.float32)).compile()  # warm XLA up once
    rows = []
    for name, layers, scanned in (("1 layer", 1, False), ("24 layers, scan", 24, True),
                                  ("24 layers, unrolled", 24, False)):
        model = residual_mlp_stack(layers, hidden, scanned)
        x = torch.randn(batch, hidden)
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            export_artifact(out, [EntryPoint("forward", model, (x,), ({0: torch.export.Dim("batch", max=64)},))],
                            source="benchmarks/export.py")
            export_s = time.perf_counter() - t0
            with open(os.path.join(out, "functions", "forward.mlir")) as f:
                text = f.read()
            with open(os.path.join(out, "functions", "forward.jax_exported"), "rb") as f:
                exported = jax_export.deserialize(bytearray(f.read()))
            mlirbc = os.path.getsize(os.path.join(out, "functions", "forward.mlirbc"))
        avals = [jax.ShapeDtypeStruct(tuple(p.shape), np.float32) for p in model.parameters()]
        avals.append(jax.ShapeDtypeStruct((batch, hidden), np.float32))
        compile_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.jit(exported.call).trace(*avals).lower().compile()  # a fresh jit: no executable cache hit
            compile_s.append(time.perf_counter() - t0)
        row = dict(name=name, layers=layers, export_s=export_s, mlir_bytes=len(text), mlirbc_bytes=mlirbc,
                   ops=stablehlo_op_count(text), whiles=text.count("stablehlo.while"), compile_s=min(compile_s))
        _log(f"{name}: export {export_s:.2f}s, .mlir {len(text) / 1024:.1f} KiB, {row['ops']} ops, "
             f"XLA compile (batch {batch}) {row['compile_s']:.3f}s")
        rows.append(row)
    return rows


# -- memory: one model per subprocess ------------------------------------------
def _build_llama_1b():
    import torch
    import transformers

    from hloserve.exporter.sources import hf_entry

    config = transformers.LlamaConfig(**LLAMA_1B)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)   # parameters are created (and initialized) in bf16: no f32 copy
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(prev)
    entry, meta = hf_entry(model, config)
    return entry, meta, "random-init Llama (bf16)"


def _build_minilm():
    from hloserve.exporter import presets
    from hloserve.exporter.sources import load_source
    src = load_source(presets.resolve("all-minilm-l6-v2"))
    return src.entries[0], src.model, "all-MiniLM-L6-v2 (f32)"


def child(name: str) -> dict:
    """Build one model and export it, in this process; returns the measurements."""
    import torch  # noqa: F401 - everything is imported before the baseline RSS is taken
    import transformers  # noqa: F401

    from hloserve.exporter import sources  # noqa: F401
    from hloserve.exporter.export import export_artifact
    from hloserve.runtime.progress import Reporter

    rss_imports = _rss_now()
    t0 = time.perf_counter()
    entry, meta, desc = {"minilm": _build_minilm, "llama-1b": _build_llama_1b}[name]()
    build_s = time.perf_counter() - t0
    module = entry.module
    params = sum(p.numel() for p in module.parameters())
    unique = {t.data_ptr(): t for t in module.state_dict(keep_vars=True).values()}  # tied weights once
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    rss_model = _rss_now()
    _log(f"{desc}: {params / 1e6:.0f}M params, {weight_bytes / GiB:.2f} GiB weights, built in {build_s:.1f}s, "
         f"RSS {rss_model / GiB:.2f} GiB")
    with tempfile.TemporaryDirectory(dir=os.environ.get("HLOSERVE_BENCH_DIR")) as out:
        t0 = time.perf_counter()
        export_artifact(out, [entry], source=name, model=meta, reporter=Reporter(prefix=f"export {name}"))
        export_s = time.perf_counter() - t0
        file_bytes = os.path.getsize(os.path.join(out, "weights.safetensors"))
    peak = _peak_rss()
    return dict(model=name, description=desc, params=params, weight_bytes=weight_bytes, file_bytes=file_bytes,
                build_s=build_s, export_s=export_s, rss_imports=rss_imports, rss_model=rss_model, peak_rss=peak,
                peak_over_weights=peak / weight_bytes, increment_over_weights=(peak - rss_imports) / weight_bytes)


def bench_memory(name: str) -> dict:
    _log(f"{name}: exporting in a subprocess")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name],
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: export subprocess failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> str:
    import psutil
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / GiB:.0f} GiB RAM"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", nargs="*", help="any of: " + " ".join(BENCHES) + " (default: all)")
    p.add_argument("--child", choices=["minilm", "llama-1b"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.which = args.which or list(BENCHES)
    unknown = sorted(set(args.which) - set(BENCHES))
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    print(f"machine: {_machine()}; {time.strftime('%Y-%m-%d')}")
    if "scan" in args.which:
        rows = bench_scan()
        print("| stack | .mlir | .mlirbc | StableHLO ops | stablehlo.while | export | XLA compile (CPU, batch 8) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['mlir_bytes'] / 1024:.1f} KiB | {r['mlirbc_bytes'] / 1024:.1f} KiB | {r['ops']} | "
                  f"{r['whiles']} | {r['export_s']:.2f} s | {r['compile_s']:.3f} s |")
    mem = [bench_memory(n) for n in ("minilm", "llama-1b") if n in args.which]
    if mem:
        print("| model | params | weights | build | export time | RSS after imports | RSS after build | peak RSS | "
              "peak / weights | (peak - imports) / weights |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in mem:
            print(f"| {r['description']} | {r['params'] / 1e6:.0f}M | {r['weight_bytes'] / GiB:.2f} GiB | "
                  f"{r['build_s']:.1f} s | {r['export_s']:.1f} s | {r['rss_imports'] / GiB:.2f} GiB | "
                  f"{r['rss_model'] / GiB:.2f} GiB | {r['peak_rss'] / GiB:.2f} GiB | "
                  f"{r['peak_over_weights']:.2f}x | {r['increment_over_weights']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
