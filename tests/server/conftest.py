"""Fixtures shared by the server tests that start a real server on an exported Llama."""
from __future__ import annotations

import json

import pytest

BLOCK = 16


def export_tiny_llama(root, name: str, vocab: int, files: dict[str, str] | None = None, lora=None, torch_dtype=None,
                      **config):
    """(transformers model, artifact path): a random-init 2-layer Llama (seed 0) of `vocab` tokens
    saved under `root`/hf with `files` (file name -> text) beside it, exported as `root`/`name` (block 16,
    context 256, at most 64 tokens and 8 sequences a step; `lora`: a LoraRequest, adapter slots;
    `torch_dtype`: the dtype the checkpoint is stored in, default f32; a 16-bit one is exported as
    `hloserve export` does: 16-bit weight matrices and KV cache under f32 activations)."""
    import torch
    import transformers

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.llm import hf_causal
    from hloserve.exporter.llm.step import StepExportOptions

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, **config)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    if torch_dtype is not None:          # stored as real checkpoints are (bf16: 16-bit matrices, layer_linear)
        hf = hf.to(torch_dtype)
    hf.save_pretrained(str(root / "hf"))
    for file, text in (files or {}).items():
        (root / "hf" / file).write_text(text)
    src = hf_causal.from_hf_directory(str(root / "hf"), opts=StepExportOptions(
        block_size=BLOCK, max_context=256, max_tokens=64, max_seqs=8), lora=lora,
        weight_dtype=torch_dtype, kv_dtype=torch_dtype)   # as `hloserve export` treats a 16-bit checkpoint
    art = str(root / name)
    export_artifact(art, src.entries, source=name, model=src.model, files=src.files)
    return hf, art


def smollm2_text_files():
    """(config fields, files) giving a tiny Llama SmolLM2's real tokenizer and chat template (from its GGUF)."""
    from hloserve.exporter import presets
    from hloserve.exporter.gguf.checkpoint import load_gguf

    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    files = {"tokenizer.json": ckpt.tokenizer_json,
             "tokenizer_config.json": json.dumps({"chat_template": ckpt.chat_template, "add_bos_token": False})}
    return dict(vocab=ckpt.config["vocab_size"], bos_token_id=ckpt.special_tokens.bos_token_id,
                eos_token_id=ckpt.special_tokens.eos_token_id), files


@pytest.fixture(scope="session")
def tiny_chat_llm(tmp_path_factory):
    """(transformers model, artifact path): a tiny random-init Llama with SmolLM2's real tokenizer.

    Prompts, detokenization and the chat template are real (from the SmolLM2 GGUF); the
    weights are random, so outputs are checked against transformers on the same weights.
    Exported once per session (export_tiny_llama).
    """
    config, files = smollm2_text_files()
    return export_tiny_llama(tmp_path_factory.mktemp("chat-llm"), "tiny-chat", files=files, **config)
