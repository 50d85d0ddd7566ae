"""What the accelerators' `hloserve.quant_linear` kernels share (quant_gpu.py, quant_tpu.py): the
static parameters, which layouts they serve, and the graph-side preparation of their operands.

The kernels serve version 2 of the composite (runtime/artifact/kernels.py QUANT_LINEAR_V2), the
layout the exporter gives every linear layer whose rows come in sixteens and whose groups are
whole 32-element blocks (quantization/schemes.py `for_linear`): int8 per channel or grouped, int4
packed symmetric or asymmetric. Each 16-row block of a layer's matrix is a run of bytes in which
byte (a, 4 r + c) holds row r's elements k = 4 a + c (int8), or k = 8 a + c in its low nibble and
8 a + 4 + c in its high one (int4). So the weights are read as they lie: a tile of `U` steps of `a`
is a [U, 16, 4] block of bytes, and the activations are split before the kernel into phases that
match it, `x_p[m, a] = x8[m, unit * a + p]` (unit 4 for int8, 8 for int4; p < unit): the product is
then the sum over phases of x_p times the dequantized [U, 16] tile of bytes (a, ., c) (p = c, or
4 + c for high nibbles). A group of g elements is g / unit steps of `a` (`per_group`): a tile's
scale rows are the groups its steps fall in, widened to f32 in registers next to the dot.

Version 1 (rows stored one by one: matrices whose row count is not a multiple of 16, or groups
that are not whole 32-element blocks) and version 3 (GGUF K-quant super-blocks, whose 6-bit
sub-block scales are packed in per-block headers) keep their decomposition (`why_not`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hloserve.runtime.artifact.kernels import QUANT_LINEAR_V2, X_BLOCK, quantize_blocks

ROWS = 16           # rows of one interleaved block (schemes.INTERLEAVE, the version 2 layout)
PENDING = "hloserve_pallas_quant_linear"   # its placeholder custom call (pallas/__init__.py)


@dataclasses.dataclass(frozen=True)
class QuantParams:
    """The composite's attributes the kernels are built with: bits (8 or 4) and group (elements
    of a row sharing one scale; K: one per row)."""
    bits: int
    group: int

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> "QuantParams":
        return cls(int(attrs["bits"]), int(attrs["group"]))

    @property
    def unit(self) -> int:
        """Elements of a row per step of `a` (the byte column a of a 16-row block)."""
        return 4 if self.bits == 8 else 8

    @property
    def per_group(self) -> int:
        """Steps of `a` sharing one scale."""
        return self.group // self.unit


def why_not(version: int, attrs: dict[str, Any]) -> str | None:
    """Why the accelerators' kernels do not serve this quant_linear (its decomposition runs), or None."""
    if version == 1:
        return "version 1 (rows one by one: a row count not a multiple of 16, or groups of other than whole " \
               "32-element blocks): the decomposition"
    if version != QUANT_LINEAR_V2.version:
        return "version 3 (GGUF K-quant super-blocks, scales packed in each block's header): the decomposition"
    p = QuantParams.from_attributes(attrs)
    if p.bits not in (8, 4) or p.group % X_BLOCK:
        return f"bits {p.bits}, group {p.group}: the kernels take bits 8 or 4 with whole 32-element groups"
    return None


def steps(params: QuantParams, k: int, cap: int) -> int:
    """Steps of `a` per tile: the largest power of two up to `cap` dividing K / unit whose tiles lie
    in one group or cover whole groups (a tile's scale rows are then whole groups)."""
    ka, pg = k // params.unit, params.per_group
    u = cap
    while u > 1 and not (ka % u == 0 and (pg % u == 0 or u % pg == 0)):
        u //= 2
    return u


def phases(x, params: QuantParams, rows: int):
    """x f32 [M, K] -> x8's phases f32 [unit, rows, K / unit] (x_p[m, a] = x8[m, unit a + p]; rows >= M,
    the extra rows zero): the activations in the weight bytes' order, before the kernel."""
    import jax.numpy as jnp
    m, k = x.shape
    x8 = jnp.pad(quantize_blocks(x.astype(jnp.float32), jnp), ((0, rows - m), (0, 0)))   # the contract's x8
    return x8.reshape(rows, k // params.unit, params.unit).transpose(2, 0, 1)


def layer_of(layer, stacked: int):
    """The layer index as s32[1], clamped into the stack (a stack of one is layer 0, as the
    decomposition reads it)."""
    import jax.numpy as jnp
    return jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, stacked - 1)


def padded_rows(m: int, tile: int) -> int:
    return -(-m // tile) * tile
