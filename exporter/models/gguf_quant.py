"""GGUF Q8_0 / Q4_0 / Q4_1 blocks imported as they are (no float round trip) into the Llama step's weights.

    qw = llama_from_gguf(cfg, ckpt, config)             # the file's blocks, in QuantizedLlamaWeights
    build, record = gguf_weights_builder(config)        # what `hloserve export X.gguf --quantize gguf` uses
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from hloserve.quantization import primitives
from hloserve.quantization.convert import QuantRecord, interleaved, quantize_tensor, store
from hloserve.quantization.schemes import QuantConfig, QuantizationError, WeightScheme

from .llama import MATRICES, _layer_layout, fused_row_order, rope_inv_freq
from .llama_quant import QuantizedLlamaWeights, tied_head

# ggml type -> the scheme its blocks are, exactly
GGUF_SCHEMES: Mapping[str, WeightScheme] = {
    "Q8_0": WeightScheme(8, 32, True, "f16"),
    "Q4_0": WeightScheme(4, 32, True, "f16"),
    "Q4_1": WeightScheme(4, 32, False, "f16"),
}


def gguf_blocks(t) -> dict[str, np.ndarray]:
    """A Q8_0 / Q4_0 / Q4_1 GGUFTensor -> stored tensors in our layout, no float round trip.

    Q8_0: q int8 [out, in], scale f16 [out, in/32]. Q4_0: (q - 8) packed signed, scale.
    Q4_1: q packed unsigned, scale = d, min = m (value q * d + m, as gguf computes it).
    """
    f = t.block_fields()                                                 # d, m: [out, nb]; q: [out, nb, 32]
    n_in = t.shape[-1]
    q = f["q"].reshape(*t.shape[:-1], n_in)                              # [out, in]
    if t.ggml_type == "Q8_0":
        stored = {"qweight": np.ascontiguousarray(q.astype(np.int8))}
    elif t.ggml_type == "Q4_0":
        stored = {"qweight": primitives.pack_int4(q.astype(np.int8) - 8)}
    elif t.ggml_type == "Q4_1":
        stored = {"qweight": primitives.pack_int4(q.astype(np.int8))}
    else:
        raise QuantizationError(f"{t.gguf_name}: ggml type {t.ggml_type} has no direct import; "
                                f"supported: {sorted(GGUF_SCHEMES)}")
    stored["scale"] = np.ascontiguousarray(f["d"])
    if "m" in f:
        stored["min"] = np.ascontiguousarray(f["m"])
    return stored


def llama_from_gguf(cfg, ckpt, config: QuantConfig, record: QuantRecord | None = None,
                    dtype: torch.dtype = torch.float32) -> QuantizedLlamaWeights:
    """QuantizedLlamaWeights straight from a GGUF checkpoint's blocks.

    A stacked weight whose parts (every layer's q/k/v, ...) all have one of GGUF_SCHEMES's
    types keeps the file's blocks; otherwise (F16/F32, K-quants, mixed types) it is dequantized
    and requantized with config.scheme. Skipped names stay float.
    """
    record = record if record is not None else QuantRecord()
    tensors = ckpt.tensors

    def native(names: list[str]) -> WeightScheme | None:
        kinds = {tensors[n].ggml_type for n in names}
        return GGUF_SCHEMES.get(kinds.pop()) if len(kinds) == 1 else None

    def dequantized(names: list[str], order: torch.Tensor | None) -> torch.Tensor:
        rows = torch.cat([torch.from_numpy(tensors[n].dequantize()) for n in names], 0)
        return rows if order is None else rows[order]                    # FUSED_ROWS

    layers: dict[str, torch.Tensor] = {}
    schemes: dict[str, WeightScheme] = {}
    for stacked, parts in _layer_layout(cfg).items():
        per_layer = [[p.format(i=i) for p in parts] for i in range(cfg.num_layers)]
        flat = [n for names in per_layer for n in names]
        missing = [n for n in flat if n not in tensors]
        if missing:
            raise QuantizationError(f"{ckpt.path}: tensor {missing[0]} is missing for {stacked}")
        rows = sum(tensors[n].shape[0] for n in per_layer[0])
        shape = (cfg.num_layers, rows, tensors[flat[0]].shape[-1])
        order = fused_row_order(cfg, stacked)
        if stacked not in MATRICES or config.skipped(f"layers.{stacked}"):
            layers[stacked] = torch.stack([dequantized(names, order) for names in per_layer]).to(dtype)
            continue
        scheme = native(flat)
        if scheme is not None:
            blocks = [[gguf_blocks(tensors[n]) for n in names] for names in per_layer]
            idx = slice(None) if order is None else order.numpy()        # FUSED_ROWS
            q = {role: torch.from_numpy(np.stack([np.concatenate([b[role] for b in bl], 0)[idx] for bl in blocks]))
                 for role in blocks[0][0]}                               # [L, rows, ...] each
            if scheme.for_linear(shape).rows:   # interleaved for the quant_linear version 2 kernel
                scheme = scheme.for_linear(shape)
                q = interleaved(q, scheme)
        else:
            q, scheme = quantize_tensor(torch.stack([dequantized(names, order) for names in per_layer]), config.scheme,
                                         stacked, linear=True)
        record.add(q, scheme, shape)
        store(layers, stacked, q)
        schemes[stacked] = scheme

    globals_: dict[str, torch.Tensor] = {"norm": torch.from_numpy(tensors["model.norm.weight"].dequantize()).to(dtype)}
    heads = {"embed_tokens": "model.embed_tokens.weight"}
    if not cfg.tie_word_embeddings:
        heads["lm_head"] = "lm_head.weight"
    for n, hf in heads.items():
        t = tensors[hf]
        if config.skipped(n):
            globals_[n] = torch.from_numpy(t.dequantize()).to(dtype)
            continue
        scheme = GGUF_SCHEMES.get(t.ggml_type)
        linear = n == "lm_head"                                          # embed_tokens: gathered too
        if scheme is not None:
            q = {role: torch.from_numpy(a) for role, a in gguf_blocks(t).items()}
            if linear and scheme.for_linear(t.shape).rows:
                scheme = scheme.for_linear(t.shape)
                q = interleaved(q, scheme)
        else:
            q, scheme = quantize_tensor(torch.from_numpy(t.dequantize()), config.scheme, n, linear=linear)
        record.add(q, scheme, tuple(t.shape))
        store(globals_, n, q)
        schemes[n] = scheme
    tied_head(globals_, schemes, record)
    return QuantizedLlamaWeights(cfg, dtype, layers, globals_, schemes, rope_inv_freq(cfg))


def gguf_weights_builder(config: QuantConfig, dtype: torch.dtype = torch.float32):
    """(build_weights for llama_source.from_gguf, the QuantRecord it fills): the file's own blocks."""
    record = QuantRecord()

    def build(cfg, ckpt):
        return llama_from_gguf(cfg, ckpt, config, record, dtype)

    return build, record
