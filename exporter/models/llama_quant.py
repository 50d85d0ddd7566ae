"""Quantized storage for the Llama step's stacked weights (the model-specific half of --quantize).

    qw = quantize_llama(weights, config)                # stacked LlamaWeights -> QuantizedLlamaWeights

Stacked weights stay stacked ([L, out, in] int8 or [L, out, in/2] packed int4, scales [L, out, G]):
the layer scan reads one layer of each where the stack lies (the `hloserve.quant_linear`
composite: a CPU kernel dequantizes it in registers; the portable decomposition slices the layer
and dequantizes only that one).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from hloserve.quantization.convert import ROLE_SUFFIX, QuantRecord, interleaved, quantize_tensor, store
from hloserve.quantization.schemes import MIN_SUFFIX, SCALE_SUFFIX, QuantConfig, WeightScheme

from .llama import MATRICES


class QuantizedLlamaWeights(torch.nn.Module):
    """LlamaWeights with quantized storage; the same interface LlamaStep calls.

    Stacked matmul weights `layers.NAME` become `layers.NAME` (int8 / packed uint8),
    `layers.NAME_scale` and `layers.NAME_min` (asymmetric), all with the leading [L] dim;
    `embed_tokens` (and an untied `lm_head`) likewise unless skipped. Norms, biases and
    rope_inv_freq stay float. `schemes` maps each quantized name to its WeightScheme.
    """

    def __init__(self, cfg, dtype: torch.dtype, layers: Mapping[str, torch.Tensor],
                 globals_: Mapping[str, torch.Tensor], schemes: Mapping[str, WeightScheme],
                 rope_inv_freq: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self._dtype = dtype
        self.schemes = dict(schemes)
        self.layers = torch.nn.ParameterDict({n: torch.nn.Parameter(t, requires_grad=False) for n, t in layers.items()})
        self.layer_names = tuple(layers)
        for n, t in globals_.items():
            setattr(self, n, torch.nn.Parameter(t, requires_grad=False) if t is not None else None)
        if "lm_head" not in globals_:
            self.lm_head = None
        self.register_buffer("rope_inv_freq", rope_inv_freq)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if "embed_tokens" not in self.schemes:
            return F.embedding(tokens, self.embed_tokens)
        s = self.schemes["embed_tokens"]
        return torch.ops.hloserve.quantized_embedding(
            self.embed_tokens, self.embed_tokens_scale, getattr(self, "embed_tokens_min", None), tokens,
            s.bits, s.group or 0, self._dtype)

    def in_place(self, name: str) -> bool:
        """Whether stacked tensor `name` is read where it lies (a quantized matrix and its scales)
        rather than sliced per layer."""
        base = name.removesuffix(SCALE_SUFFIX).removesuffix(MIN_SUFFIX)
        return base in self.schemes

    def linear(self, x: torch.Tensor, lw: Mapping[str, torch.Tensor], name: str, bias: torch.Tensor | None,
               layer: torch.Tensor | None = None):
        if name not in self.schemes:
            return F.linear(x, lw[name], bias)
        s = self.schemes[name]
        mn = self.layers[name + MIN_SUFFIX] if name + MIN_SUFFIX in self.layers else None
        return torch.ops.hloserve.quantized_linear(x, self.layers[name], self.layers[name + SCALE_SUFFIX], mn, bias,
                                                   layer, s.bits, s.group or 0, s.rows)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        name = "embed_tokens" if self.lm_head is None else "lm_head"
        if name not in self.schemes:
            return F.linear(h, getattr(self, name))
        s = self.schemes[name]
        mn = getattr(self, name + MIN_SUFFIX, None)
        zero = torch.zeros((), dtype=torch.int32, device=h.device)
        return torch.ops.hloserve.quantized_linear(h, getattr(self, name)[None], getattr(self, name + SCALE_SUFFIX)[None],
                                                   None if mn is None else mn[None], None, zero, s.bits, s.group or 0,
                                                   s.rows)


def quantize_llama(weights, config: QuantConfig, record: QuantRecord | None = None) -> QuantizedLlamaWeights:
    """Requantize a float LlamaWeights (stacked) with config.scheme.

    Skip patterns match "embed_tokens", "lm_head" and "layers.NAME" (e.g. "layers.down_proj").
    """
    record = record if record is not None else QuantRecord()
    layers: dict[str, torch.Tensor] = {}
    schemes: dict[str, WeightScheme] = {}
    for n in weights.layer_names:
        t = weights.layers[n].detach()
        if n in MATRICES and not config.skipped(f"layers.{n}"):
            q, scheme = quantize_tensor(t, config.scheme, f"layers.{n}", linear=True)
            record.add(q, scheme, tuple(t.shape))
            store(layers, n, q)
            schemes[n] = scheme
        else:
            layers[n] = t
    globals_: dict[str, torch.Tensor] = {"norm": weights.norm.detach()}
    for n in ("embed_tokens", "lm_head"):
        t = getattr(weights, n)
        if t is None:
            continue
        if config.skipped(n):
            globals_[n] = t.detach()
            continue
        q, scheme = quantize_tensor(t, config.scheme, n, linear=n == "lm_head")   # embed_tokens: gathered too
        record.add(q, scheme, tuple(t.shape))
        store(globals_, n, q)
        schemes[n] = scheme
    tied_head(globals_, schemes, record)
    return QuantizedLlamaWeights(weights.cfg, weights.dtype, layers, globals_, schemes, weights.rope_inv_freq)


def tied_head(globals_: dict[str, torch.Tensor], schemes: dict[str, WeightScheme], record: QuantRecord) -> None:
    """A quantized table the head shares (tied embeddings) is stored a second time, interleaved by 16
    rows, as `lm_head`: the head then runs the quant_linear version 2 kernel (the table's gathers
    need it row by row). The same values; the artifact grows by the table's quantized bytes."""
    if "lm_head" in globals_ or "embed_tokens" not in schemes:
        return
    table = {role: globals_["embed_tokens" + suffix] for role, suffix in ROLE_SUFFIX.items()
             if "embed_tokens" + suffix in globals_}
    shape = (table["qweight"].shape[0], schemes["embed_tokens"].stored_width(table["qweight"].shape[-1]))
    scheme = schemes["embed_tokens"].for_linear(shape)
    if not scheme.rows:
        return
    q = interleaved(table, scheme)
    record.add(q, scheme, shape)
    store(globals_, "lm_head", q)
    schemes["lm_head"] = scheme
