"""Custom torch ops of the exporter's own models (lowered in exporter/lowerings/linalg.py).

    hloserve::mixed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor   # x [..., in] -> [..., out]

A Linear over 16-bit weights with wider activations: x is rounded to the weight's dtype, the
products (exact in float32: 8 + 8 or 11 + 11 significant bits) are summed in float32 and the
result is x's dtype. This is a TPU's default matmul precision, and on CPU what the bf16 dot
kernels compute (avx512_bf16: twice the f32 rate; the weights half the bytes). Expressed in
ATen it would be a bf16 matmul whose result is rounded to bf16 before widening again (mm of
bf16 returns bf16), so the model calls this op instead. Eager form: the torch reference.

The op is registered with torch's dispatcher when this module is first imported (idempotent
per process).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


@torch.library.custom_op("hloserve::mixed_linear", mutates_args=())
def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x.to(weight.dtype).to(x.dtype), weight.to(x.dtype), bias)


@mixed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
