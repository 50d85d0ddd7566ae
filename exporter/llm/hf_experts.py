"""Mixture-of-experts layers on the generic step: hloserve's implementation of transformers' experts
interface (`ExpertsInterface`, what `AttentionInterface` is to attention).

transformers' own implementations sort the step's (token, expert) pairs by expert and multiply
ragged groups (`grouped_mm`), whose sizes are data: no static shape to export. Here:

* 16-bit experts with the gated SiLU MLP (Mixtral, Qwen-MoE, OLMoE, ...) are one
  `hloserve.grouped_experts` composite per layer (exporter/composites/grouped_experts.py): its
  decomposition loops over the experts, each one taken multiplying every row of the step; the
  CPU kernel sorts the pairs by expert and reads each expert's matrices once for its own rows.
  The stacks [E, out, in] (or a scanned layer's [L, E, out, in]) are passed whole, with the layer.
* under --quantize int8 / int4, the same experts are stored in the scheme of the linear layers
  (quantize_experts: quantization/convert.py's quantizer, row by row) and are one
  `hloserve.quant_experts` composite per layer (exporter/composites/quant_experts.py), whose CPU
  kernel multiplies the integers directly.
* any other experts (f32 stacks, other activations or gates) run a loop over the experts (a scan,
  so one expert is traced and compiled, not E) that adds each expert's output in a conditional
  branch, taken when the step routes any token to it:

    y = sum_e  cond(any token routed to e,  w_e * down_e(act(gate_e(x)) * up_e(x)),  0)

  where w_e [T] is each token's routing weight for expert e (0 for the tokens not routed to it).
  The branch multiplies all T rows; a 16-bit matrix is read through the layer_linear composite
  (expert e of a scanned layer's [L, E, out, in] stack at row layer * E + e), an f32 one sliced.
"""
from __future__ import annotations

from typing import Mapping

import torch
from hloserve.quantization.convert import QuantRecord, quantize_tensor
from hloserve.quantization.schemes import QuantConfig
from hloserve.runtime.artifact.kernels import Holds

from .._private import scan_lifted
from ..composites import grouped_experts, layer_linear, quant_experts  # noqa: F401 - register torch.ops.hloserve.*
from ..errors import SourceError
from .step import holds_of

EXPERTS_NAME = "hloserve_experts"

# the expert matrices of transformers' experts modules (use_experts_implementation), [E, out, in]
_MATRICES = ("gate_up_proj", "up_proj", "down_proj")


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers experts module (decorated by use_experts_implementation)."""
    return hasattr(module, "has_gate") and hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def use_ours(model: torch.nn.Module) -> bool:
    """Route the model's experts modules through EXPERTS_NAME; returns whether it has any."""
    if not any(is_experts(m) for m in model.modules()):
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, experts_forward)
    model.set_experts_implementation(EXPERTS_NAME)
    return True


def expert_matrices(module: torch.nn.Module) -> list[torch.Tensor]:
    """An experts module's matrices [E, out, in] (none for any other module)."""
    if not is_experts(module):
        return []
    return [t for t in (getattr(module, n, None) for n in _MATRICES) if isinstance(t, torch.Tensor)]


def check_experts(module: torch.nn.Module, where: str) -> None:
    """The experts layouts this implementation computes (SourceError naming what is not)."""
    if module.is_transposed or not module.is_concatenated or module.has_bias or module.has_post_expert_norm:
        raise SourceError(f"{where}: {type(module).__name__}'s experts are transposed, interleaved, biased or "
                         f"post-normed, which hloserve's experts implementation does not compute yet")


def sixteen_bit_experts(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store an experts module's matrices as the int16 bits of `dtype`, read in place through the
    layer_linear composite (a scan substitutes the stack [L, E, out, in] and its iteration)."""
    for name in _MATRICES:
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor):     # [E, out, in] -> its int16 bits
            setattr(module, name, torch.nn.Parameter(w.detach().to(dtype).view(torch.int16), requires_grad=False))
    module.holds = holds_of(dtype)
    module.IN_PLACE = tuple(n for n in _MATRICES if isinstance(getattr(module, n, None), torch.Tensor))
    module.register_buffer("layer", torch.zeros((), dtype=torch.int32), persistent=False)


# the matrices quantize_experts stores quantized, each with its scale (and min) beside it
_QUANTIZED = ("gate_up_proj", "down_proj")


def quantize_experts(model: torch.nn.Module, config: QuantConfig, record: QuantRecord,
                     given: Mapping[str, "torch.dtype | dict"] | None = None) -> int:
    """--quantize's scheme on the gated-SiLU experts modules of `model` (those the grouped composites
    compute; a name config.skip matches stays as it is): gate_up_proj and down_proj [E, out, in]
    become quantization/convert.py's stored tensors (row by row, the group fitted to each matrix's
    input dim), NAME, NAME_scale and NAME_min buffers read in place by the quant_experts composite,
    recorded in `record` for the manifest. Returns how many modules were quantized.

    `given` (a GGUF's own experts, exporter/gguf/quant.py stored_experts): only the modules it
    names, each with {attr: (stored tensors, scheme)} used as they are, or a 16-bit dtype the
    experts are kept in (the grouped_experts composite; a module already 16-bit stays as it is)."""
    done = 0
    for name, m in model.named_modules():
        if not is_experts(m) or not _grouped(m) or config.skipped(name) or (given is not None and name not in given):
            continue
        mine = None if given is None else given[name]
        if isinstance(mine, torch.dtype):
            if getattr(m, "holds", None) is None:
                sixteen_bit_experts(m, mine)
            continue
        groups = []
        for attr in _QUANTIZED:
            w = getattr(m, attr)
            w = w.view(getattr(torch, Holds(m.holds).dtype_name)) if w.dtype == torch.int16 else w   # [E, out, in]
            tensors, scheme = quantize_tensor(w, config.scheme, f"{name}.{attr}") if mine is None else mine[attr]
            record.add(tensors, scheme, tuple(w.shape))
            delattr(m, attr)
            for role, suffix in (("qweight", ""), ("scale", "_scale"), ("min", "_min")):
                m.register_buffer(attr + suffix, tensors.get(role))
            groups.append(scheme.group or w.shape[-1])
        m.hloserve_quant = (scheme.bits, *groups)                   # bits, gate_up's group, down's group
        m.IN_PLACE = tuple(a + suffix for a in _QUANTIZED for suffix in ("", "_scale", "_min"))
        if not hasattr(m, "layer"):
            m.register_buffer("layer", torch.zeros((), dtype=torch.int32), persistent=False)
        done += 1
    return done


def _quantized_forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The quant_experts composite over the module's stored stacks (a scan substitutes [L, ...] ones)."""
    bits, gate_up_group, down_group = self.hloserve_quant

    def stack(attr):   # (qweight [L, E, N, .], scale [L, E, N, G], min or None); per channel: G = 1
        q, scale, mn = (getattr(self, attr + suffix) for suffix in ("", "_scale", "_min"))
        lead = q.shape[:-1]
        scale, mn = (None if t is None else t.reshape(*lead, -1) for t in (scale, mn))
        return (q, scale, mn) if q.dim() == 4 else tuple(None if t is None else t[None] for t in (q, scale, mn))
    return torch.ops.hloserve.quantized_experts(x, index, weights, *stack("gate_up_proj"), *stack("down_proj"),
                                                self.layer, bits, gate_up_group, down_group)


def _linear(w: torch.Tensor, layer: torch.Tensor, holds: int | None, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ expert e's matrix of `w` [E, out, in] (or a scanned stack [L, E, out, in] at
    `layer`)^T -> [T, out] (f32)."""
    if w.dtype != torch.int16:                                       # f32 experts: sliced
        return torch.nn.functional.linear(x, torch.index_select(w, 0, e.reshape(1))[0].to(x.dtype))   # [out, in]
    stack = w if w.dim() == 4 else w[None]                           # [L, E, out, in]
    L, E, out, inp = stack.shape
    row = layer.to(torch.int32) * E + e
    return torch.ops.hloserve.layer_linear(x, stack.reshape(L * E, out, inp), row, holds)   # [L*E, out, in]


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature: hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H].
    A loop over the experts (a scan: one expert traced and compiled, not E) whose body adds expert
    e's output when the step routes a token to it."""
    from torch._higher_order_ops.cond import cond_op


    first = "gate_up_proj" if self.has_gate else "up_proj"
    holds = getattr(self, "holds", None)
    layer = getattr(self, "layer", None)
    layer = torch.zeros((), dtype=torch.int32) if layer is None else layer
    if getattr(self, "hloserve_quant", None) is not None:
        out = _quantized_forward(self, hidden_states.float(), top_k_index.to(torch.int32), top_k_weights.float())
        return out.to(hidden_states.dtype)
    if holds is not None and _grouped(self):
        stacks = [w if w.dim() == 4 else w[None] for w in (self.gate_up_proj, self.down_proj)]   # [L, E, out, in]
        out = torch.ops.hloserve.grouped_experts(hidden_states.float(), top_k_index.to(torch.int32),
                                                 top_k_weights.float(), *stacks, layer, holds)
        return out.to(hidden_states.dtype)
    run = _expert(self, holds)

    def body(out, xs, lifted):
        (e,) = xs                                                    # this expert: int32 []
        x, index, weights, up, down, layer = lifted
        chosen = index == e                                          # [T, k]
        weight = (weights * chosen).sum(-1)                          # [T]
        # every tensor the branches read is an operand (a closed-over traced tensor is refused)
        out = cond_op(chosen.any(), run, _skip, (x, weight, out, up, down, layer, e))
        return out, out.new_zeros(())

    x = hidden_states.float()
    experts = torch.arange(self.num_experts, dtype=torch.int32)
    out, _ = scan_lifted(body, torch.zeros_like(x), (experts,),
                         (x, top_k_index, top_k_weights.float(), getattr(self, first), self.down_proj, layer))
    return out.to(hidden_states.dtype)


def _grouped(module) -> bool:
    """Whether the module computes what the grouped_experts composite does: [gate; up] concatenated,
    the default gating act(gate) * up, and SiLU."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    act = module.act_fn
    silu = isinstance(act, (torch.nn.SiLU, SiLUActivation)) or act is torch.nn.functional.silu
    return (module.has_gate and silu and getattr(module, "gate_up_proj", None) is not None
            and getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate)


def _expert(module, holds: int | None):
    """The branch that adds expert e's output, weighted per token, to `out`."""
    from transformers.integrations.moe import _default_apply_gate

    # the activation's forward, not its module call: the branch is traced apart from the model's
    # module tree (a scanned layer's template is not in it), where torch.export cannot name a module
    act = module.act_fn.forward if isinstance(module.act_fn, torch.nn.Module) else module.act_fn
    fused = getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate

    def run(x, weight, out, up, down, layer, e):
        h = _linear(up, layer, holds, x, e)                          # [T, 2I] or [T, I]
        if module.has_gate and fused:
            gate, h = h.chunk(2, dim=-1)                             # [T, I] each: [gate; up]
            h = act(gate) * h
        elif module.has_gate:
            h = module._apply_gate(h)
        else:
            h = act(h)
        return out + _linear(down, layer, holds, h, e) * weight[:, None]
    return run


def _skip(x, weight, out, up, down, layer, e):
    return out.clone()
