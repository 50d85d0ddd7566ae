"""hloserve's CPU kernels (C++, one file per composite: paged_attention.cc, linear.cc,
quant_linear.cc over common.h) as a kernel backend.

    backend = CpuBackend(build.library(report))       # built once per machine (build.py)
    s = backend.specialize(exported)                  # each composite with a row in targets.py -> its FFI call
    backend.layouts(exported)                         # {input: layouts.B_TILES} where AMX reads them

`specialize` replaces each composite the library has a kernel for by an FFI custom call to it, in
this process's copy of the function only, and every other composite by a call of its
decomposition: the artifact keeps the portable decomposition, which a CPU without a compiler (or
with HLOSERVE_CPU_KERNELS=0) runs. Where a kernel beats XLA only up to a number of rows
(targets.py) and the rows are symbolic, both are emitted under a predicate that is constant once
the function is compiled for a shape (XLA keeps only the branch taken).

On a CPU with AMX, a bf16 weight stack read only by `hloserve.layer_linear` composites is offered
laid out as B tiles (layouts.py); where runtime.load lays it out, its readers call
`hloserve_layer_linear_tiles` at every row count (the decomposition could not read it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hloserve.runtime.artifact.kernels import LAYER_LINEAR

from ..backend import Specialized, WeightLayout
from ..rewrite import Dataflow, composite_of, custom_call, decomposition_call, read, rewrite, swap
from . import build, layouts
from .build import Library
from .targets import LAYER_LINEAR_TILES, TARGETS


@dataclasses.dataclass(frozen=True)
class CpuBackend:
    library: Library
    name: str = "cpu"

    @property
    def composites(self) -> frozenset[tuple[str, int]]:
        return frozenset(TARGETS)

    def runs(self, name: str, version: int) -> bool:
        return (name, version) in TARGETS

    def layouts(self, exported: Any) -> dict[int, WeightLayout]:
        if not build.cpu().has("amx_bf16"):
            return {}

        def tiles_read(api, flow: Dataflow, op, n: int, index: int) -> bool:
            info = composite_of(api, op)
            return (info.key == LAYER_LINEAR.key and info.attributes.get("holds") == 1
                    and n == len(op.operands) - len(info.operands) + 1             # the weights operand
                    and layouts.b_tiles_fit(_shapes(api, [op.operands[n]])[0])
                    and flow.sources(op.operands[n]) == {index})

        def offer(api) -> dict[int, WeightLayout]:
            flow = Dataflow(api, exported.module_kept_var_idx)
            out = {}
            for index in flow.inputs.values():
                readers = flow.readers(index)
                if readers and all(tiles_read(api, flow, op, n, index) for op, n in readers):
                    out[index] = layouts.B_TILES
            return out

        return read(exported, offer)

    def specialize(self, exported: Any, *, every_row_count: bool = False,
                   laid_out: frozenset[int] = frozenset()) -> Specialized:
        used = 0
        cpu = build.cpu()
        choices = []   # per composite: the kernel it may run (or none) and up to how many rows
        flow = None    # the module's Dataflow, made on first need

        def replace(op, api) -> bool:
            nonlocal used, flow
            info = composite_of(api, op)
            target = TARGETS.get(info.key)
            if laid_out:
                flow = flow or Dataflow(api, exported.module_kept_var_idx)
                reads = [flow.sources(v) & laid_out for v in info.operands]
                if any(reads):
                    if info.key != LAYER_LINEAR.key or reads[1] != flow.sources(info.operands[1]) or any(reads[::2]):
                        raise ValueError(f"{info.name} v{info.version} reads inputs {sorted(set().union(*reads))} "
                                         f"laid out for {LAYER_LINEAR_TILES} in another way: only "
                                         f"layouts() offers may be laid out")
                    with api.ir.InsertionPoint(op):
                        new = custom_call(api, LAYER_LINEAR_TILES, [r.type for r in op.results], info.operands,
                                          info.config, target.result_dims)
                    choices.append([*info.key, LAYER_LINEAR_TILES, None])
                    used += 1
                    swap(op, new)
                    return True
            with api.ir.InsertionPoint(op):
                if target is None or not target.accepts(info.attributes):
                    choices.append([*info.key, None, None])
                    swap(op, decomposition_call(api, op))
                    return True
                limit = None if every_row_count else target.limit(cpu, info.attributes, _shapes(api, info.operands))
                new, ran = _kernel_or_decomposition(api, op, info.operands, info.config, target, limit)
            choices.append([*info.key, target.symbol if ran else None, limit])
            used += ran
            swap(op, new)
            return True

        fn, _ = rewrite(exported, replace)
        return Specialized(fn, used, digest=_digest(self.library, choices) if used else None)


def _digest(library: Library, choices: list) -> str:
    """The executable-cache key's part for the kernels: their code and, since the function file
    alone does not say it, which composites call them up to how many rows (targets.py's table on
    this CPU: a changed row limit or `accepts` must not find the executable compiled before)."""
    return hashlib.sha256(json.dumps([library.digest, choices]).encode()).hexdigest()


def _shapes(api, operands) -> tuple:
    """The operands' shapes, a symbolic dim as None."""
    dynamic = api.ir.ShapedType.is_dynamic_size
    return tuple(tuple(None if dynamic(d) else d for d in api.ir.RankedTensorType(v.type).shape) for v in operands)


def _kernel_or_decomposition(api, op, operands, config, target, limit: int | None):
    """(the op replacing the composite, 1 if it may run the kernel else 0): the kernel up to `limit`
    rows of the first operand (None: any), the decomposition above it; with symbolic rows, both
    under a predicate on the rows."""
    ir, hlo = api.ir, api.hlo
    result_types = [r.type for r in op.results]

    def kernel():
        return custom_call(api, target.symbol, result_types, operands, config, target.result_dims)

    rows = ir.RankedTensorType(operands[0].type).shape[0]
    static = not ir.ShapedType.is_dynamic_size(rows)
    if limit is not None and static and rows > limit:
        return decomposition_call(api, op), 0
    if limit is None or static:
        return kernel(), 1
    i32 = ir.IntegerType.get_signless(32)
    n = hlo.get_dimension_size(operands[0], 0)
    bound = hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([], i32), ir.IntegerAttr.get(i32, limit)))
    new = hlo.IfOp(result_types, hlo.compare(n, bound, hlo.ComparisonDirectionAttr.get("LE")))
    with ir.InsertionPoint(new.true_branch.blocks.append()):
        hlo.return_(list(kernel().results))
    with ir.InsertionPoint(new.false_branch.blocks.append()):
        hlo.return_(list(decomposition_call(api, op).results))
    return new, 1
