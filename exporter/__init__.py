"""hloserve.exporter: torch.export ExportedProgram -> StableHLO artifact.

Pipeline (each stage is one module):
  sources.py      checkpoint -> torch.nn.Module + example inputs + dynamic_shapes
  capture.py      torch.export + core-ATen decompositions -> ExportedProgram
  interpreter.py  FX graph -> jax function, one lowering per op (lowerings/)
  shapes.py       torch symbolic dims/ranges -> one jax symbolic scope
  export.py       jax.export of every entry point, weights streamed to safetensors, the manifest
                  written through hloserve.runtime.artifact (the format's one owner)
"""
