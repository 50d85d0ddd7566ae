"""The MLIR rewriting every kernel backend shares: reading a composite op, calling its
decomposition, an FFI custom call in its place, and swapping the op for what replaces it.

    def replace(op, api):                              # one stablehlo.composite (runtime/_private.py's walk)
        info = composite_of(api, op)                   # (name, version), attributes, contract operands
        new = decomposition_call(api, op) or custom_call(api, "target", ...)
        swap(op, new)
    exported, n = rewrite(exported, replace)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hloserve.runtime.artifact.kernels import COMPOSITES, Composite

from .. import _private


@dataclasses.dataclass(frozen=True)
class CompositeOp:
    """One composite op as a backend reads it: its key, attributes (Python values and the MLIR
    attributes, for a custom call's config), and the operands of its contract (leading operands
    beyond the contract's are its decomposition's dimension variables)."""
    name: str
    version: int
    attributes: dict[str, Any]
    config: dict[str, Any]
    operands: list
    contract: Composite | None

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.version


def composite_of(api, op) -> CompositeOp:
    ir = api.ir
    attrs = op.attributes
    name, version = ir.StringAttr(attrs["name"]).value, ir.IntegerAttr(attrs["version"]).value
    config = ({a.name: a.attr for a in ir.DictAttr(attrs["composite_attributes"])}
              if "composite_attributes" in attrs else {})                 # a composite without attributes
    contract = COMPOSITES.get((name, version))
    operands = list(op.operands)[-len(contract.operands):] if contract else list(op.operands)
    return CompositeOp(name, version, {k: attribute_value(ir, v) for k, v in config.items()}, config, operands,
                       contract)


def decomposition_call(api, op):
    """A call of the composite's decomposition with its operands (what every platform can run)."""
    return api.func.CallOp([r.type for r in op.results], api.ir.FlatSymbolRefAttr(op.attributes["decomposition"]),
                           list(op.operands))


def swap(op, new) -> None:
    """Replace every use of `op`'s results by `new`'s, then erase `op`."""
    for old, res in zip(op.results, new.results):
        old.replace_all_uses_with(res)
    op.erase()


def rewrite(exported: Any, replace: Callable[[Any, Any], bool]) -> tuple[Any, int]:
    """`exported` with `replace(op, api)` applied to each composite (True: it replaced the op), for
    this process's compile only; returns (function, number replaced)."""
    body, n = _private.rewrite_composites(exported.mlir_module_serialized, replace)
    return (dataclasses.replace(exported, mlir_module_serialized=body) if n else exported), n


def custom_call(api, target: str, result_types, operands, config, dims=None):
    """An FFI custom call `target` (api v4) replacing a composite: `config` (the composite's
    attributes) as its backend config, and, where the result has symbolic dims, those dims as
    (operand, dim) pairs, or None for a static dim (default: the first operand's), for shape refinement."""
    ir, hlo = api.ir, api.hlo
    shape = None
    if not all(ir.RankedTensorType(t).has_static_shape for t in result_types):
        i32 = ir.IntegerType.get_signless(32)
        dims = dims or [(0, d) for d in range(ir.RankedTensorType(operands[0].type).rank)]
        result = ir.RankedTensorType(result_types[0])

        def size(r: int, where):
            if where is None:   # a static dim of the result
                return hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([1], i32),
                                                                   ir.IntegerAttr.get(i32, result.get_dim_size(r))))
            return hlo.reshape(ir.RankedTensorType.get([1], i32), hlo.get_dimension_size(operands[where[0]], where[1]))
        shape = [hlo.concatenate([size(r, where) for r, where in enumerate(dims)], 0)]
    return api.mlir.custom_call(target, result_types=result_types, operands=operands, backend_config=config,
                                api_version=4, result_shapes=shape)


def attribute_value(ir, attr):
    """A composite attribute's Python value (integers and floats; others as they are)."""
    for kind in (ir.IntegerAttr, ir.FloatAttr):
        if isinstance(attr, kind):
            return attr.value
        try:
            return kind(attr).value
        except (ValueError, TypeError):
            continue
    return attr
