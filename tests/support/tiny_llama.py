"""A tiny random-init Llama exported as an LLM step artifact (2 layers, hidden 64, vocab 256, f32).

Weights other than norms are scaled x3 so that greedy decoding has no near-ties at float noise:
tests compare token for token with transformers on the same weights.
"""
from __future__ import annotations

import os


def tiny_llama(root: str, *, heads: int, kv_heads: int, max_position: int, block_size: int, max_context: int,
               weight_dtype=None):
    """(transformers model, artifact path) under `root` (hf/ and art/); `weight_dtype` (torch.bfloat16)
    stores the matrices narrower, as `--weight-dtype` does."""
    import torch
    import transformers

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.llm import hf_causal
    from hloserve.exporter.llm.step import StepExportOptions

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_position, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(3.0)
    hf.save_pretrained(os.path.join(root, "hf"))
    src = hf_causal.from_hf_directory(os.path.join(root, "hf"), opts=StepExportOptions(
        block_size=block_size, max_context=max_context, max_tokens=64, max_seqs=8), weight_dtype=weight_dtype)
    art = os.path.join(root, "art")
    export_artifact(art, src.entries, source="tiny-llama", model=src.model)
    return hf, art
