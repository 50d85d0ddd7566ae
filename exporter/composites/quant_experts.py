"""The `hloserve.quant_experts` composite, export side: a mixture-of-experts layer's experts (gated
SiLU MLPs) over int8 / int4 stacks, each token's chosen experts weighted and added; what
grouped_experts computes for 16-bit stacks, with each product quant_linear's.

    torch side   hloserve::quantized_experts(x, index, weights, gate_up, gate_up_scale, gate_up_min,
                 down, down_scale, down_min, layer, bits, gate_up_group, down_group)
                 eager form = the torch reference (each expert over only the rows routed to it)
    jax side     quant_experts_reference: the portable decomposition
    lowering     quantized_experts -> a `stablehlo.composite` carrying its decomposition

The stacks are quantization/schemes.py's row-by-row layout with one more leading dim: qweight
[L, E, N, K | K/2], scale (and min) [L, E, N, K / group] (per output channel: group = K). Each
product is the `hloserve.quant_linear` contract's: the rows quantized per 32-element block as Q8_0,
W = q * scale (+ min) per group, sums in f32; the activation silu(gate) * up is computed in f32 and
quantized the same way for down. The decomposition loops over the experts as grouped_experts'
does (an expert some token chose multiplies every row of the step, dequantizing its matrices next
to the dot: quant_linear's layer_product); the CPU kernel (runtime/kernels/cpu/experts.cc) groups
the rows by expert and multiplies the integers directly. The contract is runtime/artifact/kernels.py's
QUANT_EXPERTS.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from hloserve.quantization import modules as _qmodules
from hloserve.runtime.artifact.kernels import QUANT_EXPERTS
from jax import lax

from .. import _private
from ..registry import lower
from .quant_linear import layer_product


# -- the torch side ----------------------------------------------------------------------------------
def _product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: Optional[torch.Tensor], bits: int,
             group: int) -> torch.Tensor:
    """x f32 [n, K] times one stored matrix [N, K | K/2] as the quant_linear contract says -> [n, N]."""
    return F.linear(_qmodules.quantize_blocks(x), _qmodules.dequantize(q, scale, mn, bits, group))


@torch.library.custom_op("hloserve::quantized_experts", mutates_args=())
def quantized_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scale: torch.Tensor, gate_up_min: Optional[torch.Tensor], down: torch.Tensor,
                      down_scale: torch.Tensor, down_min: Optional[torch.Tensor], layer: torch.Tensor, bits: int,
                      gate_up_group: int, down_group: int) -> torch.Tensor:
    i = int(layer)
    f = gate_up.shape[2] // 2
    x = x.float()
    out = torch.zeros_like(x)
    for e in index.unique().tolist():
        token, slot = (index == e).nonzero(as_tuple=True)                   # the rows routed to e
        gu = (gate_up[i, e], gate_up_scale[i, e], None if gate_up_min is None else gate_up_min[i, e])
        dn = (down[i, e], down_scale[i, e], None if down_min is None else down_min[i, e])
        h = _product(x[token], *gu, bits, gate_up_group)                     # [n, 2F]
        y = _product(F.silu(h[:, :f]) * h[:, f:], *dn, bits, down_group)    # [n, D]
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out


@quantized_experts.register_fake
def _(x, index, weights, gate_up, gate_up_scale, gate_up_min, down, down_scale, down_min, layer, bits,
      gate_up_group, down_group):
    return x.new_empty(x.shape, dtype=torch.float32)


# -- the jax side -------------------------------------------------------------------------------------
def quant_experts_reference(x, index, weights, gate_up, gate_up_scale, gate_up_min, down, down_scale, down_min,
                            layer, *, bits: int, gate_up_group: int, down_group: int):
    """The composite's decomposition: x f32[T, D], index s32[T, k], weights f32[T, k], the stacks as
    the module docstring says (a min of no elements: symmetric), layer s32[] -> f32[T, D]. A loop over
    the experts; one that no token chose is skipped, one that some token chose multiplies all T rows
    (each row weighted by its routing weight for the expert, 0 if none)."""
    E, f = gate_up.shape[1], gate_up.shape[2] // 2

    def matrix(stored, e):
        """Expert e of layer `layer`: (qweight, scale, min or None)."""
        def at(a):
            return lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(a, layer, 0, False), e, 0, False)
        q, scale, mn = stored
        return at(q), at(scale), at(mn) if mn.size else None

    def expert(e, out):
        chosen = index == e                                                  # [T, k]

        def run(out):
            h = layer_product(x, *matrix((gate_up, gate_up_scale, gate_up_min), e), bits, gate_up_group)   # [T, 2F]
            a = jax.nn.silu(h[:, :f]) * h[:, f:]
            y = layer_product(a, *matrix((down, down_scale, down_min), e), bits, down_group)             # [T, D]
            return out + y * jnp.sum(jnp.where(chosen, weights, 0.0), axis=-1)[:, None]
        return lax.cond(jnp.any(chosen), run, lambda out: out, out)

    return lax.fori_loop(0, E, expert, jnp.zeros(x.shape, jnp.float32))


# hloserve::quantized_experts(Tensor x, Tensor index, Tensor weights, Tensor gate_up, Tensor gate_up_scale,
#     Tensor? gate_up_min, Tensor down, Tensor down_scale, Tensor? down_min, Tensor layer, int bits,
#     int gate_up_group, int down_group) -> Tensor
@lower(torch.ops.hloserve.quantized_experts)
def _lower_quantized_experts(ctx, x, index, weights, gate_up, gate_up_scale, gate_up_min, down, down_scale, down_min,
                             layer, bits, gate_up_group, down_group):
    composite = _private.composite(quant_experts_reference, QUANT_EXPERTS.name, QUANT_EXPERTS.version)
    none = jnp.zeros((0,), jnp.float32)
    return composite(x.astype(jnp.float32), index.astype(jnp.int32), weights.astype(jnp.float32), gate_up,
                     gate_up_scale, none if gate_up_min is None else gate_up_min, down, down_scale,
                     none if down_min is None else down_min, jnp.asarray(layer, jnp.int32).reshape(()),
                     bits=int(bits), gate_up_group=int(gate_up_group), down_group=int(down_group))
