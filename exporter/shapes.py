"""torch symbolic dims -> one jax symbolic scope.

torch.export names its dims `s0`, `s77`, ... and records ranges in
`ep.range_constraints`; derived dims appear as expressions (`2*s77`). We map
each root symbol to the user's Dim name ("batch"), turn the ranges into jax
constraints ("batch <= 64"), and build every input shape in ONE
`jax.export.SymbolicScope`, so independent dims (batch and sequence) and
derived dims (2*batch) coexist in a program.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import sympy
from jax import export as jax_export

from . import _private as jax_core
from .errors import ShapeSpecError

# Bounds at or above this are "unbounded" (torch uses int_oo / huge sentinels).
_UNBOUNDED = 2**62


@dataclasses.dataclass(frozen=True)
class Symbol:
    """One symbolic dimension of an artifact: its name and inclusive range."""
    name: str
    min: int
    max: int | None     # None: no upper bound

    def constraints(self) -> list[str]:
        out = []
        if self.min > 1:
            out.append(f"{self.name} >= {self.min}")
        if self.max is not None:
            out.append(f"{self.name} <= {self.max}")
        return out


# set on a Dim hloserve named itself (a .pt2's dims: x_0), so a name the user gives wins
AUTO_NAME = "_hloserve_auto_name"


def _bound(value: Any) -> int | None:
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):  # sympy oo has no int
        return None
    return None if abs(v) >= _UNBOUNDED else v


def _expr(dim: Any) -> sympy.Expr:
    """A torch SymInt or int -> sympy expression."""
    if isinstance(dim, int):
        return sympy.Integer(dim)
    node = getattr(dim, "node", None)
    if node is None:
        raise ShapeSpecError(f"cannot read symbolic dim {dim!r}")
    return node.expr


class SymbolTable:
    """Root symbols of one program, named by the user, in one jax scope."""

    def __init__(self, symbols: dict[str, Symbol], torch_names: dict[str, str]):
        self.symbols = symbols                # user name -> Symbol
        self.torch_names = torch_names        # torch name (s77) -> user name (batch)
        constraints = [c for s in symbols.values() for c in s.constraints()]
        self.scope = jax_export.SymbolicScope(constraints)
        self._dims = {name: jax_export.symbolic_shape(name, scope=self.scope)[0] for name in symbols}

    @classmethod
    def from_program(cls, ep, user_dynamic_shapes: Sequence[Any] | None = None) -> "SymbolTable":
        """Name the symbols of `ep` after the Dims in `user_dynamic_shapes`.

        `user_dynamic_shapes` is aligned with the program's user inputs: per
        input a dict {dim index: Dim} (or None). Symbols not named there keep
        torch's name (s77).
        """
        from torch.utils._sympy.symbol import SymT, symbol_is_type

        torch_names: dict[str, str] = {}
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
        user = [n for n, spec in zip(placeholders, ep.graph_signature.input_specs)
                if spec.kind.name == "USER_INPUT"]
        for node, spec in zip(user, user_dynamic_shapes or ()):
            if not spec:
                continue
            items = spec.items() if isinstance(spec, dict) else enumerate(spec)
            val = node.meta.get("val")
            for d, dim in items:
                if dim is None or val is None:
                    continue
                expr = _expr(val.shape[d])
                if not expr.free_symbols:
                    continue  # torch specialized it; nothing symbolic to name
                root = getattr(dim, "root", None)        # derived dims: Dim.root, fn
                name = getattr(root if root is not None else dim, "__name__", None)
                if not name or not str(name).isidentifier():
                    continue
                (sym,) = expr.free_symbols
                if getattr(root if root is not None else dim, AUTO_NAME, False):
                    torch_names.setdefault(str(sym), str(name))   # a name hloserve made up yields to the user's
                else:
                    torch_names[str(sym)] = str(name)
        symbols: dict[str, Symbol] = {}
        for sym, rng in ep.range_constraints.items():
            if not isinstance(sym, sympy.Symbol):
                continue  # ranges of derived expressions follow from their roots
            if symbol_is_type(sym, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)):
                continue  # unbacked (data-dependent) symbols, e.g. left by while_loop tracing, are no input dims
            name = torch_names.setdefault(str(sym), str(sym))
            lo = max(1, _bound(rng.lower) or 1)
            symbols[name] = Symbol(name, lo, _bound(rng.upper))
        return cls(symbols, torch_names)

    # -- conversions -------------------------------------------------------
    def to_jax(self, dim: Any) -> int | Any:
        """torch SymInt / sympy expr / int -> int or jax dim expression."""
        if isinstance(dim, int):
            return dim
        expr = dim if isinstance(dim, sympy.Basic) else _expr(dim)
        return self._eval(expr)

    def shape(self, fake) -> tuple:
        return tuple(self.to_jax(d) for d in fake.shape)

    def shape_strings(self, fake) -> list:
        """Shape for the manifest: ints stay ints, symbolic dims print in jax syntax."""
        return [d if isinstance(d, int) else str(d) for d in self.shape(fake)]

    def _eval(self, e: sympy.Expr):
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            name = self.torch_names.get(str(e))
            if name is None or name not in self._dims:
                raise ShapeSpecError(
                    f"dim {e} is data-dependent (unbacked); hloserve needs shapes that follow from "
                    f"the inputs. Rewrite the model to avoid shape-from-data ops (nonzero, item, unique)."
                )
            return self._dims[name]
        args = [self._eval(a) for a in e.args]
        kind = type(e).__name__
        if isinstance(e, sympy.Add):
            return sum(args[1:], args[0])
        if isinstance(e, sympy.Mul):
            return math.prod(args[1:], start=args[0])
        if kind in ("Pow", "PowByNatural") and isinstance(args[1], int) and args[1] >= 0:
            return math.prod([args[0]] * args[1], start=1)
        if kind == "FloorDiv":
            return args[0] // args[1]
        if kind in ("Mod", "PythonMod"):
            return args[0] % args[1]
        if kind in ("CeilDiv", "CleanDiv"):
            return -((-args[0]) // args[1]) if kind == "CeilDiv" else args[0] // args[1]
        if kind == "Max":
            return _fold(jax_core.max_dim, args)
        if kind == "Min":
            return _fold(jax_core.min_dim, args)
        raise ShapeSpecError(f"symbolic dim expression {e} ({kind}) is not supported")


def _fold(fn, args):
    out = args[0]
    for a in args[1:]:
        out = fn(out, a)
    return out
