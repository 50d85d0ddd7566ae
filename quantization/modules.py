"""Quantized Linear / Embedding, exported through two custom ops the emitter lowers.

    hloserve::quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? min, Tensor? bias,
                               Tensor layer, int bits, int group, int rows=0) -> Tensor   # x [..., in] -> [..., out]
    hloserve::kquant_linear(Tensor x, Tensor qweight, Tensor blocks, Tensor? bias, Tensor layer,
                            int kind, int rows=0) -> Tensor   # GGUF K-quant blocks kept (WeightScheme.block;
                                                              # rows 16: the quants interleaved)
    hloserve::quantized_embedding(Tensor qweight, Tensor scale, Tensor? min, Tensor indices,
                                  int bits, int group, ScalarType dtype, int rows=0) -> Tensor   # [*idx, hidden]

`group` 0 means one scale per output row. quantized_linear takes a stack of matrices (qweight
[L, out, in or in/2], scale [L, out(, G)], min likewise; with rows=16 interleaved by 16 rows, see
WeightScheme.rows) and uses matrix `layer` (a 0-dim int32):
a scanned layer loop reads its layer where the stack lies (the `hloserve.quant_linear` composite,
runtime/artifact/kernels.py), and a single matrix is a stack of one. The ops keep the quantized tensors whole through
torch.export (a q/dq pattern in ATen would be decomposed and re-fused by chance); the lowering
in exporter/composites/quant_linear.py decides how XLA sees the dequantization. Their eager
implementations (dequantize in float32, then F.linear on x quantized to int8 per block of 32 as
the `hloserve.quant_linear` contract says, or F.embedding) are the torch reference.

The ops are registered with torch's dispatcher when this module is first imported (torch's
custom-op API has no other form); registering is idempotent per process and changes nothing
else.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import primitives
from hloserve.runtime.artifact.kernels import QUANT_BF16_ROWS, X_BLOCK, Block

from .schemes import MIN_SUFFIX, SCALE_SUFFIX, WeightScheme

_FLOAT_SCALE = {"f32": torch.float32, "f16": torch.float16}


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 [..., m] -> int8 [..., 2m] (schemes.py layout: element 2k low nibble, 2k+1 high)."""
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    if signed:
        lo = torch.where(lo > 7, lo - 16, lo)
        hi = torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])   # [..., 2m]


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int,
               group: int) -> torch.Tensor:
    """float32 [..., out, in] of a stored weight (the torch twin of primitives.dequantize)."""
    q = unpack_int4(qweight, signed=min is None) if bits == 4 else qweight
    n_in = q.shape[-1]
    g = group or n_in
    qg = q.to(torch.float32).reshape(*q.shape[:-1], n_in // g, g)        # [..., out, G, g]
    s = scale.to(torch.float32).reshape(*q.shape[:-1], n_in // g, 1)     # [..., out, G, 1]
    w = qg * s
    if min is not None:
        w = w + min.to(torch.float32).reshape(*q.shape[:-1], n_in // g, 1)
    return w.reshape(q.shape)                                            # [..., out, in]




def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """x f32 [..., K] quantized to int8 per block of X_BLOCK elements and back (llama.cpp's Q8_0 rule:
    d = max|x| / 127, round_half_even(x / d) * d), the rounding the `hloserve.quant_linear`
    composite applies to its activations."""
    k = x.shape[-1]
    pad = -k % X_BLOCK
    xb = F.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, X_BLOCK)          # [..., B, 32]
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(*x.shape[:-1], -1)[..., :k]                   # [..., K]


def rows_in_order(qweight: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int):
    """One matrix interleaved by 16 rows (qweight [N/16, 16 K | 8 K], scale/min [N/16, G, 16]) -> its
    integer values int8 [N, K] and scale/min [N, G]: primitives.rows_in_order, the one definition the
    composite's decomposition also traces, run on the tensors' memory."""
    out = primitives.rows_in_order(*(None if t is None else t.numpy() for t in (qweight, scale, min)), bits)
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in out)


# The eager op is version 2's product (x quantized per block as Q8_0) at any row count. An artifact's
# quant_linear version 6 rounds x and the dequantized weights to bf16 in a call of QUANT_BF16_ROWS rows
# or more, where its rows are the step's bucket, which an eager forward of the same prompt does not
# have: a test comparing the two runs the reference under `as_step_of(bucket)` (0: version 2's).
_STEP_ROWS = contextvars.ContextVar("hloserve_step_rows", default=0)


@contextlib.contextmanager
def as_step_of(rows: int):
    """Eager quantized linears in version 2's interleaved layout compute as version 6 does in a step of `rows` rows."""
    token = _STEP_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


@torch.library.custom_op("hloserve::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], layer: torch.Tensor, bits: int, group: int,
                     rows: int = 0) -> torch.Tensor:
    i = int(layer)
    if rows:   # interleaved by 16 rows (WeightScheme.rows): put back in row order, then the same arithmetic
        q, s, m = rows_in_order(qweight[i], scale[i], None if min is None else min[i], bits)
        w = dequantize(q, s, m, 8, group)
        if bits != 5 and _STEP_ROWS.get() >= QUANT_BF16_ROWS:   # version 6's chunks: x and W rounded to bf16
            y = F.linear(x.float().bfloat16().float(), w.bfloat16().float()).to(x.dtype)
            return y if bias is None else y + bias
    else:
        w = dequantize(qweight[i], scale[i], None if min is None else min[i], bits, group)
    y = F.linear(quantize_blocks(x.float()), w).to(x.dtype)
    return y if bias is None else y + bias


@quantized_linear.register_fake
def _(x, qweight, scale, min, bias, layer, bits, group, rows=0):
    return x.new_empty((*x.shape[:-1], qweight.shape[-2] * (rows or 1)))


@torch.library.custom_op("hloserve::kquant_linear", mutates_args=())
def kquant_linear(x: torch.Tensor, qweight: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                  layer: torch.Tensor, kind: int, rows: int = 0) -> torch.Tensor:
    i = int(layer)
    scheme = dataclasses.replace(WeightScheme.of_block(Block(kind).name), rows=rows)
    w = torch.from_numpy(primitives.dequantize_blocks(qweight[i].numpy(), blocks[i].numpy(), scheme))
    y = F.linear(quantize_blocks(x.float()), w).to(x.dtype)
    return y if bias is None else y + bias


@kquant_linear.register_fake
def _(x, qweight, blocks, bias, layer, kind, rows=0):
    return x.new_empty((*x.shape[:-1], blocks.shape[-2]))


@torch.library.custom_op("hloserve::quantized_embedding", mutates_args=())
def quantized_embedding(qweight: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor],
                        indices: torch.Tensor, bits: int, group: int, dtype: torch.dtype,
                        rows: int = 0) -> torch.Tensor:
    if rows:   # the table interleaved by 16 rows (a tied LM head's layout): the rows picked where they lie
        arrays = (None if t is None else t.numpy() for t in (qweight, scale, min))
        q, s, m = (None if a is None else torch.from_numpy(np.ascontiguousarray(a))
                   for a in primitives.gather_rows(*arrays, indices.numpy(), bits))
        return dequantize(q, s, m, 8, group).to(dtype)
    picked = qweight[indices]                                            # [*idx, in or in/2]
    mn = None if min is None else min[indices]
    return dequantize(picked, scale[indices], mn, bits, group).to(dtype)


@quantized_embedding.register_fake
def _(qweight, scale, min, indices, bits, group, dtype, rows=0):
    n = qweight.shape[-1] // rows if rows else qweight.shape[-1]
    return qweight.new_empty((*indices.shape, n * (2 if bits == 4 else 1)), dtype=dtype)


def _register(module: torch.nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> None:
    module.register_buffer(name, tensors["qweight"])
    module.register_buffer(name + SCALE_SUFFIX, tensors["scale"])
    module.register_buffer(name + MIN_SUFFIX, tensors.get("min"))


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight is stored quantized: buffers weight, weight_scale, weight_min (asym).

    A layer loop that scans stacked layers (exporter/llm/hf_layers.py) substitutes stacks
    [L, ...] of the tensors named in IN_PLACE and sets `layer`: the matrix is then read where it
    lies in the stack, not sliced out of it."""

    IN_PLACE = ("weight", "weight_scale", "weight_min")

    def __init__(self, in_features: int, out_features: int, scheme: WeightScheme, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.scheme, self.dtype = in_features, out_features, scheme, dtype
        _register(self, "weight", tensors)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.register_buffer("layer", torch.zeros((), dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, s, m = self.weight, self.weight_scale, self.weight_min
        if w.dim() == 2:                                                 # one matrix: a stack of one
            w, s, m = w[None], s[None], None if m is None else m[None]
        if self.scheme.block:                                            # GGUF K-quant blocks, kept
            return torch.ops.hloserve.kquant_linear(x, w, s, self.bias, self.layer, int(Block[self.scheme.block]),
                                                    self.scheme.rows)
        return torch.ops.hloserve.quantized_linear(x, w, s, m, self.bias, self.layer, self.scheme.bits,
                                                   self.scheme.group or 0, self.scheme.rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.scheme.describe()}"


class QuantizedEmbedding(torch.nn.Module):
    """An Embedding whose table is stored quantized (rows gathered, then dequantized): row by row, or
    interleaved by 16 rows (scheme.rows) where an LM head tied to it reads the same tensors."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: WeightScheme,
                 tensors: dict[str, torch.Tensor], dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme, self.dtype = num_embeddings, embedding_dim, scheme, dtype
        self.padding_idx = padding_idx
        _register(self, "weight", tensors)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.ops.hloserve.quantized_embedding(self.weight, self.weight_scale, self.weight_min, indices,
                                                      self.scheme.bits, self.scheme.group or 0, self.dtype,
                                                      self.scheme.rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.scheme.describe()}"
