"""FX interpreter: walks an ExportedProgram's graph and calls one lowering per node.

It knows no op: every `call_function` goes through the Registry. After each
lowering the result is conformed to the dtype torch recorded for the node
(node.meta["val"]), so type promotion always follows torch, whatever jax's
rules would give. Higher-order ops (cond, while_loop, scan) get their
subgraphs through `LoweringContext.subgraph`.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import torch
import torch.fx

from . import dtypes
from .errors import HloserveError, LoweringError, NodeInfo, UnsupportedOpError
from .registry import Registry, target_name
from .shapes import SymbolTable

# Nodes whose targets need no lowering: asserts torch already proved, metadata checks.
_SKIP = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}
_LOCATION = re.compile(r'File "([^"]+)", line (\d+)')


def node_info(node: torch.fx.Node) -> NodeInfo:
    location = "<unknown>"
    trace = node.meta.get("stack_trace") or ""
    frames = _LOCATION.findall(trace)
    if frames:
        path, line = frames[-1]
        location = f"{path.rsplit('/', 1)[-1]}:{line}"
    shapes = []
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        shapes.append(_describe(val))
    return NodeInfo(node.name, target_name(node.target), location, ", ".join(shapes))


def _describe(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        try:
            short = dtypes.name_of_torch(val.dtype)
        except TypeError:
            short = str(val.dtype)
        return f"{short}[{','.join(str(d) for d in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "?"


@dataclasses.dataclass
class LoweringContext:
    """What a lowering may ask about the node it lowers."""
    node: torch.fx.Node
    interpreter: "Interpreter"
    env: dict = dataclasses.field(default_factory=dict, repr=False)   # the graph's nodes lowered so far

    def value(self, node: torch.fx.Node) -> Any:
        """What an earlier node lowered to (for a lowering that looks at its operands' producers)."""
        return self.env[node]

    @property
    def out_val(self) -> Any:
        return self.node.meta.get("val")

    @property
    def out_dtype(self):
        """jax dtype torch computed for the (first) output."""
        val = self.out_val
        if isinstance(val, (list, tuple)):
            val = val[0]
        return dtypes.jax_of_torch(val.dtype)

    @property
    def out_shape(self) -> tuple:
        """Output shape with symbolic dims as jax dim expressions."""
        val = self.out_val
        if isinstance(val, (list, tuple)):
            val = val[0]
        return self.interpreter.symbols.shape(val)

    def to_jax_dim(self, dim: Any):
        return self.interpreter.symbols.to_jax(dim)

    def subgraph(self, gm: torch.fx.GraphModule) -> Callable[..., list]:
        """A jax-traceable function running `gm` (a HOP branch or body)."""
        return lambda *args: self.interpreter.run(gm, args)


class Interpreter:
    """Lowers an FX graph node by node. `batch_invariant`: lowerings choose the forms whose results do
    not depend on the sizes of the dims they do not reduce (exporter/composites/product_sum.py)."""

    def __init__(self, registry: Registry, symbols: SymbolTable, *, batch_invariant: bool = False):
        self.registry = registry
        self.symbols = symbols
        self.batch_invariant = batch_invariant

    def check_supported(self, gm: torch.fx.GraphModule) -> None:
        """Raise one UnsupportedOpError naming every op without a lowering."""
        missing = list(self._missing(gm))
        if missing:
            raise UnsupportedOpError(missing)

    def _missing(self, gm: torch.fx.GraphModule):
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                sub = _getattr(gm, node.target)
                if isinstance(sub, torch.fx.GraphModule):
                    yield from self._missing(sub)
            elif node.op == "call_function" and node.target not in _SKIP \
                    and node.target is not operator.getitem and node.target not in self.registry:
                yield node_info(node)

    def run(self, gm: torch.fx.GraphModule, args: Sequence[Any]) -> list:
        env: dict[torch.fx.Node, Any] = {}
        args_iter = iter(args)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(args_iter)
            elif node.op == "get_attr":
                env[node] = _getattr(gm, node.target)
            elif node.op == "call_function":
                env[node] = self._call(node, env)
            elif node.op == "output":
                outs = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
                return list(outs) if isinstance(outs, (list, tuple)) else [outs]
            else:
                raise HloserveError(f"unexpected FX node kind {node.op!r} at {node_info(node).describe()}")
        raise HloserveError("graph has no output node")

    def _call(self, node: torch.fx.Node, env: dict) -> Any:
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target is operator.getitem:
            return args[0][args[1]]
        if node.target in _SKIP:
            return None
        fn = self.registry.lookup(node.target)
        if fn is None:
            raise UnsupportedOpError([node_info(node)])
        try:
            out = fn(LoweringContext(node, self, env), *args, **kwargs)
            return _conform(out, node.meta.get("val"))
        except HloserveError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the node's context
            raise LoweringError(node_info(node), e) from e


def _getattr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _conform(out: Any, val: Any) -> Any:
    """Cast a lowering's result to the dtype torch recorded for the node."""
    if isinstance(val, torch.Tensor):
        out = jnp.asarray(out)
        want = dtypes.jax_of_torch(val.dtype)
        if out.dtype != want:
            out = out.astype(want)
        if out.ndim != val.ndim:
            raise ValueError(f"lowering returned rank {out.ndim}, torch expects rank {val.ndim} ({tuple(val.shape)})")
        return out
    if isinstance(val, (list, tuple)) and isinstance(out, (list, tuple)) and len(out) == len(val):
        return type(out)(_conform(o, v) for o, v in zip(out, val))
    return out
