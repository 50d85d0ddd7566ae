"""Higher-order ops: torch.cond, while_loop, scan and map -> stablehlo.case, while.

Each branch or body is an FX subgraph; `ctx.subgraph(gm)` turns it into a
jax-traceable function, so the loop body is emitted ONCE (a 24-layer scanned
stack is the size of one layer in StableHLO).

Operands that are not tensors (SymInts such as a batch size a branch reshapes
with) are passed to the subgraph as they are, outside lax's operands: lowerings
need dims as ints or jax dim expressions, never as traced arrays.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
import torch
from jax import lax

from .. import dtypes
from ..bits import from_bits, to_bits
from ..registry import lower

hop = torch.ops.higher_order


def _is_array(v: Any) -> bool:
    return hasattr(v, "dtype") and hasattr(v, "shape")


def _split(values: Sequence[Any]) -> tuple[tuple, Callable[[Sequence[Any]], list]]:
    """(the arrays among `values`, merge(arrays) -> the full list with non-arrays back in place)."""
    arrays = tuple(v for v in values if _is_array(v))

    def merge(new_arrays: Sequence[Any]) -> list:
        it = iter(new_arrays)
        return [next(it) if _is_array(v) else v for v in values]

    return arrays, merge


def _as_torch(values: Sequence[Any], vals: Any) -> tuple:
    """Cast results to the dtypes torch recorded (`vals`: the node's meta['val']), so both
    branches of a cond, or a loop body and its carry, agree exactly (no weak types)."""
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    out = []
    for v, fake in zip(values, vals):
        v = jnp.asarray(v)
        if isinstance(fake, torch.Tensor):
            v = v.astype(dtypes.jax_of_torch(fake.dtype))
        out.append(v)
    return tuple(out)


# cond(Tensor pred, GraphModule true_fn, GraphModule false_fn, Tensor[] operands) -> Tensor[]
@lower(hop.cond)
def _cond(ctx, pred, true_gm, false_gm, operands):
    t, f = ctx.subgraph(true_gm), ctx.subgraph(false_gm)
    arrays, merge = _split(operands)
    pred = jnp.asarray(pred).reshape(()).astype(bool)
    out = list(lax.cond(pred, lambda ops: _as_torch(t(*merge(ops)), ctx.out_val),
                        lambda ops: _as_torch(f(*merge(ops)), ctx.out_val), arrays))
    return out if isinstance(ctx.out_val, (list, tuple)) else out[0]   # branches returning one tensor: that tensor


# while_loop(GraphModule cond_fn, GraphModule body_fn, Tensor[] carried_inputs, Tensor[] additional_inputs) -> Tensor[]
@lower(hop.while_loop)
def _while_loop(ctx, cond_gm, body_gm, carried, additional):
    cond_fn, body_fn = ctx.subgraph(cond_gm), ctx.subgraph(body_gm)
    carried = _as_torch(carried, ctx.out_val)

    def body(carry):
        # keep the carry's dtypes fixed across iterations
        return tuple(jnp.asarray(o).astype(c.dtype) for o, c in zip(body_fn(*carry, *additional), carry))

    def cond(carry):
        return jnp.asarray(cond_fn(*carry, *additional)[0]).reshape(()).astype(bool)

    return list(lax.while_loop(cond, body, carried))


# scan(GraphModule combine_fn, Tensor[] init, Tensor[] xs, Tensor[] additional_inputs) -> Tensor[]
#   combine_fn(*carry, *x_slices, *additional) -> (*next_carry, *y_slices); scans dim 0
#   (torch.export moves `dim` to 0 and flips xs/ys for reverse=True around the op).
@lower(hop.scan)
def _scan(ctx, combine_gm, init, xs, additional):
    fn = ctx.subgraph(combine_gm)
    n_carry = len(init)
    init = _as_torch(init, ctx.out_val[:n_carry])

    x_dtypes = [x.dtype for x in xs]

    def step(carry, x):
        # xs cross the loop boundary as bits (exporter/bits.py: XLA:CPU would widen a 16-bit float
        # stack to f32 before slicing it)
        out = fn(*carry, *(from_bits(v, d) for v, d in zip(x, x_dtypes)), *additional)
        next_carry = tuple(jnp.asarray(o).astype(c.dtype) for o, c in zip(out[:n_carry], carry))
        return next_carry, _as_torch(out[n_carry:], ctx.out_val[n_carry:])

    carry, ys = lax.scan(step, init, tuple(to_bits(x) for x in xs))
    return [*carry, *ys]


# map_impl(GraphModule body, Tensor[] xs, Tensor[] pos_args) -> Tensor[]
#   body(*x_slices, *pos_args) -> y_slices; maps over dim 0 of every xs (torch._higher_order_ops.map).
@lower(hop.map_impl)
def _map(ctx, body_gm, xs, pos_args):
    fn = ctx.subgraph(body_gm)
    x_dtypes = [x.dtype for x in xs]

    def body(x):
        return _as_torch(fn(*(from_bits(v, d) for v, d in zip(x, x_dtypes)), *pos_args), ctx.out_val)

    return list(lax.map(body, tuple(to_bits(x) for x in xs)))
