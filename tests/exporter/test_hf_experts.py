"""Mixtures of experts on the generic step (exporter/llm/hf_experts.py): 16-bit experts are one
`hloserve.grouped_experts` composite per layer body, run by the CPU kernel where it is built.

Tolerance as test_hf_causal's 16-bit rows: bf16 matrices and K/V under f32 activations, logits
O(0.5) through the layers against the f32 transformers model: each product's inputs rounded to
bf16 (2^-8 relative) bound the logits' difference by 2e-2; a wrong expert, weight or row moves them
by O(0.1).
"""
from __future__ import annotations

import pytest

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
