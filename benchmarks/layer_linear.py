"""hloserve.layer_linear by itself: the CPU kernel against XLA's dot (the composite's decomposition),
per matrix shape and row count, in TFLOP/s.

    PYTHONPATH=.hl:. python benchmarks/layer_linear.py [--shapes 576x576,1536x576,576x1536]
                                                       [--rows 64,128,256,512,2048] [--repeats 7] [--tiles]

A shape is NxK (the matrix's output rows x input columns; bf16, a stack of 2 layers). Every row
count runs the kernel here (the targets table's row limit set aside: this is what sets it) and the
decomposition, alternately call by call; each prints the median of --repeats calls after one
untimed one (and the fastest, the machine being shared), and the kernel's speed-up (medians).
`--tiles` times the kernel over the matrix laid out as B tiles (`hloserve_layer_linear_tiles`, as
runtime.load lays a stack out where this CPU's kernels read tiles) instead of the rows kernel.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

SMOLLM2 = "576x576,192x576,1536x576,576x1536"          # SmolLM2-135M: q/o, k/v, gate/up, down
LLAMA_1B = "2048x2048,512x2048,8192x2048,2048x8192"    # Llama 3.2 1B: q/o, k/v, gate/up, down


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=f"{SMOLLM2},{LLAMA_1B}")
    ap.add_argument("--rows", default="64,128,256,512,2048")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiles", action="store_true", help="the kernel reads the matrix laid out as B tiles")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jax import export

    from hloserve.exporter import _private
    from hloserve.exporter.composites.layer_linear import layer_linear_reference
    from hloserve.runtime import kernels
    from hloserve.runtime.artifact.kernels import LAYER_LINEAR
    from hloserve.runtime.kernels.cpu import build, layouts, targets

    lib = build.library()
    if lib is None:
        raise SystemExit("the CPU kernels did not build here")
    row = targets.TARGETS[LAYER_LINEAR.key]
    targets.TARGETS[LAYER_LINEAR.key] = dataclasses.replace(row, max_rows_for=lambda cpu, attrs, shapes: None)
    backend, portable = kernels.CpuBackend(lib), kernels.Decompositions()
    rng = np.random.default_rng(0)
    print(f"{'N x K':>11} {'rows':>5} {'kernel ms':>10} {'XLA ms':>9} {'kernel TF/s':>12} {'XLA TF/s':>9} {'speed-up':>8}"
          f" {'fastest: kernel':>16} {'XLA':>6}")
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w = np.asarray(jnp.asarray(rng.standard_normal((2, N, K)).astype(np.float32) / np.sqrt(K))
                       .astype(jnp.bfloat16).view(jnp.int16))

        def f(x, w, layer):
            return _private.composite(layer_linear_reference, LAYER_LINEAR.name, LAYER_LINEAR.version)(
                x, w, layer, holds=1)
        (m,) = export.symbolic_shape("M")
        exp = export.export(jax.jit(f), platforms=("cpu",))(
            jax.ShapeDtypeStruct((m, K), np.float32), jax.ShapeDtypeStruct(w.shape, w.dtype),
            jax.ShapeDtypeStruct((), np.int32))
        spec = backend.specialize(exp, laid_out=frozenset({1}) if args.tiles else frozenset())
        assert spec.kernels == 1
        print(f"{shape}: the targets table's limit on this CPU: "
              f"{row.limit(build.cpu(), {'holds': 1}, ((None, K), w.shape, ()))} rows")
        fns = {"kernel": jax.jit(spec.exported.call), "xla": jax.jit(portable.specialize(exp).exported.call)}
        wd = jax.device_put(w)
        wk = jax.device_put(np.ascontiguousarray(layouts.B_TILES.arrange(w)).view(w.dtype).reshape(w.shape)
                            if args.tiles else w)
        for rows in (int(r) for r in args.rows.split(",")):
            x = jax.device_put(rng.standard_normal((rows, K)).astype(np.float32))
            times = {name: [] for name in fns}
            operand = {"kernel": wk, "xla": wd}
            for name, fn in fns.items():
                fn(x, operand[name], np.int32(1)).block_until_ready()
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(x, operand[name], np.int32(1)).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            k, x_ = statistics.median(times["kernel"]), statistics.median(times["xla"])
            flops = 2.0 * rows * N * K
            print(f"{shape:>11} {rows:>5} {k * 1e3:10.3f} {x_ * 1e3:9.3f} {flops / k / 1e12:12.2f} "
                  f"{flops / x_ / 1e12:9.2f} {x_ / k:7.2f}x {min(times['kernel']) * 1e3:16.3f} "
                  f"{min(times['xla']) * 1e3:6.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
