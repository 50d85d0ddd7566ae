"""What the accelerators' `hloserve.quant_linear` kernels share (quant_gpu.py, quant_tpu.py): the
static parameters, which layouts they serve, and the graph-side preparation of their operands.

The kernels serve version 2 of the composite (runtime/artifact/kernels.py QUANT_LINEAR_V2; version 6
alike, its calls of bf16_rows rows and more with x and each dequantized tile rounded to bf16), the
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

Version 3 (GGUF K-quant super-blocks: Q4_K, Q5_K, Q6_K) stores each row's quants one after the
other (Q4_K: element 2k in a byte's low nibble, 2k + 1 in its high one; Q5_K / Q6_K: one int8 each)
and the sub-block scales packed in per-block headers. The graph decodes the headers of the layer
picked into f32 scale and min rows (`kquant_scales`: the decomposition's own decoding, d * sc exact
in f32; half of a Q4_K weight's bytes, a quarter of a Q5_K or Q6_K one's, read once more by the
kernel), and the kernels read the quants where they lie in the stack: a tile is [TN rows, TB bytes]
of the layer's matrix, its activations split into phases by byte (`KQuantParams.unit` elements a byte: x_p[m, b] = x8[m,
unit b + p]), its scale and min rows spread over the tile's bytes (each platform as its lowering
allows), and the product is the sum over phases of x_p times (q_p * scale + min) transposed.

Version 4 (5-bit values, GGUF Q5_0 kept) is version 2's int4 layout with each 32-element block's
fifth bits after its nibbles: a block of 16 rows is 5 runs of 64 bytes, 4 k-steps of nibbles (of
the codes q + 16) and one of bit masks, 16 bytes a step (8 for its low nibbles, 8 for its high
ones; bit 4 r + c of each little-endian 64-bit mask). The kernels read the block as [5, 64] bytes
(`five_phases` orders the activations to match: phase p of step s of block b), widen the nibbles as
int4's unsigned ones, add 16 where a lane's bit is set (each platform spreads a mask byte over the
8 lanes it covers as its lowering allows), then run version 2's products with q = code - 16 and one
scale per block.

Version 5 (K-quants whose quants were interleaved by 16 rows at export, version 2's layout) runs
version 2's kernels on them, the layer's headers decoded in the graph into version 2's scale and min
rows (`kquant16_operands`; groups of 32, Q6_K's of 16).

Version 1 (rows stored one by one: matrices whose row count is not a multiple of 16, or groups
that are not whole 32-element blocks) keeps its decomposition (`why_not`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hloserve.runtime.artifact.kernels import (QUANT_LINEAR_V2, QUANT_LINEAR_V3, QUANT_LINEAR_V4, QUANT_LINEAR_V5,
                                               QUANT_LINEAR_V6, X_BLOCK, Block, block_scales, quantize_blocks)

ROWS = 16           # rows of one interleaved block (schemes.INTERLEAVE, the version 2 layout)
PENDING = "hloserve_pallas_quant_linear"   # its placeholder custom call (pallas/__init__.py)


@dataclasses.dataclass(frozen=True)
class QuantParams:
    """The composite's attributes the kernels are built with: bits (8 or 4; version 4: 5) and group
    (elements of a row sharing one scale; K: one per row); `bf16`: version 6 at a row count of its
    bf16_rows or more (x and the dequantized tile rounded to bfloat16, not x quantized per block)."""
    bits: int
    group: int
    bf16: bool = False

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
    if version in (QUANT_LINEAR_V3.version, QUANT_LINEAR_V5.version):
        kind = int(attrs["kind"])
        if kind not in Block._value2member_map_:
            return f"version {version} kind {kind}: the kernels take the K-quant blocks {', '.join(b.name for b in Block)}"
        return None
    if version == QUANT_LINEAR_V4.version:
        p = QuantParams.from_attributes(attrs)
        return None if (p.bits, p.group) == (5, X_BLOCK) else f"version 4 bits {p.bits}, group {p.group}: " \
            "the kernels take bits 5 in groups of 32 (GGUF Q5_0)"
    if version not in (QUANT_LINEAR_V2.version, QUANT_LINEAR_V6.version):
        return f"version {version}: no kernel knows it"
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


def phases(x, params: "QuantParams | KQuantParams", rows: int):
    """x f32 [M, K] -> x8's phases f32 [unit, rows, K / unit] (x_p[m, a] = x8[m, unit a + p]; rows >= M,
    the extra rows zero): the activations in the weight bytes' order, before the kernel."""
    import jax
    import jax.numpy as jnp
    m, k = x.shape
    x = x.astype(jnp.float32)
    # the contract's x8, or version 6's chunk rows rounded to bf16 (the values kept in f32)
    xr = (x.astype(jnp.bfloat16).astype(jnp.float32) if getattr(params, "bf16", False)
          else quantize_blocks(x, jnp, jax.lax.optimization_barrier))
    x8 = jnp.pad(xr, ((0, rows - m), (0, 0)))
    return x8.reshape(rows, k // params.unit, params.unit).transpose(2, 0, 1)


def five_phases(x, rows: int):
    """Version 4: x f32 [M, K] -> x8's phases f32 [8, 4, rows, K / 32]: [p, s, m, b] = x8[m, 32 b + 8 s + p],
    the activations of phase p of k-step s of each block, in the order the blocks lie (rows >= M,
    the extra rows zero)."""
    xs = phases(x, QuantParams(5, X_BLOCK), rows)                       # [8, rows, K / 8]
    return xs.reshape(8, rows, -1, 4).transpose(0, 3, 1, 2)


def rounded(w, params: QuantParams):
    """A dequantized f32 tile as the product takes it: rounded to bf16 (kept in f32) for version 6's
    chunks, else as it is."""
    import jax.numpy as jnp
    return w.astype(jnp.bfloat16).astype(jnp.float32) if params.bf16 else w


def widen(b, bits: int, signed: bool):
    """A tile of stored bytes -> its f32 values per phase: int8 as they are (bits 8), int4 as (low,
    high) nibbles, two's complement where `signed` (symmetric) and unsigned [0, 15] otherwise."""
    import jax.numpy as jnp
    v = b.astype(jnp.int32)
    if bits == 8:
        return (v.astype(jnp.float32),)
    lo, hi = v & 15, (v >> 4) & 15
    if signed:
        lo, hi = jnp.where(lo >= 8, lo - 16, lo), jnp.where(hi >= 8, hi - 16, hi)
    return lo.astype(jnp.float32), hi.astype(jnp.float32)


def layer_of(layer, stacked: int):
    """The layer index as s32[1], clamped into the stack (a stack of one is layer 0, as the
    decomposition reads it)."""
    import jax.numpy as jnp
    return jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, stacked - 1)


def padded_rows(m: int, tile: int) -> int:
    return -(-m // tile) * tile


@dataclasses.dataclass(frozen=True)
class KQuantParams:
    """Version 3's static parameters: the block type (its `kind` attribute). A tile's bytes are read
    in `unit` phases (Q4_K: 2 elements a byte) and `group_bytes` bytes share one scale (and min)."""
    kind: int

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> "KQuantParams":
        return cls(int(attrs["kind"]))

    @property
    def block(self) -> str:
        return Block(self.kind).name

    @property
    def unit(self) -> int:
        return 2 if self.block == "Q4_K" else 1

    @property
    def group(self) -> int:
        """Elements sharing one scale: Q6_K's sub-blocks of 16, the others' of 32."""
        return 16 if self.block == "Q6_K" else 32

    @property
    def group_bytes(self) -> int:
        return self.group // self.unit

    @property
    def has_min(self) -> bool:
        return self.block != "Q6_K"

    @property
    def bits(self) -> int:
        """Bits of a stored quant (`widen`): Q4_K's unsigned nibbles, Q5_K's and Q6_K's int8."""
        return 4 if self.unit == 2 else 8


def kquant_scales(blocks, layer, params: KQuantParams):
    """The layer's headers (blocks u8 [L, N, K/256 * H]) -> its scale and min rows, f32 [N, K/group]
    (Q6_K: min None): the contract's block_scales traced with jax.numpy, as the decomposition decodes them."""
    import jax.numpy as jnp
    from jax import lax
    picked = lax.dynamic_index_in_dim(blocks, layer_of(layer, blocks.shape[0])[0], 0, False)
    return block_scales(picked, params.block, xp=jnp)


def kquant16_operands(blocks, layer, params: KQuantParams):
    """Version 5 (K-quants, the quants interleaved as version 2's) on version 2's kernels: the layer's
    headers decoded in the graph (kquant_scales) and laid out as version 2's scale and min rows, a stack
    of one [1, N/16, K/group, 16] (the layer already picked; min f32[0] for Q6_K), and version 2's
    parameters (Q4_K: int4 unsigned nibbles with mins; Q5_K, Q6_K: int8 bytes)."""
    import jax.numpy as jnp
    scale, low = kquant_scales(blocks, layer, params)                    # [N, K / group] f32

    def rows(a):
        n, g = a.shape
        return a.reshape(n // ROWS, ROWS, g).transpose(0, 2, 1)[None]   # [1, N/16, G, 16]
    mins = jnp.zeros((0,), jnp.float32) if low is None else rows(low)
    return rows(scale), mins, QuantParams(params.bits, params.group)


def weights_nt(x, w):
    """x [BM, TB] times w [TN, TB] transposed: f32 products, f32 sums."""
    import jax.numpy as jnp
    from jax import lax
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
