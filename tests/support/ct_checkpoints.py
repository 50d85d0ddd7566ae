"""compressed-tensors checkpoints made in the test, the way llm-compressor makes them (its RTN path:
min-max scales per group, channel or tensor; no calibration data), with compressed-tensors' own API.

    path = make_checkpoint(root, "w4a16")                 # a tiny bf16 Llama, quantized and saved compressed
    path = make_checkpoint(root, "w4a16", model=hf)       # any transformers causal LM

llm-compressor itself cannot be installed beside this project's pins (it caps transformers below 5.24);
it calls the same compressed-tensors functions used here: apply_quantization_config attaches each
group's scheme, the scales and zero points come from the weights' extremes (calculate_qparams,
llm-compressor's "minmax" observer), and ModelCompressor packs the integers and writes config.json's
quantization_config. A test dependency only (pyproject's dev extra), never a runtime one.
"""
from __future__ import annotations

import os

import torch

# name -> (weights, input_activations, format): llm-compressor's presets (W4A16 is group 128, W8A8 per
# channel with dynamic per-token activations) and the variants the import handles
SCHEMES = {
    "w4a16": (dict(num_bits=4, symmetric=True, strategy="group", group_size=128), None, "pack-quantized"),
    "w4a16_g64": (dict(num_bits=4, symmetric=True, strategy="group", group_size=64), None, "pack-quantized"),
    "w4a16_asym_g32": (dict(num_bits=4, symmetric=False, strategy="group", group_size=32), None, "pack-quantized"),
    "w4a16_asym_channel": (dict(num_bits=4, symmetric=False, strategy="channel"), None, "pack-quantized"),
    "w8a16": (dict(num_bits=8, symmetric=True, strategy="channel"), None, "pack-quantized"),
    "w8a16_g32": (dict(num_bits=8, symmetric=True, strategy="group", group_size=32), None, "pack-quantized"),
    "w8a8": (dict(num_bits=8, symmetric=True, strategy="channel"),
             dict(num_bits=8, symmetric=True, strategy="token", dynamic=True), "int-quantized"),
}


def tiny_llama(seed: int = 0, *, tied: bool = False):
    """A random-init Llama (2 layers, hidden 128, intermediate 256, GQA 4/2 heads, vocab 512, its head
    untied unless `tied`), bf16 like the checkpoints llm-compressor quantizes; weights other than norms
    x3 (logits O(1))."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(3.0)
    return model.to(torch.bfloat16)


def make_checkpoint(root: str, scheme: str, *, model=None, ignore: tuple[str, ...] = ("lm_head",)) -> str:
    """`model` (default tiny_llama()) quantized with SCHEMES[scheme] on every Linear but `ignore`,
    saved compressed to root/scheme; returns that directory."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    weights, acts, fmt = SCHEMES[scheme]
    model = tiny_llama() if model is None else model
    wargs = QuantizationArgs(type="int", **weights)
    group = QuantizationScheme(targets=["Linear"], weights=wargs,
                               input_activations=None if acts is None else QuantizationArgs(type="int", **acts))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore)),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                _minmax(module, wargs)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out = os.path.join(root, scheme)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


def _minmax(module: torch.nn.Module, args) -> None:
    """The module's scale (and zero point) from its weight's extremes per group / row / tensor."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.float()                                            # [out, in]
    if args.strategy == "group":
        w = w.reshape(w.shape[0], -1, args.group_size)                    # [out, G, g]
    elif args.strategy == "channel":
        w = w[:, None, :]                                                 # [out, 1, in]
    else:
        w = w.reshape(1, 1, -1)
    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
