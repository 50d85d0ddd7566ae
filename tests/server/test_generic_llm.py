"""Models exported through the generic transformers step and served on loopback with the real
`openai` client: the architectures whose steps differ in what the server passes and frees
(positions, sliding windows) answer 32 greedy tokens for a few prompts equal to transformers'
(f32); and Gemma 2 (soft-capped attention and logits, query_pre_attn_scalar, sliding windows)
under chunked prefill, prefix-cache hits and preemption (a small cache).

The model is random-init with SmolLM2's real tokenizer and chat template, so text in and out is
real; references are transformers' greedy tokens on the same weights.
"""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from .servers import hf_greedy, metric, running_server

pytestmark = pytest.mark.slow
NEW = 32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import torch
    import transformers

    from hloserve.exporter import presets
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.gguf.checkpoint import load_gguf
    from hloserve.exporter.sources import load_source

    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=ckpt.config["vocab_size"], hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    sliding_window=24, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, max_position_embeddings=512,
                                    bos_token_id=ckpt.special_tokens.bos_token_id,
                                    eos_token_id=ckpt.special_tokens.eos_token_id, pad_token_id=0)
    hf = transformers.Gemma2ForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("gemma2")
    hf.save_pretrained(str(root / "hf"))
    (root / "hf" / "tokenizer.json").write_text(ckpt.tokenizer_json)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": ckpt.chat_template,
                                                                    "add_bos_token": False}))
    src = load_source(str(root / "hf"))        # auto: gemma2 is not Llama-family -> the generic path
    assert "attention interface" in src.description
    art = str(root / "art")
    export_artifact(art, src.entries, source="gemma2-tiny", model=src.model, files=src.files)
    return hf, art


def test_generic_model_serves_greedy_equal_to_transformers_under_pressure(gemma):
    import openai

    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    hf, art = gemma
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    texts = [f"Story {i}: once upon a time there was a little robot who wanted to learn how to paint the sea."
             for i in range(6)]
    prompts = [tok.encode(t) for t in texts] * 2                          # repeats: prefix-cache hits
    want = {tuple(p): tok.decode(hf_greedy(hf, p, NEW)) for p in prompts}
    # 6 prompts of ~25 tokens + 32 new: ~4 blocks each; 12 blocks force preemption at 8 in flight,
    # and 16 tokens a step chunk every prompt
    with running_server(art, "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--max-model-len", "128",
                        "--num-blocks", "13", "--served-model-name", "gemma") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def one(p):
            r = client.completions.create(model="gemma", prompt=p, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            return p, r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, prompts))
        for p, text in results:
            assert text == want[tuple(p)]
        m = httpx.get(f"{base}/metrics", timeout=10).text
        assert metric(m, "vllm:num_preemptions_total") > 0
        assert metric(m, "vllm:prefix_cache_hits_total") > 0
        assert metric(m, "hloserve:compiles_after_warmup_total") == 0
        chat = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content is not None


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from hloserve.exporter import presets
    from hloserve.exporter.gguf.checkpoint import load_gguf
    return load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))


# The server drives every architecture's step through the same contract; what it sees differ are the
# positions it passes (learned in GPT-2, rotary elsewhere) and the sliding windows its block manager
# frees (Mistral's one window, Gemma 3's per-layer windows). The models' own arithmetic, family by
# family, is compared with transformers in tests/exporter/test_hf_causal.py through the same steps.
@pytest.mark.parametrize("arch", ["gemma3", "gpt2", "mistral"])
def test_architectures_serve_greedy_equal_to_transformers(arch, smollm2_tokenizer, tmp_path):
    import openai
    import torch

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    from ..exporter.test_hf_causal import _hf

    ckpt = smollm2_tokenizer
    torch.manual_seed(0)
    hf = _hf(arch, vocab_size=ckpt.config["vocab_size"]).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer.json").write_text(ckpt.tokenizer_json)
    src = load_source(str(tmp_path / "hf"), llm_step="generic")
    art = str(tmp_path / "art")
    export_artifact(art, src.entries, source=arch, model=src.model, files=src.files)
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    prompts = ["The capital of France is", "Once upon a time, a robot", "1, 2, 3, 4,"]
    with running_server(art, "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64",
                        "--served-model-name", arch) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for p in prompts:
            want = tok.decode(hf_greedy(hf, tok.encode(p), NEW))
            r = client.completions.create(model=arch, prompt=p, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want, f"{arch}: {p!r}"
