"""Mixture-of-experts GGUF files (llama.cpp's qwen3moe, qwen2moe; Mixtral's, which llama.cpp
writes as "llama" with experts) as transformers' experts modules.

    EXPERT_NAMES           GGUF layer tensor -> HF name under model.layers.N (router and experts)
    SHARED_NAMES           the same for qwen2moe's shared expert and its sigmoid gate
    is_mixtral(arch, infos)         a "llama" file with a router: MIXTRAL's model type and class
    moe_config(meta, arch, infos)   the config's experts fields from {arch}.expert_* metadata
    hf_shape(name, shape)           a tensor's torch shape in transformers' model (the shared gate's row)
    merge_gate_up(weights)          gate_proj + up_proj stacks -> transformers' gate_up_proj

llama.cpp stores a layer's experts as three 3-D tensors, ggml dims [in, out, E] (torch order
[E, out, in]): ffn_gate_exps and ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]; the router
ffn_gate_inp [E, H]. transformers 5 holds the experts as fused parameters of an experts module:
gate_up_proj [E, 2I, H] (gate rows first, then up) and down_proj [E, H, I]; the router is
mlp.gate.weight. The checkpoint names the file's stacks mlp.experts.{gate,up,down}_proj (one GGUF
tensor each, their blocks kept for --quantize gguf, exporter/gguf/quant.py stored_experts); the
float weights the model loads join gate and up (merge_gate_up). A layer without ffn_gate_inp is a
dense one (transformers' mlp_only_layers).

Routing as llama.cpp computes it: softmax over the experts, the top expert_used_count, their
weights renormalized to sum 1 where {arch}.expert_weights_norm says so, or by default for qwen3moe
(llama.cpp's qwen3moe graph normalizes, its qwen2moe graph does not; transformers' GGUF loader
sets norm_topk_prob the same way). qwen2moe adds a shared expert (ffn_{gate,up,down}_shexp, a
dense gated MLP of expert_shared_feed_forward_length) scaled by sigmoid(ffn_gate_inp_shexp . x),
a vector [H] in the file, transformers' shared_expert_gate.weight [1, H].
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ..errors import SourceError
from . import validate
from .header import TensorInfo

if TYPE_CHECKING:
    import torch

# llama.cpp mixture-of-experts architecture -> (HF model_type, HF architecture class, q/k rows permuted)
MOE_ARCHITECTURES: Mapping[str, tuple[str, str, bool]] = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
}
# a "llama" file whose layers have routers: Mixtral (q/k rows permuted, as llama's)
MIXTRAL = ("mixtral", "MixtralForCausalLM", True)
# a layer whose FFN is experts has these in place of validate.DENSE_FFN
EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
SHARED_NAMES = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Qwen3's per-head RMS norms of q and k
QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# llama.cpp's routing weight normalization when the file does not say (its qwen3moe graph: on)
_NORM_DEFAULT = {"qwen3moe": True, "qwen2moe": False}
_SOFTMAX = 1   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def moe_config(meta: validate.Metadata, arch: str, infos: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """The transformers config's experts fields: num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, and mlp_only_layers (the layers without a router)."""
    experts = meta.integer(f"{arch}.expert_count", lo=2, hi=1 << 16)
    used = meta.integer(f"{arch}.expert_used_count", lo=1, hi=experts)
    gating = meta.integer(f"{arch}.expert_gating_func", _SOFTMAX)
    if gating != _SOFTMAX:
        raise SourceError(f"{meta.where}: {arch}.expert_gating_func = {gating}; the {arch} experts are routed by a "
                          f"softmax ({_SOFTMAX}) in transformers' model, which the generic step runs: re-convert it")
    ff = meta.integer(f"{arch}.expert_feed_forward_length", meta.integer(f"{arch}.feed_forward_length", lo=1)
                      if arch == "llama" else validate.REQUIRED, lo=1)
    scale = meta.number(f"{arch}.expert_weights_scale", 1.0)
    if scale != 1.0:
        raise SourceError(f"{meta.where}: {arch}.expert_weights_scale = {scale}; transformers' {arch} model does not "
                          f"scale the routing weights: re-convert it")
    if arch == "llama":
        return _mixtral(meta, infos, experts, used, ff)
    layers = {at[0] for at in map(validate.layer_of, infos) if at is not None}
    shared = {"shared_expert_intermediate_size": meta.integer(f"{arch}.expert_shared_feed_forward_length", lo=1)} \
        if arch in validate.SHARED_FFN else {}
    return {
        **shared,
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": ff,
        "norm_topk_prob": meta.flag(f"{arch}.expert_weights_norm", _NORM_DEFAULT[arch]),
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in infos),
    }


def is_mixtral(arch: str, infos: Mapping[str, TensorInfo]) -> bool:
    """Whether a file is Mixtral: llama.cpp writes it as "llama" whose layers have routers."""
    return arch == "llama" and any(name.endswith(".ffn_gate_inp.weight") for name in infos)


def _mixtral(meta: validate.Metadata, infos: Mapping[str, TensorInfo], experts: int, used: int, ff: int
             ) -> dict[str, Any]:
    """Mixtral's config fields: transformers' MixtralConfig counts num_local_experts, sizes its experts
    by intermediate_size, routes every layer and always renormalizes the top-k weights (num_experts and
    moe_intermediate_size stay for validate's checks)."""
    layers = [at for at in map(validate.layer_of, infos) if at is not None]
    dense = sorted({i for i, _ in layers} - {i for i, kind in layers if kind == "ffn_gate_inp.weight"})
    if dense or not meta.flag("llama.expert_weights_norm", True):
        what = f"layer {dense[0]} has no router" if dense else "llama.expert_weights_norm is false"
        raise SourceError(f"{meta.where}: a llama file with experts is Mixtral, but {what}; transformers' "
                          f"MixtralForCausalLM routes every layer and renormalizes the top-k weights: re-convert it")
    return {"num_local_experts": experts, "num_experts": experts, "num_experts_per_tok": used,
            "intermediate_size": ff, "moe_intermediate_size": ff, "mlp_only_layers": []}


def hf_shape(gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape of a tensor in transformers' model: the file's (ggml dims reversed), but for
    the shared expert's gate, a vector [H] in llama.cpp's files, transformers' Linear(H, 1) weight."""
    return (1, *shape) if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 1 else shape


def merge_gate_up(weights: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """HF-named weights with each layer's experts gate_proj and up_proj [E, I, H] replaced by their
    concatenation gate_up_proj [E, 2I, H] (transformers' layout: gate rows, then up rows)."""
    import torch

    for name in [n for n in weights if n.endswith(".experts.gate_proj")]:
        base = name[:-len("gate_proj")]
        weights[base + "gate_up_proj"] = torch.cat([weights.pop(name), weights.pop(base + "up_proj")], dim=1)
    return weights
