"""Fixtures shared by the server tests that start a real server on an exported Llama."""
from __future__ import annotations

import json

import pytest

BLOCK = 16


@pytest.fixture(scope="session")
def tiny_chat_llm(tmp_path_factory):
    """(transformers model, artifact path): a tiny random-init Llama with SmolLM2's real tokenizer.

    Prompts, detokenization and the chat template are real (from the SmolLM2 GGUF); the
    weights are random, so outputs are checked against transformers on the same weights.
    Exported once per session (block 16, context 256, at most 64 tokens and 8 sequences a step).
    """
    import torch
    import transformers

    from hloserve.exporter import presets
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.models import llama_source
    from hloserve.exporter.models.gguf import load_gguf
    from hloserve.exporter.models.step import StepExportOptions

    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    vocab = ckpt.config["vocab_size"]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=ckpt.special_tokens.bos_token_id,
                                   eos_token_id=ckpt.special_tokens.eos_token_id, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("chat-llm")
    hf.save_pretrained(str(root / "hf"))
    (root / "hf" / "tokenizer.json").write_text(ckpt.tokenizer_json)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": ckpt.chat_template,
                                                                    "add_bos_token": False}))
    src = llama_source.from_hf_directory(str(root / "hf"), opts=StepExportOptions(
        block_size=BLOCK, max_context=256, max_tokens=64, max_seqs=8))
    art = str(root / "tiny-chat")
    export_artifact(art, src.entries, source="tiny-chat", model=src.model, files=src.files)
    return hf, art

