"""Mixtures of experts on the generic step (exporter/llm/hf_experts.py): 16-bit experts are one
`hloserve.grouped_experts` composite per layer body, quantized ones (--quantize) one
`hloserve.quant_experts` composite, each run by its CPU kernel where it is built.

Tolerance as test_hf_causal's 16-bit rows: bf16 matrices and K/V under f32 activations, logits
O(0.5) through the layers against the f32 transformers model: each product's inputs rounded to
bf16 (2^-8 relative) bound the logits' difference by 2e-2; a wrong expert, weight or row moves them
by O(0.1). The quantized test's tolerances are derived in its docstring.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hloserve.quantization import modules as qmodules
from hloserve.quantization.convert import QuantRecord
from hloserve.runtime.kernels.cpu import build

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
    assert mlir.count('stablehlo.composite "hloserve.layer_linear"') == 2 + 1   # q/k/v fused, o, the head (not the router)
    if build.enabled() and build.cpu().has("amx_bf16"):   # the experts' stacks laid out as B tiles at load
        assert {w for w in model.layouts if "experts" in w} == {w for w in manifest["weights"] if "experts" in w}
    compare_last_logits(model, hf.float(), 2e-2, "qwen3_moe bf16")


def _weight_bytes(art) -> int:
    return (art / "weights.safetensors").stat().st_size


def _quantization_error(hf, scheme) -> float:
    """The largest relative RMS error ||deq(q(W)) - W|| / ||W|| of the model's matrices (the experts'
    stacks, the linears, the embedding) in `scheme` (fitted to each input dim, as --quantize does),
    plus the activations' (Q8_0 of a Gaussian row): what one product's relative error is made of."""
    from hloserve.quantization import primitives

    errs = []
    for w in (p.detach().float().numpy() for p in hf.parameters() if p.dim() >= 2):
        back = primitives.dequantize(primitives.quantize(w, scheme.fitted(w.shape[-1])))
        errs.append(np.linalg.norm(back - w) / np.linalg.norm(w))
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32))
    return max(errs) + float((qmodules.quantize_blocks(x) - x).norm() / x.norm())


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_quantized_experts_are_one_quant_composite_per_layer_body(tmp_path, capsys, spec):
    """--quantize int8 / int4 on the Qwen3-MoE shape: the experts stored in the linears' scheme (the
    manifest records each stack's scheme), one quant_experts composite in the decode function and no
    grouped (16-bit) one; logits as the same quantized model's torch eager forward (the custom ops'
    references) within 1e-2, test_hf_causal's bound for quantized linears: both sides round each
    linear's input to int8 per block of 32, and f32 summation-order noise upstream can move an
    activation across a rounding boundary, each such flip moving one product by max|x_block| / 127
    times its weight (the AVX512-VNNI kernels' order gave 3.8e-3 on an AMD EPYC, the AMX ones' under
    2e-3); a wrong expert, scale or row moves them by O(0.1). And as the f32 model's within what
    quantization allows: each of the
    19 products in series (q k v o, gate_up, down per layer, the head) adds a relative error e (the
    weights' and activations' relative RMS quantization error, measured), independent from product to
    product, so the logits' RMS difference is bounded by sqrt(19) e of their RMS. The artifact's
    weights shrink against the float32 export (ratio bound: int8 a byte, int4 ~5/8 of one, per f32
    weight of 4 bytes, with f16 scales every 32)."""
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
    assert all(q["shape"][-3] == 8 for q in quant)                     # [L, E, out, in]: every expert stored
    from hloserve.server.cli import main
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "art")]) == 0
    shown = [ln for ln in capsys.readouterr().out.splitlines() if "experts" in ln and f"int{spec[3]} g32" in ln]
    assert len(shown) == 2, shown                                     # gate_up_proj and down_proj, [3, 8, ., .]

    eager = copy.deepcopy(hf)
    config = QuantConfig.parse(spec)
    hf_experts.use_ours(eager)
    quantize_module(eager, config)
    assert hf_experts.quantize_experts(eager, config, QuantRecord()) == 3
    compare_last_logits(model, eager, 1e-2, f"qwen3_moe {spec} eager")

    got, want = _last_logits(model, hf.float())
    bound = np.sqrt(19) * _quantization_error(hf, config.scheme)
    rms = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2))
    assert 0 < rms <= bound, (rms, bound)

    f32_dir = tmp_path / "f32"
    f32_dir.mkdir()
    _export(hf, f32_dir, "--dtype", "float32")
    ratio = _weight_bytes(tmp_path / "art") / _weight_bytes(f32_dir / "art")
    assert ratio < (1 + 2 / 32) / 4 * (1 if spec == "int8" else 5 / 8) + 0.02, ratio


def _last_logits(model, ref):
    """Decode's last-token logits of compare_last_logits' prompts, and `ref`'s (transformers), stacked."""
    from .step_driver import Paged
    from .test_hf_causal import _prompts
    prompts = _prompts([1, 17, 40])
    got = Paged(model).step("decode", dict(enumerate(prompts)))
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0, -1].numpy() for p in prompts]
    return np.stack([got[i] for i in range(len(prompts))]), np.stack(want)
