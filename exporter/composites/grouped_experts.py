"""The `hloserve.grouped_experts` composite, export side: a mixture-of-experts layer's experts (gated
SiLU MLPs over stacks of 16-bit matrices), each token's chosen experts weighted and added.

    torch side   hloserve::grouped_experts(x, index, weights, gate_up, down, layer, holds)
                 eager form = the torch reference (each expert over only the rows routed to it)
    jax side     grouped_experts_reference: the portable decomposition
    lowering     grouped_experts -> a `stablehlo.composite` carrying its decomposition

The decomposition loops over the experts; an expert some token chose multiplies every row of the
step (a conditional skips the others), because the rows an expert gets are data and a portable
program has static shapes. So a step whose T tokens reach most of the E experts computes about
E/k times the products the routing needs. The CPU kernel (runtime/kernels/cpu/experts.cc) sorts
the T k (token, slot) pairs by expert and multiplies each expert's matrices once by its own rows.

Rounding is that of two layer_linear products: x rounded to the matrices' dtype for gate_up, the
activation silu(gate) * up (f32) rounded again for down; products exact, sums in f32. The contract
is runtime/artifact/kernels.py's GROUPED_EXPERTS.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from hloserve.runtime.artifact.kernels import GROUPED_EXPERTS, Holds
from jax import lax

from .. import _private
from ..bits import from_bits, held, to_bits
from ..registry import lower
from .layer_linear import mixed_dot, mixed_linear


# -- the torch side ----------------------------------------------------------------------------------
# hloserve::grouped_experts: x f32[T, D], index [T, k] (expert ids), weights [T, k], gate_up
# [L, E, 2F, D] and down [L, E, D, F] (16-bit floats, or their bits in int16 as `holds` says),
# layer (0-dim) -> f32[T, D].

@torch.library.custom_op("hloserve::grouped_experts", mutates_args=())
def grouped_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, layer: torch.Tensor, holds: int) -> torch.Tensor:
    dtype = getattr(torch, Holds(holds).dtype_name)
    gu, dn = (w[int(layer)] for w in (gate_up, down))                        # [E, 2F, D], [E, D, F]
    gu, dn = (w.view(dtype) if w.dtype == torch.int16 else w for w in (gu, dn))
    f = gu.shape[1] // 2
    x = x.float()
    out = torch.zeros_like(x)
    for e in index.unique().tolist():
        token, slot = (index == e).nonzero(as_tuple=True)                   # the rows routed to e
        h = mixed_linear(x[token], gu[e], None)                             # [n, 2F]
        y = mixed_linear(F.silu(h[:, :f]) * h[:, f:], dn[e], None)          # [n, D]
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out


@grouped_experts.register_fake
def _(x, index, weights, gate_up, down, layer, holds):
    return x.new_empty(x.shape, dtype=torch.float32)


# -- the jax side -------------------------------------------------------------------------------------
def grouped_experts_reference(x, index, weights, gate_up, down, layer, *, holds):
    """The composite's decomposition: x f32[T, D], index s32[T, k], weights f32[T, k], gate_up
    [L, E, 2F, D], down [L, E, D, F] (16-bit floats or their bits), layer s32[] -> f32[T, D].
    A loop over the experts; one that no token chose is skipped, one that some token chose
    multiplies all T rows (each row weighted by its routing weight for the expert, 0 if none)."""
    dtype = held(holds)
    _, E, F2, D = gate_up.shape
    f = F2 // 2
    gate_up, down = to_bits(gate_up), to_bits(down)     # sliced as bits (exporter/bits.py)

    def matrix(stack, e):
        _, _, n, k = stack.shape
        return from_bits(lax.dynamic_slice(stack, (layer, e, 0, 0), (1, 1, n, k)).reshape(n, k), dtype)

    def expert(e, out):
        chosen = index == e                                                  # [T, k]

        def run(out):
            h = mixed_dot(x, matrix(gate_up, e))                             # [T, 2F]
            y = mixed_dot(jax.nn.silu(h[:, :f]) * h[:, f:], matrix(down, e))  # [T, D]
            return out + y * jnp.sum(jnp.where(chosen, weights, 0.0), axis=-1)[:, None]
        return lax.cond(jnp.any(chosen), run, lambda out: out, out)

    return lax.fori_loop(0, E, expert, jnp.zeros(x.shape, jnp.float32))


# hloserve::grouped_experts(Tensor x, Tensor index, Tensor weights, Tensor gate_up, Tensor down,
#                           Tensor layer, int holds) -> Tensor
@lower(torch.ops.hloserve.grouped_experts)
def _lower_grouped_experts(ctx, x, index, weights, gate_up, down, layer, holds):
    composite = _private.composite(grouped_experts_reference, GROUPED_EXPERTS.name, GROUPED_EXPERTS.version)
    return composite(x.astype(jnp.float32), index.astype(jnp.int32), weights.astype(jnp.float32), gate_up, down,
                     jnp.asarray(layer, jnp.int32).reshape(()), holds=int(holds))
