"""Higher-order ops: torch.cond, while_loop and scan -> stablehlo.case/if, while.

Each branch or body is an FX subgraph; `ctx.subgraph(gm)` turns it into a
jax-traceable function, so the loop body is emitted ONCE (a 24-layer scanned
stack is the size of one layer in StableHLO).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import torch

from ..registry import lower

hop = torch.ops.higher_order


# cond(Tensor pred, GraphModule true_fn, GraphModule false_fn, Tensor[] operands) -> Tensor[]
@lower(hop.cond)
def _cond(ctx, pred, true_gm, false_gm, operands):
    t, f = ctx.subgraph(true_gm), ctx.subgraph(false_gm)
    pred = jnp.asarray(pred).reshape(()).astype(bool)
    return lax.cond(pred, lambda ops: tuple(t(*ops)), lambda ops: tuple(f(*ops)), tuple(operands))


# while_loop(GraphModule cond_fn, GraphModule body_fn, Tensor[] carried_inputs, Tensor[] additional_inputs) -> Tensor[]
@lower(hop.while_loop)
def _while_loop(ctx, cond_gm, body_gm, carried, additional):
    cond_fn, body_fn = ctx.subgraph(cond_gm), ctx.subgraph(body_gm)
    carried = tuple(jnp.asarray(c) for c in carried)

    def body(carry):
        out = body_fn(*carry, *additional)
        # keep the carry's dtypes and weak types fixed across iterations
        return tuple(jnp.asarray(o).astype(c.dtype) for o, c in zip(out, carry))

    return list(lax.while_loop(lambda c: jnp.asarray(cond_fn(*c, *additional)[0]).reshape(()), body, carried))


# scan(GraphModule combine_fn, Tensor[] init, Tensor[] xs, Tensor[] additional_inputs) -> Tensor[]
#   combine_fn(*carry, *x_slices, *additional) -> (*next_carry, *y_slices); scans dim 0.
@lower(hop.scan)
def _scan(ctx, combine_gm, init, xs, additional):
    fn = ctx.subgraph(combine_gm)
    n_carry = len(init)

    def step(carry, x):
        out = fn(*carry, *x, *additional)
        next_carry = tuple(jnp.asarray(o).astype(c.dtype) for o, c in zip(out[:n_carry], carry))
        return next_carry, tuple(out[n_carry:])

    carry, ys = lax.scan(step, tuple(init), tuple(xs))
    return [*carry, *ys]
