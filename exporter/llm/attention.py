"""The generic step's attention: what every attention layer of a transformers causal LM calls
through transformers' `AttentionInterface` (registered as `hloserve_paged`, exporter/llm/hf_causal.py).

    register_attention()                     # once per process
    step = StepState(layout, inputs, kv_dtype, dtype)
    model(..., hloserve_step=step)           # each layer: write its K/V into step.cache, attend over it

`StepState.attend` writes the step's K/V into the explicit cache and attends by the function's
layout: `gather` (the `hloserve.paged_attention` composite, exporter/composites/paged_attention.py),
`paged` (the online-softmax loop over blocks of step.py) or the flat prefill (every token scores the
step's contexts, masked to its own).
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..composites import paged_attention as _ops  # noqa: F401 - registers torch.ops.hloserve.paged_attention*
from ..composites.paged_attention import cache_values, within_window
from ..errors import SourceError
from .kv_smooth import KV_SMOOTH, smooth_keys
from .step import _MASKED, QUANT_KV, cache_holds, kv_rotation, paged_attention, write_kv

ATTN_NAME = "hloserve_paged"
STEP_KWARG = "hloserve_step"


def register_attention() -> None:
    """Register `hloserve_paged` with transformers (idempotent; a process-wide table of transformers')."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-interface signature: query [1, H, T, D], key/value [1, KV, T, D]
    -> ([1, T, H, D], None). Writes this step's K/V into the cache and attends over it."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise SourceError(f"{type(module).__name__} is called without the step's paging inputs ({STEP_KWARG}=...): "
                          f"the model's decoder layers do not hand transformers' attention keyword arguments on to "
                          f"their attention, so the generic step cannot serve this family")
    return step.attend(module, query, key, value, scaling, sliding_window, softcap), None


class StepState:
    """The paging inputs of one step and the cache as it is updated, layer by layer (tracing state)."""

    def __init__(self, layout: str, inputs: Mapping[str, torch.Tensor], kv_dtype: torch.dtype | None,
                 dtype: torch.dtype, *, cache: torch.Tensor | None = None, layer: torch.Tensor | None = None,
                 window: torch.Tensor | None = None):
        self.layout = layout
        self.x = inputs
        self.cache = inputs["kv_cache"] if cache is None else cache
        self.kv_dtype = kv_dtype
        self.dtype = dtype
        self.layer = layer          # 0-dim int32 (a scanned layer's index); None: the module's layer_idx
        self.window = window        # 0-dim int32 (a scanned layer's own window, 0: none); None: the module's
        self.observe = None         # eager calibration only: observe(layer, q, k) after RoPE (kv_smooth.calibrate)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The paging inputs a layer's attention reads (the cache aside): a scanned body's inputs."""
        return {k: v for k, v in self.x.items() if k != "kv_cache"}

    def at(self, layer: torch.Tensor, cache: torch.Tensor, window: torch.Tensor | None = None, *,
           tensors: Mapping[str, torch.Tensor] | None = None) -> "StepState":
        """The step as layer `layer` sees it, over `cache` (hf_layers.ScannedLayers); `window`: the
        layer's sliding window as data, where the layers of one scanned body differ in it (WINDOW);
        `tensors`: `tensors()` as the scanned body receives them."""
        x = self.x if tensors is None else {**self.x, **tensors}
        return StepState(self.layout, x, self.kv_dtype, self.dtype, cache=cache, layer=layer, window=window)

    def attend(self, module, query, key, value, scaling, window, softcap) -> torch.Tensor:
        layer = self.layer if self.layer is not None else torch.tensor(module.layer_idx, dtype=torch.int32)
        _, H, T, D = query.shape
        KV = key.shape[1]
        q = query[0].transpose(0, 1)                                      # [T, H, D]
        k = key[0].transpose(0, 1)                                        # [T, KV, D]
        v = value[0].transpose(0, 1)                                      # [T, KV, D]
        x = self.x
        scale = float(scaling) if scaling is not None else D ** -0.5
        window = int(window or 0) if self.window is None else self.window    # an int, or the layer's 0-dim tensor
        softcap = float(softcap or 0.0)
        if self.observe is not None:
            self.observe(int(layer), q, k)
        rot = kv_rotation(self.kv_dtype, D)                               # int8 / fp8 K/V: stored rotated
        if rot is not None:
            q, k, v = q.float() @ rot, k.float() @ rot, v.float() @ rot
            q, k = smooth_keys(q, k, x.get(KV_SMOOTH), layer)             # keys smoothed (kv_smooth.py)
        kv_in = torch.float32 if self.kv_dtype in QUANT_KV else self.dtype   # int8 / fp8 rows: quantized from f32
        self.cache = write_kv(self.cache, layer.to(torch.int64), k.to(kv_in), v.to(kv_in),
                              x["slot_mapping"].to(torch.int64), self.kv_dtype)

        qg = q.reshape(T, KV, H // KV, D)                                 # [T, KV, G, D]
        holds = cache_holds(self.kv_dtype, self.cache.dtype)
        if self.layout == "gather":
            # version 2 of the composite where the window is the layer's data, version 1 otherwise
            windowed = isinstance(window, torch.Tensor)
            op = torch.ops.hloserve.paged_attention_windowed if windowed else torch.ops.hloserve.paged_attention
            out = op(qg.float(), self.cache, layer, x["block_tables"], x["seq_ids"], x["positions"],
                     x["context_lens"], window, holds, scale, softcap)      # [T, KV, G, D]
        elif self.layout == "paged":
            if holds:
                raise ValueError("the paged layout reads an f32 cache; export it without --kv-cache-dtype")
            blocks = x["block_tables"][x["seq_ids"]].transpose(0, 1)      # [B, T]: scanned over B
            out = paged_attention(qg.float(), self.cache, layer, blocks, x["positions"].to(torch.int64),
                                  x["context_lens"][x["seq_ids"]].to(torch.int64), window, scale=scale,
                                  softcap=softcap)
        else:
            out = _flat_attention(qg.float(), self.cache, layer, x, window, holds, scale, softcap)
        if rot is not None:
            out = out.float() @ rot                                       # rotated back (H^T = H)
        return out.to(query.dtype).reshape(1, T, H, D)                   # [1, T, H, D]


def _flat_attention(qg, cache, layer: torch.Tensor, x, window, holds: int, scale: float, softcap: float):
    """Every token scores the contexts of all S sequences of the step, masked to its own (prefill)."""
    T, KV, G, D = qg.shape
    BS = cache.shape[4]
    tables = x["block_tables"]                                            # [S, B]
    S, B = tables.shape
    C = B * BS
    k = torch.ops.hloserve.gather_blocks(cache, layer, 0, tables)         # [KV, S*C, D]
    v = torch.ops.hloserve.gather_blocks(cache, layer, 1, tables)         # [KV, S*C, D]
    k, v = cache_values(k, holds), cache_values(v, holds)
    c = torch.arange(C, device=qg.device)
    pos = x["positions"].to(torch.int64)[:, None]                         # [T, 1]
    own = x["seq_ids"].to(torch.int64)[:, None] == torch.arange(S, device=qg.device)[None, :]   # [T, S]
    causal = c[None, :] <= pos                                            # [T, C]
    windowed = within_window(c[None, :], pos, window)
    if windowed is not None:
        causal = causal & windowed
    filled = c[None, :] < x["context_lens"].to(torch.int64)[:, None]      # [S, C]
    seen = (own[:, :, None] & causal[:, None, :] & filled[None, :, :]).reshape(T, S * C)   # [T, S*C]
    scores = torch.einsum("tkgd,kcd->ktgc", qg, k) * scale                # [KV, T, G, S*C]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = torch.where(seen[None, :, None, :], scores, _MASKED)
    out = torch.einsum("ktgc,kcd->tkgd", torch.softmax(scores, dim=-1), v)   # [T, KV, G, D]
    return out
