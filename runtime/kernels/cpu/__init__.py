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

On a CPU with AMX or AVX512-BF16, a bf16 weight stack read only by `hloserve.layer_linear`
composites is offered laid out as B tiles (layouts.py); where runtime.load lays it out, its readers
call `hloserve_layer_linear_tiles` at every row count (the decomposition could not read it): AMX tile
multiplies, or AVX512-BF16 outer products (linear.h's b_tiles_pairs; AVX2's widened to f32). A
mixture of experts' bf16 gate_up and down stacks are offered together the same way, for
`hloserve_grouped_experts_tiles` (the same tile products, an expert's rows at a time). A bf16
embedding table read by a tied LM head's layer_linear and by the embedding's gather of rows is
offered too: `specialize` then replaces that gather by one that reads the rows from the tiles
(layouts.tile_row_gather; the same values).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hloserve.runtime.artifact.kernels import GROUPED_EXPERTS, LAYER_LINEAR

from ..backend import Specialized, WeightLayout
from ..rewrite import Dataflow, composite_of, constant, custom_call, decomposition_call, read, rewrite, swap
from . import build, layouts
from .build import Library
from .targets import GROUPED_EXPERTS_TILES, LAYER_LINEAR_TILES, TARGETS


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
        cpu = build.cpu()
        if not layouts.b_tiles_read(cpu):
            return {}

        def tiles_read(api, flow: Dataflow, op, n: int, index: int) -> bool:
            """Whether operand n of op (a composite or a gather) reads input `index` as a B-tile kernel
            would: a bf16 layer_linear's weights, a bf16 grouped_experts' gate_up or down where both fit,
            or a gather of the rows of a matrix that such a composite reads too (a tied embedding table,
            its rows read from the tiles by `specialize`)."""
            if op.operation.name == "stablehlo.gather":
                return layouts.row_gather(api, op)
            info = composite_of(api, op)
            at = n - (len(op.operands) - len(info.operands))               # the composite's own operand
            if info.attributes.get("holds") != 1 or flow.sources(op.operands[n]) != {index}:
                return False
            if info.key == LAYER_LINEAR.key:
                return at == 1 and layouts.b_tiles_fit(_shapes(api, [op.operands[n]])[0])
            if info.key == GROUPED_EXPERTS.key:
                return at in (3, 4) and all(map(layouts.b_tiles_fit, _shapes(api, info.operands[3:5])))
            return False

        def offer(api) -> dict[int, WeightLayout]:
            flow = Dataflow(api, exported.module_kept_var_idx)
            out = {}
            for index in flow.inputs.values():
                readers = flow.readers(index)
                if readers and all(tiles_read(api, flow, op, n, index) for op, n in readers) \
                        and any(op.operation.name == "stablehlo.composite" for op, _ in readers):
                    out[index] = layouts.B_TILES
            # the experts' kernel reads both stacks as tiles or neither: an offer whose partner is not
            # offered (read by something else too) is withdrawn, until none is left alone
            while True:
                alone = {i for i in out for op, n in flow.readers(i) if _partner(api, flow, op, n) - out.keys()}
                if not alone:
                    return out
                for i in alone:
                    del out[i]

        return read(exported, offer)

    def specialize(self, exported: Any, *, every_row_count: bool = False,
                   laid_out: frozenset[int] = frozenset()) -> Specialized:
        used = 0
        cpu = build.cpu()
        choices = []   # per composite: the kernel it may run (or none) and up to how many rows
        flow = None    # the module's Dataflow, made on first need

        def replace(op, api) -> bool:
            nonlocal used, flow
            if op.operation.name == "stablehlo.gather":     # only a laid-out table's rows (kinds below)
                flow = flow or Dataflow(api, exported.module_kept_var_idx)
                sources = flow.sources(op.operands[0])
                if not sources & laid_out:
                    return False
                if not sources <= laid_out:
                    raise ValueError(f"a gather reads inputs {sorted(sources)}, of which only "
                                     f"{sorted(sources & laid_out)} are laid out: only layouts() offers may be laid out")
                with api.ir.InsertionPoint(op):
                    swap(op, layouts.tile_row_gather(api, op))
                choices.append(["gather", 0, "b_tiles_rows", None])
                return True
            info = composite_of(api, op)
            target = TARGETS.get(info.key)
            if laid_out:
                flow = flow or Dataflow(api, exported.module_kept_var_idx)
                reads = [flow.sources(v) & laid_out for v in info.operands]
                if any(reads):
                    tiled = _TILES.get(info.key)
                    if tiled is None or any(bool(r) != (i in tiled[1]) or (r and r != flow.sources(info.operands[i]))
                                            for i, r in enumerate(reads)):
                        raise ValueError(f"{info.name} v{info.version} reads inputs {sorted(set().union(*reads))} "
                                         f"laid out for the kernels in another way: only layouts() offers may "
                                         f"be laid out")
                    with api.ir.InsertionPoint(op):
                        new = custom_call(api, tiled[0], [r.type for r in op.results], info.operands,
                                          info.config, target.result_dims)
                    choices.append([*info.key, tiled[0], None])
                    used += 1
                    swap(op, new)
                    return True
            with api.ir.InsertionPoint(op):
                if target is None or not target.accepts(info.attributes):
                    choices.append([*info.key, None, None])
                    swap(op, decomposition_call(api, op))
                    return True
                limit = None if every_row_count else target.limit(cpu, info.attributes, _shapes(api, info.operands))
                changed = target.attributes_for(cpu, info.attributes)
                i64 = api.ir.IntegerType.get_signless(64)
                config = {**info.config, **{k: api.ir.IntegerAttr.get(i64, v) for k, v in changed.items()}}
                new, ran = _kernel_or_decomposition(api, op, info.operands, config, target, limit)
            choices.append([*info.key, target.symbol if ran else None, limit, changed])
            used += ran
            swap(op, new)
            return True

        fn, _ = rewrite(exported, replace, ("stablehlo.composite", "stablehlo.gather") if laid_out else
                        ("stablehlo.composite",))
        return Specialized(fn, used, digest=_digest(self.library, choices) if used else None)


# composites with a kernel over stacks laid out as B tiles: (its symbol, which operands are laid out)
_TILES = {LAYER_LINEAR.key: (LAYER_LINEAR_TILES, (1,)), GROUPED_EXPERTS.key: (GROUPED_EXPERTS_TILES, (3, 4))}


def _partner(api, flow: Dataflow, op, n: int) -> set[int]:
    """The inputs an experts composite reading its operand n as tiles needs laid out with it (the
    other stack's); none for any other reader."""
    if op.operation.name != "stablehlo.composite":
        return set()
    info = composite_of(api, op)
    at = n - (len(op.operands) - len(info.operands))
    if info.key != GROUPED_EXPERTS.key or at not in (3, 4):
        return set()
    return set(flow.sources(info.operands[7 - at]))


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
    n = hlo.get_dimension_size(operands[0], 0)
    new = hlo.IfOp(result_types, hlo.compare(n, constant(api, limit), hlo.ComparisonDirectionAttr.get("LE")))
    with ir.InsertionPoint(new.true_branch.blocks.append()):
        hlo.return_(list(kernel().results))
    with ir.InsertionPoint(new.false_branch.blocks.append()):
        hlo.return_(list(decomposition_call(api, op).results))
    return new, 1
