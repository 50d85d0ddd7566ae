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


def rewrite(exported: Any, replace: Callable[[Any, Any], bool], kinds: tuple[str, ...] = ("stablehlo.composite",)
            ) -> tuple[Any, int]:
    """`exported` with `replace(op, api)` applied to each composite, and each op of the other `kinds`
    named (True: it replaced the op), for this process's compile only; returns (function, number replaced)."""
    body, n = _private.rewrite_composites(exported.mlir_module_serialized, replace, kinds)
    return (dataclasses.replace(exported, mlir_module_serialized=body) if n else exported), n


def constant(api, value: int, shape=(), element=None):
    """A constant integer tensor of `shape` holding `value` everywhere (i32 unless `element` says)."""
    ir = api.ir
    element = element or ir.IntegerType.get_signless(32)
    return api.hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get(list(shape), element),
                                                           ir.IntegerAttr.get(element, value)))


def dim_size(api, value, d: int):
    """Dimension d of `value` (static or symbolic) as an i32[1], for the shape tensors of dynamic ops."""
    ir = api.ir
    return api.hlo.reshape(ir.RankedTensorType.get([1], ir.IntegerType.get_signless(32)),
                           api.hlo.get_dimension_size(value, d))


def custom_call(api, target: str, result_types, operands, config, dims=None):
    """An FFI custom call `target` (api v4) replacing a composite: `config` (the composite's
    attributes) as its backend config, and, where the result has symbolic dims, those dims as
    (operand, dim) pairs, or None for a static dim (default: the first operand's), for shape refinement."""
    ir, hlo = api.ir, api.hlo
    shape = None
    if not all(ir.RankedTensorType(t).has_static_shape for t in result_types):
        dims = dims or [(0, d) for d in range(ir.RankedTensorType(operands[0].type).rank)]
        result = ir.RankedTensorType(result_types[0])
        shape = [hlo.concatenate([constant(api, result.get_dim_size(r), (1,)) if where is None   # a static dim
                                  else dim_size(api, operands[where[0]], where[1]) for r, where in enumerate(dims)], 0)]
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


def read(exported: Any, read_module: Callable[[Any], Any]) -> Any:
    """`read_module(api)` on `exported`'s module (api as `replace` gets it, with api.module), changing
    nothing; returns what it returns."""
    return _private.read_module(exported.mlir_module_serialized, read_module)


def element_bits(ir, tensor_type) -> int | None:
    """The width of a tensor type's elements, None for anything but integers and floats."""
    e = tensor_type.element_type
    e = e.maybe_downcast() if hasattr(e, "maybe_downcast") else e
    return e.width if isinstance(e, (ir.IntegerType, ir.FloatType)) else None


def same_bytes(ir, op) -> bool:
    """Whether `op` gives its one operand's bytes another type only, each matrix [.., N, K] where it
    was: a bitcast_convert to a type as wide, or a reshape or broadcast_in_dim that adds or drops
    dims of size 1 before the last two (a tied LM head reads the table [V, H] as a stack [1, V, H]).
    A layout of the operand's bytes (WeightLayout) is then the result's as well."""
    op = op.operation
    if op.name not in ("stablehlo.bitcast_convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim"):
        return False
    a, b = (ir.RankedTensorType(v.type) for v in (op.operands[0], op.results[0]))
    if not (a.has_static_shape and b.has_static_shape) or a.rank < 2 or b.rank < 2:
        return False
    if op.name == "stablehlo.broadcast_in_dim":          # no transpose among the dims it keeps
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
        if dims != sorted(dims):
            return False
    return (list(a.shape[-2:]) == list(b.shape[-2:]) and element_bits(ir, a) == element_bits(ir, b) is not None
            and [d for d in a.shape[:-2] if d != 1] == [d for d in b.shape[:-2] if d != 1])


class Dataflow:
    """Where an exported function's inputs go in its module: a value's sources followed back, an
    input's readers followed forward, through the calls and the while loops that pass a value on
    unchanged (a scanned layer stack reaches its layer's composites through jax.export's wrapper,
    the scan's while loop and its body's call) and the ops that only retype its bytes (`same_bytes`).
    A reader is a composite or a stablehlo.gather. Inputs are numbered as `exported.in_avals` (main
    takes those jax kept: `module_kept_var_idx`; its global constants are none of them)."""

    def __init__(self, api, kept_var_idx):
        ir = api.ir
        self.ir = ir
        self.funcs = {ir.StringAttr(f.attributes["sym_name"]).value: f.operation for f in api.module.body.operations}
        self.callers: dict[str, list] = {}

        def visit(op):
            if op.name == "func.call":
                self.callers.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, []).append(op)
            return ir.WalkResult.ADVANCE

        api.module.operation.walk(visit)
        main = self.funcs["main"]
        self.main_args = main.regions[0].blocks[0].arguments
        attrs = ir.ArrayAttr(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else None
        constant = [attrs is not None and "jax.global_constant" in ir.DictAttr(attrs[i]) for i in range(len(self.main_args))]
        self.inputs = dict(zip([i for i, c in enumerate(constant) if not c], kept_var_idx))   # main arg -> input

    def sources(self, value) -> frozenset[int]:
        """The inputs whose arrays `value` can be; -1 for a value computed from anything else."""
        ir = self.ir
        value = value.maybe_downcast()
        if isinstance(value, ir.BlockArgument):
            n, parent = value.arg_number, value.owner.owner
            if parent.operation.name == "func.func":
                name = ir.StringAttr(parent.attributes["sym_name"]).value
                if name == "main":
                    return frozenset({self.inputs.get(n, -1)})
                calls = self.callers.get(name, [])
                return frozenset().union(*(self.sources(c.operands[n]) for c in calls)) if calls else frozenset({-1})
            if parent.operation.name == "stablehlo.while" and self._passes_on(parent, n):
                return self.sources(parent.operands[n])
            return frozenset({-1})
        if isinstance(value, ir.OpResult):
            owner = value.owner.operation
            if owner.name == "stablehlo.while" and self._passes_on(value.owner, value.result_number):
                return self.sources(value.owner.operands[value.result_number])
            if same_bytes(ir, owner):
                return self.sources(owner.operands[0])
        return frozenset({-1})

    def readers(self, index: int) -> list[tuple[Any, int]] | None:
        """The composite and gather ops that read input `index`, each with the operand it reads it as;
        None where anything else reads it (it is used as it lies by some other op)."""
        out: list[tuple[Any, int]] = []
        args = [n for n, i in self.inputs.items() if i == index]
        return out if all(self._follow(self.main_args[n], out) for n in args) else None

    def _passes_on(self, loop, n: int) -> bool:
        body = loop.regions[1].blocks[0]
        ops = body.operations
        return ops[len(ops) - 1].operands[n] == body.arguments[n]

    def _follow(self, value, out: list) -> bool:
        ir = self.ir
        for use in value.uses:
            op, n = use.owner, use.operand_number
            if op.operation.name == "stablehlo.composite" or (op.operation.name == "stablehlo.gather" and n == 0):
                out.append((op, n))
            elif same_bytes(ir, op.operation):
                if not self._follow(op.results[0], out):
                    return False
            elif op.operation.name == "func.call":
                callee = self.funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value]
                if not self._follow(callee.regions[0].blocks[0].arguments[n], out):
                    return False
            elif op.operation.name == "stablehlo.while":
                if not self._passes_on(op, n):
                    return False
                inner = [op.regions[0].blocks[0].arguments[n], op.regions[1].blocks[0].arguments[n], op.results[n]]
                if not all(self._follow(v, out) for v in inner):
                    return False
            elif op.operation.name == "stablehlo.return" and op.parent.operation.name == "stablehlo.while" \
                    and isinstance(arg := value.maybe_downcast(), ir.BlockArgument) and arg.arg_number == n:
                continue                            # a loop body passing its argument on
            else:
                return False
        return True
