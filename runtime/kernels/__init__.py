"""Kernels for the artifact's composites (runtime/artifact/kernels.py), one backend per platform.

    backend = kernels.support("cpu", mesh=False)       # a KernelBackend, known before the artifact loads
    s = backend.specialize(exported)                    # runtime.load, per function: no platform branch

    backend.py     the KernelBackend protocol, Specialized, and Decompositions (no kernels)
    rewrite.py     the MLIR rewriting the backends share
    cpu/           C++ kernels, one .cc per composite; targets.py: one row per (name, version)
    pallas/        TPU (Mosaic) and GPU (Triton) kernels in Pallas; testable on a CPU in interpret mode

A composite no backend serves, and every composite over a mesh (a kernel is one device's code:
XLA cannot partition a custom call), runs the portable decomposition the artifact carries.
The backends never import this module (tests/test_layers.py).
"""
from __future__ import annotations

from typing import Callable

from . import pallas
from .backend import Decompositions, KernelBackend, Specialized, WeightLayout
from .cpu import CpuBackend, build
from .pallas import PallasBackend

__all__ = ["KernelBackend", "Specialized", "WeightLayout", "Decompositions", "CpuBackend", "PallasBackend", "support"]


def support(platform: str, *, mesh: bool, report: Callable[[str], None] | None = None,
            interpret: bool = False) -> KernelBackend:
    """The kernels a load on `platform` ("cpu", "gpu" or "tpu" as jax names it; "cuda" or "tpu" with
    `interpret`, to run that accelerator's Pallas kernels in interpret mode on this device) runs, one
    device only: the CPU's (built on first use), or the accelerator's Pallas kernels unless they are
    turned off (HLOSERVE_CPU_KERNELS=0, HLOSERVE_PALLAS_KERNELS=0)."""
    if mesh:
        return Decompositions()
    if platform == "cpu":
        library = build.library(report)
        return CpuBackend(library) if library is not None else Decompositions()
    lowering = pallas.LOWERING.get(platform)
    if lowering and pallas.enabled():
        return PallasBackend(lowering, interpret=interpret)
    return Decompositions()
