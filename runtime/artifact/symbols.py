"""Call-time shape checks: bind concrete input shapes to an artifact function's symbolic dims.

Pure stdlib + the manifest types; used by the runtime before anything is compiled or run.
"""
from __future__ import annotations

import ast
from typing import Mapping, Sequence

from .errors import ArtifactError, ShapeConstraintError
from .manifest import FunctionSpec, SymbolSpec, TensorSpec


def _eval_dim(expr: str, env: Mapping[str, int]) -> int:
    """Evaluate a jax-syntax dim expression ("2*batch + 1", "floordiv(s, 2)") with `env`."""
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            return env[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
            if type(n.op) in ops:
                return ops[type(n.op)]
            if isinstance(n.op, ast.FloorDiv):
                return a // b
            if isinstance(n.op, ast.Mod):
                return a % b
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            args = [ev(a) for a in n.args]
            fns = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "max": max, "min": min,
                   "non_negative": lambda a: max(a, 0)}
            if n.func.id in fns:
                return fns[n.func.id](*args)
        raise ArtifactError(f"cannot evaluate dim expression {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


def _names(expr: str) -> set[str]:
    fns = {"floordiv", "mod", "max", "min", "non_negative"}
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name) and n.id not in fns}


def bind_symbols(fn: FunctionSpec, symbols: Mapping[str, SymbolSpec], shapes: Mapping[str, tuple[int, ...]],
                 dtypes_in: Mapping[str, str] | None = None) -> dict[str, int]:
    """Check concrete input shapes against `fn` and return the symbol values.

    Raises ShapeConstraintError naming the input, the dim and the broken bound,
    before anything is compiled or run.
    """
    env: dict[str, int] = {}
    specs = {t.name: t for t in fn.inputs}
    for name in shapes:
        if name not in specs:
            raise ShapeConstraintError(f"function {fn.name!r} has no input {name!r}; its inputs are {list(specs)}")
    for t in fn.inputs:
        if t.name not in shapes:
            raise ShapeConstraintError(f"function {fn.name!r} needs input {t.name!r} ({t.describe()}); it was not given")
        shape = tuple(shapes[t.name])
        if dtypes_in and t.name in dtypes_in and dtypes_in[t.name] != t.dtype:
            raise ShapeConstraintError(f"input {t.name!r} has dtype {dtypes_in[t.name]}, expected {t.dtype} ({t.describe()})")
        if len(shape) != len(t.shape):
            raise ShapeConstraintError(f"input {t.name!r} has rank {len(shape)} (shape {list(shape)}), "
                                       f"expected rank {len(t.shape)} ({t.describe()})")
        for d, (want, got) in enumerate(zip(t.shape, shape)):
            if isinstance(want, int):
                if want != got:
                    raise ShapeConstraintError(f"input {t.name!r} dim {d} is {got}, expected {want} ({t.describe()})")
            elif want.isidentifier():
                if env.setdefault(want, got) != got:
                    raise ShapeConstraintError(f"input {t.name!r} dim {d} is {got}, but {want} = {env[want]} from "
                                               f"another input; dims named {want} must be equal")
    # symbols that only appear in derived form (k*s + c): solve the linear equation
    for t in fn.inputs:
        for d, want in enumerate(t.shape):
            if isinstance(want, str) and not want.isidentifier():
                unknown = _names(want) - env.keys()
                if len(unknown) == 1:
                    (s,) = unknown
                    c = _eval_dim(want, {**env, s: 0})
                    k = _eval_dim(want, {**env, s: 1}) - c
                    got = shapes[t.name][d]
                    if k and (got - c) % k == 0:
                        env[s] = (got - c) // k
    for name, value in env.items():
        sym = symbols.get(name)
        if sym is None:
            continue
        if value < sym.min or (sym.max is not None and value > sym.max):
            where = next(f"input {t.name!r} dim {d}" for t in fn.inputs for d, w in enumerate(t.shape)
                         if isinstance(w, str) and name in _names(w))
            hi = "inf" if sym.max is None else sym.max
            raise ShapeConstraintError(f"{where}: {name} = {value} is outside its range [{sym.min}, {hi}] declared at export; "
                                       f"use a size in range or re-export with a wider --dynamic range for {name}")
    for t in fn.inputs:
        for d, want in enumerate(t.shape):
            if isinstance(want, str) and not want.isidentifier():
                try:
                    expect = _eval_dim(want, env)
                except KeyError:
                    raise ShapeConstraintError(f"input {t.name!r} dim {d} ({want}) cannot be solved from the inputs") from None
                if expect != shapes[t.name][d]:
                    raise ShapeConstraintError(f"input {t.name!r} dim {d} is {shapes[t.name][d]}, but must equal "
                                               f"{want} = {expect} ({t.describe()})")
    return env


def concrete_shape(spec: TensorSpec, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else _eval_dim(d, env) for d in spec.shape)


def names_in(shape: Sequence[int | str]) -> set[str]:
    return set().union(*(_names(d) for d in shape if isinstance(d, str))) if shape else set()
