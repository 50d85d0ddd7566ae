"""The generic LLM step (exporter/llm/hf_causal.py): a transformers causal LM's own code under
torch.export with hloserve's paged attention plugged into transformers' attention interface.

Each architecture is a small random-init model saved to a directory and exported by `load_source`,
exactly as `hloserve export DIR` does; its step functions run through the runtime and are compared
with transformers eager on the same weights (f32). Tolerance: last-token logits within 1e-4 (two
layers, logits O(1); measured differences ~3e-7, from the order of f32 sums) at prompt lengths that
end inside, at and past the 16-token block edges; greedy 32-token continuations equal.

The configs turn on what each family does differently: GQA/MQA, per-layer sliding windows,
attention and final-logit soft-capping, query_pre_attn_scalar, q/k norms, partial rotary, parallel
residual, scaling multipliers, biases, tied and untied heads.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from .step_driver import Paged
from .step_driver import prompts as _prompts

pytestmark = pytest.mark.slow

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)

ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True, tie_word_embeddings=False)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=1)),                  # MQA, qkv bias
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),                             # q/k norms
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
                                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
                                                              layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.25, use_parallel_residual=True,
                                                               num_key_value_heads=None)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict()),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(embedding_multiplier=2.0, logits_scaling=4.0,
                                                             residual_multiplier=0.5, attention_multiplier=0.3)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    # rotates q/k in its sliding layers only: sliding and global layers are a period of two bodies
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(sliding_window=8,
                                                             layer_types=["sliding_attention", "full_attention"])),
    # hands its layers two views of one sin/cos table (the scan's operands must not alias)
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8)),
    # mixture of experts (models/hf_experts.py): 4 experts, 2 per token
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense MLP in layer 1, experts in layer 0 (a period of two bodies), q/k norms
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=16,
                                                                 moe_intermediate_size=32, mlp_only_layers=[1])),
}


def _hf(arch: str, vocab_size: int = VOCAB):
    """A small random-init model of `arch` (f32)."""
    import transformers
    cls_name, cfg_name, extra = ARCHS[arch]
    kw = dict(COMMON, vocab_size=vocab_size) if arch not in ("gpt2", "gptj") else dict(vocab_size=vocab_size)
    kw.update({k: v for k, v in extra.items() if v is not None})
    for k, v in extra.items():
        if v is None:
            kw.pop(k, None)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kw)).eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def exported(request, tmp_path_factory):
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    arch = request.param
    hf = _hf(arch)
    root = tmp_path_factory.mktemp(f"hf-{arch}")
    hf.save_pretrained(str(root / "hf"))
    src = load_source(str(root / "hf"), llm_step="generic")
    assert "attention interface" in src.description
    export_artifact(str(root / "art"), src.entries, source=arch, model=src.model)
    return arch, hf, load(str(root / "art"), buckets={"num_tokens": [1, 8, 64], "num_seqs": [1, 8],
                                                     "max_blocks": [8]})


@pytest.mark.parametrize("fn", ["prefill", "decode"])
def test_prompt_logits_match_transformers(exported, fn):
    arch, hf, model = exported
    prompts = _prompts([1, 15, 16, 17, 40])
    got = Paged(model).step(fn, dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got[i], want, atol=1e-4, rtol=0, err_msg=f"{arch} {fn} prompt length {len(p)}")


def test_greedy_32_tokens_match_transformers(exported):
    """Two prompts prefilled together (chunked: 10 tokens, then the rest), then 31 batched decodes."""
    arch, hf, model = exported
    prompts = _prompts([15, 21], seed=3)
    paged = Paged(model)
    paged.step("prefill", {0: prompts[0][:10], 1: prompts[1][:10]})
    logits = paged.step("prefill", {0: prompts[0][10:], 1: prompts[1][10:]})
    ours = [[int(np.argmax(row))] for row in logits]
    for _ in range(31):
        logits = paged.step("decode", {i: [ours[i][-1]] for i in range(2)})
        for i, row in enumerate(logits):
            ours[i].append(int(np.argmax(row)))
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist()
        assert ours[i] == want, f"{arch}: greedy tokens differ for prompt {i}"


def test_what_the_generic_path_cannot_serve_is_named():
    import transformers

    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.llm.hf_causal import check_supported
    t5 = transformers.T5Config()
    with pytest.raises(SourceError, match="encoder-decoder"):
        check_supported(transformers.T5ForConditionalGeneration, t5)
    mamba = transformers.MambaConfig()
    with pytest.raises(SourceError, match="attention interface"):
        check_supported(transformers.MambaForCausalLM, mamba)
    with pytest.raises(SourceError, match="not a causal LM"):
        check_supported(transformers.BertModel, transformers.BertConfig())
    with pytest.raises(SourceError, match="multi-head latent attention"):
        check_supported(transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(n_routed_experts=1))


def test_experts_hloserve_does_not_compute_are_refused_in_one_line(tmp_path):
    """GPT-OSS's experts are transposed and biased: refused when loaded, naming the module."""
    import transformers

    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.sources import load_source

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    transformers.GptOssForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(SourceError, match="GptOssForCausalLM model.layers.0.mlp.experts: .* transposed"):
        load_source(str(tmp_path / "hf"), llm_step="generic")


def test_a_family_whose_layers_drop_the_attention_arguments_is_refused_in_one_line(tmp_path):
    """Nemotron's decoder layer calls its attention without transformers' keyword arguments, so the
    step's inputs never reach hloserve's attention: refused when loaded, naming the module."""
    import transformers

    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.sources import load_source

    torch.manual_seed(0)
    hf = transformers.NemotronForCausalLM(transformers.NemotronConfig(**COMMON, partial_rotary_factor=0.5))
    hf.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(SourceError, match="NemotronAttention is called without the step's paging inputs"):
        load_source(str(tmp_path / "hf"), llm_step="generic")


@pytest.mark.parametrize("arch,options,atol", [
    # int8 / int4 weights: compared with transformers running the same quantized modules eagerly
    # (hloserve's torch reference ops). Both sides quantize each linear's input to int8 per block of
    # 32, but f32 summation-order noise upstream can move an activation across a rounding boundary:
    # each such flip moves one product by max|x_block| / 127 times its weight. 1e-2 on logits O(0.5)
    # bounds a few flips per layer, and is far below what a wrong weight, layer or group moves (O(0.1))
    ("qwen3", {"quantize": "int8"}, 1e-2),
    ("gemma2", {"quantize": "int4"}, 1e-2),
    ("cohere2", {"quantize": "int8"}, 1e-2),     # scanned by period: rescanned so after the swap
    # the experts' stacks [E, out, in] in bf16, read in place by the composite: the bound above
    ("mixtral", {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}, 2e-2),
    # bf16 matrices and K/V under f32 activations: logits O(0.5) through two layers of bf16-rounded
    # products (2^-8 relative each) against the f32 model: 2e-2 bounds what that rounding can move
    ("llama", {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}, 2e-2),
    # int8 K/V (per token and KV head, range [min, max] over 255 steps): each value within half a step
    # of 1/255 of its row's range (at most twice its largest magnitude), i.e. about 2^-8 relative to the
    # row as bf16 is to each value: the same bound
    ("llama", {"kv_cache_dtype": "int8"}, 2e-2),
    # fp8 K/V (e4m3 per value, a scale per token and KV head): each value within half a step of its
    # 3-bit mantissa, 2^-4 relative, 16 times bf16's 2^-8: the bound above times 16. Its prefill reads
    # the rows through the torch side's integer decoding (e4m3_values, lowered), decode through the
    # composite
    ("llama", {"kv_cache_dtype": "fp8_e4m3"}, 2e-2 * 16),
])
def test_quantized_and_16_bit_weights_on_the_generic_step(tmp_path, arch, options, atol):
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.quantization.convert import QuantRecord, quantize_module
    from hloserve.quantization.schemes import QuantConfig
    from hloserve.runtime import load

    hf = _hf(arch)
    hf.save_pretrained(str(tmp_path / "hf"))
    src = load_source(str(tmp_path / "hf"), llm_step="generic", **options)
    export_artifact(str(tmp_path / "art"), src.entries, source=arch, model=src.model,
                    weight_quant=getattr(src, "weight_quant", None))
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [64], "num_seqs": [8], "max_blocks": [8]})
    ref = _hf(arch)
    if "quantize" in options:
        # every stored integer matrix (scanned stacks included) says what it is in the manifest
        weights = model.manifest.weights
        ints = [n for n, w in weights.items() if w.dtype in ("i8", "u8")]
        assert ints and all(weights[n].quant and weights[n].quant["role"] == "qweight" for n in ints), \
            {n: weights[n].quant for n in ints}
        assert any(len(weights[n].shape) == 3 for n in ints)   # [layers of the scan, out, in]
        quantize_module(ref, QuantConfig.parse(options["quantize"], ()), QuantRecord())
    compare_last_logits(model, ref, atol, f"{arch} {options}")


def compare_last_logits(model, ref, atol: float, what: str = "") -> None:
    """Last-token logits of three prompts (1, 17 and 40 tokens: inside, across and past block
    edges) through both step functions, against `ref` (a transformers model) within `atol`; a
    quantized `ref` computes as the artifact's quant_linear does in its step of 64 rows (the bucket:
    version 6's bf16 chunks, or version 2's product where this CPU's kernels raise bf16_rows)."""
    from hloserve.quantization.modules import as_step_of
    from tests.support.quant_contract import step_rows
    prompts = _prompts([1, 17, 40])
    for fn in ("prefill", "decode"):
        got = Paged(model).step(fn, dict(enumerate(prompts)))
        for i, p in enumerate(prompts):
            with torch.no_grad(), as_step_of(step_rows(64)):
                want = ref(torch.tensor([p])).logits[0, -1].numpy()
            np.testing.assert_allclose(got[i], want, atol=atol, rtol=0, err_msg=f"{what} {fn} {len(p)}")


def test_paged_layout_is_reachable_on_the_generic_step(tmp_path):
    """The online-softmax block loop (bounded memory for long contexts) as a function of a generic
    artifact: Gemma 2's soft-capping and sliding window carried through it."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.llm import hf_causal
    from hloserve.exporter.llm.step import StepExportOptions
    from hloserve.runtime import load

    hf = _hf("gemma2")
    hf.save_pretrained(str(tmp_path / "hf"))
    src = hf_causal.from_hf_directory(str(tmp_path / "hf"), opts=StepExportOptions(
        max_context=512, scan=False, functions=(("paged", "paged"),)))
    export_artifact(str(tmp_path / "art"), src.entries, source="gemma2", model=src.model)
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [64], "num_seqs": [8], "max_blocks": [8]})
    prompts = _prompts([1, 17, 40])
    got = Paged(model).step("paged", dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got[i], want, atol=1e-4, rtol=0, err_msg=f"paged, prompt length {len(p)}")


def test_weight_dtype_errors_name_the_fix(tmp_path, capsys):
    """--weight-dtype is for LLM step exports, not with --quantize, and must be a float dtype."""
    from hloserve.server.cli import main
    art = str(tmp_path / "art")
    assert main(["export", "smollm2-135m-instruct", "-o", art, "--weight-dtype", "bfloat16", "--quantize", "int8"]) == 1
    assert "--weight-dtype and --quantize both choose how weights are stored" in capsys.readouterr().err
    assert main(["export", "smollm2-135m-instruct", "-o", art, "--weight-dtype", "int8"]) == 1
    assert "--weight-dtype 'int8' is not supported" in capsys.readouterr().err
    assert main(["export", "tests.exporter.factories:mlp", "-o", art, "--weight-dtype", "bfloat16"]) == 1
    assert "--weight-dtype, --kv-cache-dtype, --llm-step and --lora-slots apply to LLMs exported as step functions" in capsys.readouterr().err
    assert not os.path.exists(art)
