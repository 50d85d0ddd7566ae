"""Mixtures of experts on the generic step (exporter/llm/hf_experts.py): 16-bit experts are one
`hloserve.grouped_experts` composite per layer body, run by the CPU kernel where it is built.

Tolerance as test_hf_causal's 16-bit rows: bf16 matrices and K/V under f32 activations, logits
O(0.5) through the layers against the f32 transformers model: each product's inputs rounded to
bf16 (2^-8 relative) bound the logits' difference by 2e-2; a wrong expert, weight or row moves them
by O(0.1).
"""
from __future__ import annotations

import pytest
from hloserve.quantization.convert import QuantRecord

from .test_hf_causal import compare_last_logits
from .test_hf_layers import _export, _model

pytestmark = pytest.mark.slow


def test_16_bit_experts_are_one_grouped_composite_per_layer_body(tmp_path):
    """Qwen3-MoE, three layers scanned, 8 experts of which each token takes 2 (a decode of one
    sequence leaves 6 without rows; the 40-token prompt reaches all): one grouped experts composite
    in the decode function, none of the per-expert loop's linears, and logits as transformers'."""
    hf = _model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True)
    manifest, model, mlir = _export(hf, tmp_path, "--dtype", "bfloat16")
    assert manifest["model"]["llm"]["layers"] == "scan"
    assert mlir.count('stablehlo.composite "hloserve.grouped_experts"') == 1
    assert mlir.count('stablehlo.composite "hloserve.layer_linear"') == 4 + 1   # q k v o, the head (not the router)
    compare_last_logits(model, hf.float(), 2e-2, "qwen3_moe bf16")


def _weight_bytes(art) -> int:
    return (art / "weights.safetensors").stat().st_size


@pytest.mark.parametrize("spec,step", [("int8", 1 / 127), ("int4", 2 / 15)])
def test_quantized_experts_are_one_quant_composite_per_layer_body(tmp_path, spec, step):
    """--quantize int8 / int4 on the Qwen3-MoE shape: the experts stored in the linears' scheme (the
    manifest records each stack's scheme), one quant_experts composite in the decode function and no
    grouped (16-bit) one; logits as the same quantized model's torch eager forward (the custom ops'
    references: summation order and the activations' Q8_0 rounding aside, 2e-3), and as the f32
    model's within what quantization allows: each product in series (q k v o, gate_up, down per layer,
    the head: 19) moves the logits by at most its weights' half step (`step` / 2 of a group's range
    over its largest magnitude, int4's range up to twice it) plus the activations' (1 / 254), relative
    to the largest logit. The artifact's weights shrink against the float32 export."""
    import copy

    from hloserve.exporter.llm import hf_experts
    from hloserve.quantization.convert import quantize_module
    from hloserve.quantization.schemes import QuantConfig

    hf = _model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True)
    manifest, model, mlir = _export(hf, tmp_path, "--dtype", "float32", "--quantize", spec)
    assert mlir.count('stablehlo.composite "hloserve.quant_experts"') == 1
    assert 'stablehlo.composite "hloserve.grouped_experts"' not in mlir
    quant = [w["quant"] for w in manifest["weights"].values() if w.get("quant") and "experts" in w["quant"]["of"]]
    assert {(q["scheme"], q["role"]) for q in quant} >= {(f"int{spec[3]}", "qweight"), (f"int{spec[3]}", "scale")}
    assert all(q["shape"][-3:-2] == [8] for q in quant)                 # [L, E, out, in]: every expert stored

    eager = copy.deepcopy(hf)
    config = QuantConfig.parse(spec)
    hf_experts.use_ours(eager)
    quantize_module(eager, config)
    assert hf_experts.quantize_experts(eager, config, QuantRecord()) == 3
    compare_last_logits(model, eager, 2e-3, f"qwen3_moe {spec} eager")
    bound = 19 * (step / 2 * (2 if spec == "int4" else 1) + 1 / 254)
    compare_last_logits(model, hf.float(), bound * _max_logit(hf), f"qwen3_moe {spec} f32")

    f32_dir = tmp_path / "f32"
    f32_dir.mkdir()
    _export(hf, f32_dir, "--dtype", "float32")
    ratio = _weight_bytes(tmp_path / "art") / _weight_bytes(f32_dir / "art")
    assert ratio < (0.35 if spec == "int8" else 0.25), ratio


def _max_logit(hf) -> float:
    """The largest |logit| of the prompts compare_last_logits uses (the bound's scale)."""
    import torch

    from .test_hf_causal import _prompts
    with torch.no_grad():
        return max(float(hf(torch.tensor([p])).logits[0, -1].abs().max()) for p in _prompts([1, 17, 40]))
