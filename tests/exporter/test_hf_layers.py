"""The generic step's scanned layers and 16-bit linears (exporter/llm/hf_layers.py).

A scanned step must compute what the model's own layer loop computes: last-token logits of f32
models within 1e-4 of transformers (as tests/exporter/test_hf_causal.py, whose two-layer models
scan too), with more layers than one period so the loop really iterates, and a tail of layers
after the last whole period. What makes it a scan is read from the exported StableHLO: one
layer body (or one per period position, plus the tail), not one per layer.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from ..reference import hf_with_mixed_linears
from .test_hf_causal import VOCAB, compare_last_logits

pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, head_dim=16)


def _model(cls_name: str, cfg_name: str, **kw):
    import transformers
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**{**SMALL, **kw})).eval()


def _export(hf, tmp_path, *args):
    from hloserve.runtime import load
    from hloserve.server.cli import main
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["export", str(tmp_path / "hf"), "-o", str(tmp_path / "art"), "--llm-step", "generic", "-q",
                 *args]) == 0
    with open(tmp_path / "art" / "manifest.json") as f:
        manifest = json.load(f)
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [1, 8, 64], "num_seqs": [1, 8], "max_blocks": [8]})
    return manifest, model, (tmp_path / "art" / "functions" / "decode.mlir").read_text()


def test_gemma3_sliding_and_global_layers_are_one_scanned_body(tmp_path):
    """Seven layers, sliding/global alternating (local and global rotary tables): one body scanned
    seven times, each layer's window a row of the scan's data (paged attention version 2, the
    window an operand), the layer's rotary table picked per iteration. One attention call in the
    decode function, not seven. The prompts (up to 40 tokens) pass the window of 8."""
    kinds = ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]
    hf = _model("Gemma3ForCausalLM", "Gemma3TextConfig", num_hidden_layers=7, sliding_window=8,
                query_pre_attn_scalar=20, layer_types=kinds)
    manifest, model, mlir = _export(hf, tmp_path, "--dtype", "float32")
    assert manifest["model"]["llm"]["layers"] == "scan"
    assert mlir.count('stablehlo.composite "hloserve.paged_attention"') == 1
    assert re.search(r'composite "hloserve.paged_attention".*version = 2', mlir)
    assert "stablehlo.while" in mlir
    compare_last_logits(model, hf, 1e-4)


def _llama_q4_k_m_mix(n: int) -> list[str]:
    """The down matrices' types of an n-layer llama.cpp Q4_K_M file (use_more_bits: Q6_K)."""
    return ["Q6_K" if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 else "Q4_K" for i in range(n)]


@pytest.mark.parametrize("kinds, plan", [
    (["a"] * 30, [(0, 1, 30)]),                                         # one body
    (["a", "b"] * 3 + ["a"], [(0, 2, 3)]),                              # a period, one layer unrolled after it
    (["a", "b"], [(0, 2, 1)]),                                          # nothing repeats: one pass of both
    (["a"] * 5 + ["b"], [(0, 1, 5)]),                                   # 2 bodies, not a period of 6
    (_llama_q4_k_m_mix(30), [(0, 1, 2), (2, 3, 8), (26, 1, 4)]),        # SmolLM2's Q4_K_M: 5 bodies, not 30
    (_llama_q4_k_m_mix(8), [(0, 3, 2), (6, 1, 2)]),
])
def test_layer_plan_scans_segments_where_one_period_would_unroll(kinds, plan):
    """layer_plan keeps one scan of the smallest period (the last L % period layers unrolled) unless
    consecutive segments of their own periods trace fewer layer bodies; the layers no segment holds
    run unrolled, and every layer is in at most one segment."""
    from hloserve.exporter.llm.layer_plan import layer_plan
    got = layer_plan(kinds)
    assert [(g.start, g.period, g.iterations) for g in got] == plan
    for g in got:
        assert all(kinds[i] == kinds[i - g.period] for i in range(g.start + g.period, g.stop))
    assert all(a.stop <= b.start for a, b in zip(got, got[1:]))


def test_a_model_that_branches_on_its_window_is_scanned_by_period(tmp_path):
    """Cohere 2 rotates q/k only in its sliding layers (`if self.sliding_window is not None`): one
    body carrying the window as data would rotate every layer's, which the export's check (the
    scanned step against the unrolled one, eager) sees, so the layers are scanned by period."""
    from hloserve.exporter.llm import hf_layers
    from hloserve.exporter.llm.hf_causal import WINDOW, from_hf_directory
    hf = _model("Cohere2ForCausalLM", "Cohere2Config", num_hidden_layers=4, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2)
    # the layers differ in nothing but their window: the period comes from the check
    assert len({hf_layers._static_signature(m, WINDOW.names) for m in hf.model.layers}) == 1
    hf.save_pretrained(str(tmp_path / "hf"))
    src = from_hf_directory(str(tmp_path / "hf"))
    assert src.model["llm"].model.layers == "scan (a period of 2 layers)"


def test_bf16_checkpoint_exports_as_the_serving_step(tmp_path):
    """A Qwen3 stored in bf16 (config dtype), exported with no dtype flag: 16-bit weight matrices
    and KV cache under f32 activations, every linear and the tied head through layer_linear (one
    body: 4 calls per layer, q/k/v and gate/up fused, 1 head), three layers scanned. Compared with transformers computing
    every linear as layer_linear does (weights and inputs rounded to bf16, f32 sums, K/V rounded
    to bf16): logits O(0.5) through three layers; what is left is K rounded after RoPE here and
    before it there (2^-8 relative on each score), bounded by 1e-2."""
    hf = _model("Qwen3ForCausalLM", "Qwen3Config", num_hidden_layers=3, tie_word_embeddings=True)
    manifest, model, mlir = _export(hf.to(torch.bfloat16), tmp_path)
    llm = manifest["model"]["llm"]
    assert llm["kv_cache"]["holds"] == "bf16" and llm["layers"] == "scan"
    assert mlir.count('stablehlo.composite "hloserve.layer_linear"') == 4 + 1
    assert mlir.count('stablehlo.composite "hloserve.paged_attention"') == 1
    ref = hf_with_mixed_linears(hf.float(), kv_dtype=torch.bfloat16)
    compare_last_logits(model, ref, 1e-2)


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    from hloserve.exporter.sources import auto_dtypes
    hf = _model("Qwen3ForCausalLM", "Qwen3Config", num_hidden_layers=1)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    hf.float().save_pretrained(str(tmp_path / "f32"))
    assert auto_dtypes(str(tmp_path / "bf16"), "auto", None, None) == ("float32", "bfloat16", "bfloat16")
    assert auto_dtypes(str(tmp_path / "f32"), "auto", None, None) == ("float32", None, None)
    assert auto_dtypes(str(tmp_path / "bf16"), "float32", None, None) == ("float32", None, None)
    assert auto_dtypes(str(tmp_path / "bf16"), "auto", None, "float16") == ("float32", None, "float16")


def test_a_16_bit_checkpoint_loads_in_its_dtype_as_the_wide_load_would(tmp_path):
    """A bf16 Gemma 3 checkpoint, its matrices stored in bf16 under f32 activations: loaded in bf16
    (no widening and narrowing back) it holds what the f32 load and sixteen_bit hold, tensor for
    tensor and bit for bit, ties kept; its embedding scale (a non-persistent buffer computed in the
    default dtype, bf16 in a bf16 load) is the f32 load's."""
    import transformers
    from hloserve.exporter.llm import hf_causal, hf_layers
    hf = _model("Gemma3ForCausalLM", "Gemma3TextConfig", num_hidden_layers=2, sliding_window=8,
                query_pre_attn_scalar=20, hidden_size=72, layer_types=["sliding_attention", "full_attention"])
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    hf_causal.register_attention()
    wide = transformers.Gemma3ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                          attn_implementation=hf_causal.ATTN_NAME)
    hf_layers.sixteen_bit(wide, torch.bfloat16)
    loaded = hf_causal.load_model(transformers.Gemma3ForCausalLM, str(tmp_path / "hf"), torch.float32, torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16          # loaded in its dtype
    hf_layers.sixteen_bit(loaded, torch.bfloat16, torch.float32)

    def tensors(m):
        return [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]

    a, b = tensors(wide), tensors(loaded)
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert loaded.model.embed_tokens.embed_scale.dtype == torch.float32
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and loaded.config.dtype == torch.float32


def test_q_k_v_and_gate_up_fuse_into_one_matrix_each_that_splits_by_kv_head_and_row():
    """fuse_projections on a bf16 Llama (4 query heads over 2 KV heads): every sibling returns exactly
    what it returned alone, the three q/k/v calls on one input compute ONE fused product (a new
    input gets its own), the model's logits are unchanged, and the fused rows are laid out so that
    halving them hands each half whole KV groups (its query heads, its key, its value) and matching
    gate and up rows, which is what tensor_parallel_dims' row split relies on."""
    from hloserve.exporter.llm import hf_layers

    hf = _model("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=2)
    hf_layers.sixteen_bit(hf, torch.bfloat16, torch.float32)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    x = torch.randn(3, 64)
    alone = {n: getattr(attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
    alone |= {n: getattr(mlp, n)(x) for n in ("gate_proj", "up_proj")}
    rows = {n: getattr(m, n).weight.clone() for m, names in ((attn, "qkv"), (mlp, ("gate", "up")))
            for n in [f"{k}_proj" for k in names]}
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = hf(ids).logits

    assert hf_layers.fuse_projections(hf, num_kv_heads=2) == 4          # 2 layers x (q/k/v, gate/up)
    qkv, gate_up = attn.fused_qkv_proj, mlp.fused_gate_up_proj
    products = []
    qkv.register_forward_hook(lambda m, a, out: products.append(out))
    for n in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, n)(x), alone[n]), n
    assert len(products) == 1, "the three siblings computed the fused product more than once"
    other = torch.randn(3, 64)
    assert torch.equal(attn.k_proj(other), hf_layers.LayerLinear(rows["k_proj"], None, torch.bfloat16)(other))
    assert len(products) == 2
    for n in ("gate_proj", "up_proj"):
        assert torch.equal(getattr(mlp, n)(x), alone[n]), n
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, before)

    half = qkv.weight.reshape(2, -1, 64)                                  # each KV group's block
    for g in range(2):
        want = torch.cat([rows["q_proj"][32 * g:32 * (g + 1)], rows["k_proj"][16 * g:16 * (g + 1)],
                          rows["v_proj"][16 * g:16 * (g + 1)]])
        assert torch.equal(half[g], want), g
    pairs = gate_up.weight.reshape(128, 2, 64)
    assert torch.equal(pairs[:, 0], rows["gate_proj"]) and torch.equal(pairs[:, 1], rows["up_proj"])
    assert "fused_qkv_proj" in hf_layers.FUSED.values()
    # model code that reads a sibling's matrix (its dtype, its shape) still finds it
    for m, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        for n in names:
            got = getattr(m, n).weight
            assert got.dtype == rows[n].dtype and torch.equal(got, rows[n]), n
            assert getattr(m, n).bias is None


def test_a_fused_sibling_still_shows_its_own_bias_and_matrix():
    """Qwen2's q/k/v carry biases: after the fusion each sibling's .weight and .bias are its own rows."""
    from hloserve.exporter.llm import hf_layers

    hf = _model("Qwen2ForCausalLM", "Qwen2Config", num_hidden_layers=1)
    hf_layers.sixteen_bit(hf, torch.bfloat16, torch.float32)
    attn = hf.model.layers[0].self_attn
    before = {n: (getattr(attn, n).weight.clone(), getattr(attn, n).bias.clone()) for n in ("q_proj", "k_proj", "v_proj")}
    assert hf_layers.fuse_projections(hf, num_kv_heads=hf.config.num_key_value_heads) == 2
    for n, (w, b) in before.items():
        assert torch.equal(getattr(attn, n).weight, w) and torch.equal(getattr(attn, n).bias, b), n


def test_siblings_that_cannot_share_a_matrix_stay_apart():
    """A sibling that is not a 16-bit LayerLinear (here a plain f32 Linear: as a quantized one would
    be), or KV blocks that do not divide the rows, leave that group unfused; the others still fuse."""
    from hloserve.exporter.llm import hf_layers

    hf = _model("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=1)
    hf_layers.sixteen_bit(hf, torch.bfloat16, torch.float32)
    layer = hf.model.layers[0]
    layer.self_attn.k_proj = torch.nn.Linear(64, 32, bias=False)
    assert hf_layers.fuse_projections(hf, num_kv_heads=2) == 1          # gate/up only
    assert not hasattr(layer.self_attn, "fused_qkv_proj") and hasattr(layer.mlp, "fused_gate_up_proj")

    hf = _model("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=1)
    hf_layers.sixteen_bit(hf, torch.bfloat16, torch.float32)
    assert hf_layers.fuse_projections(hf, num_kv_heads=3) == 1          # 32 key rows are no 3 blocks
    assert isinstance(hf.model.layers[0].self_attn.q_proj, hf_layers.LayerLinear)
