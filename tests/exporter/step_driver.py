"""A test-side driver of the LLM step contract and the tiny random-init configs the step tests use.

    hf = hf_model("llama")                      # transformers, 2 layers, hidden 64, perturbed weights
    paged = Paged(runtime.load(art))            # a block allocator and the donated cache
    logits = paged.step("prefill", {0: prompts([17])[0]})
"""
from __future__ import annotations

import numpy as np
import torch

from hloserve.runtime.artifact.llm import LLMSpec, pack_step

ATOL = 1e-4
BLOCK = 16
NUM_BLOCKS = 40
VOCAB = 256


def hf_config(arch: str, **extra):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    common.update(extra)
    if arch == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    if arch == "mistral":
        return transformers.MistralConfig(num_key_value_heads=1, **{"sliding_window": None, **common})
    if arch == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    raise ValueError(arch)


def hf_model(arch: str, seed: int = 0, **extra):
    """Random-init HF model; every parameter (norms and biases too) perturbed so none is trivial."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
            else:
                p.mul_(3.0)   # larger logits: fewer near-ties in greedy decoding
    return model



class Paged:
    """Test-side driver of the step contract: a free list of blocks (block 0 is the null block),
    a block table per sequence, and the donated cache threaded through every call."""

    def __init__(self, model, num_blocks: int = NUM_BLOCKS):
        import jax.numpy as jnp
        llm = model.manifest.model["llm"]
        self.fns = model.functions
        self.block = llm["block_size"]
        self.cache = jnp.zeros(LLMSpec.from_json(llm).kv_cache.concrete_shape(num_blocks), LLMSpec.from_json(llm).kv_cache.numpy_dtype)
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, fn: str, chunks: dict[int, list[int]]) -> np.ndarray:
        """Append `chunks[seq]` tokens to each listed sequence; returns f32[len(chunks), vocab]."""
        planned = []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block < start + len(toks):
                table.append(self.free.pop())
            planned.append((list(toks), start, list(table)))
            self.lens[sid] = start + len(toks)
        out = self.fns[fn](**pack_step(planned, self.block), kv_cache=self.cache)
        self.cache = out["kv_cache"]
        return np.asarray(out["logits"])



def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]

