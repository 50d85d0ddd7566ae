"""GGUF blocks imported without a float round trip into the LLM step's quantized linears.

    stored, scheme = gguf_blocks(ckpt.tensors[name])    # one tensor's blocks in our layout
    stored, scheme = kept_blocks(ckpt.tensors[name])    # a K-quant tensor's blocks kept as they are
    given = stored_by_module(model, ckpt, config)       # `hloserve export X.gguf --quantize gguf`: every
                                                        # linear's blocks, for quantize_module's `given`

K-quant linears (Q4_K, Q5_K, Q6_K) keep their super-blocks (WeightScheme.of_block): the quants
repacked into element order, each super-block's header bytes as they are (quantization/schemes.py).
Each other ggml type in GGUF_SCHEMES converts to one of our schemes from its integer fields
(GGUFTensor.block_fields), never through floats: Q8_0 / Q4_0 / Q4_1 / Q5_0 exactly (Q5_0 keeps its
5-bit values in linear roles whose every layer is Q5_0, int8 elsewhere: the same values); K-quant
embedding tables are converted too, Q4_K with its sub-block scales rounded to f16, Q6_K with
sub-blocks of 16 paired into groups of 32 (exact on the pair's larger scale). Bounds in
docs/quantization.md ("GGUF import").
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np
import torch
from hloserve.quantization import primitives
from hloserve.quantization.convert import quantize_tensor
from hloserve.quantization.schemes import QuantConfig, QuantizationError, WeightScheme

# K-quant types a linear keeps as blocks (the `hloserve.quant_linear` version 3 composite); the header
# bytes of each super-block in the file's block (the rest are its quants)
KEPT_BLOCKS: Mapping[str, slice] = {"Q4_K": slice(0, 16), "Q5_K": slice(0, 16), "Q6_K": slice(192, 210)}

# ggml type -> the scheme its blocks convert to (group 32 throughout)
GGUF_SCHEMES: Mapping[str, WeightScheme] = {
    "Q8_0": WeightScheme(8, 32, True, "f16"),    # exact: q, d
    "Q5_0": WeightScheme(5, 32, True, "f16"),    # exact: q - 16 in [-16, 15], d (int8 where a role needs it)
    "Q4_0": WeightScheme(4, 32, True, "f16"),    # exact: q - 8, d
    "Q4_1": WeightScheme(4, 32, False, "f16"),   # exact: q, d, m
    "Q4_K": WeightScheme(4, 32, False, "f16"),   # q; d * sc and -dmin * m rounded to f16 (2^-11 relative)
    "Q6_K": WeightScheme(8, 32, True, "f32"),    # sub-blocks of 16 paired: exact on the larger scale
}


def _q4_k(f: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K sub-block j (32 elements): value = (d * sc_j) * q - dmin * m_j = q * scale_j + min_j, with
    scale and min exact in f32 (an f16 times a 6-bit integer)."""
    scale = f["d"].astype(np.float32)[..., None] * f["sc"].astype(np.float32)     # [..., nb, 8]
    mn = -(f["dmin"].astype(np.float32)[..., None] * f["m"].astype(np.float32))   # [..., nb, 8]
    return f["q"], scale, mn


def _q6_k(f: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K sub-blocks a, b of 16 (value d * sc * q, q in [-32, 31]) -> one int8 group of 32.

    r = the one of sc_a, sc_b of larger magnitude (signed); scale = d * r / 4 (exact in f32);
    q8 = round(4 * q * sc / r), clipped to [-128, 127]. For r's sub-block q8 = 4q, so
    q8 * scale = q * (d * r): exact. For the other |4 q sc / r| <= 128, so the rounding costs at most
    scale / 2, and the clip one scale, only when sc = -r and q = -32: of such a pair (sc_b = -sc_a)
    r is taken from the sub-block holding a -32 when only one does."""
    lead = f["q"].shape[:-1]                                             # [..., nb]
    sc = f["sc"].astype(np.int32).reshape(*lead, 8, 2)                   # [..., nb, pair, 2]
    q = f["q"].astype(np.int32).reshape(*lead, 8, 2, 16)                 # [..., nb, pair, 2, 16]
    r = np.where(_q6_k_second(sc, q), sc[..., 1], sc[..., 0])           # [..., nb, 8]
    num = (4 * q * sc[..., None]).astype(np.float64)
    den = np.where(r == 0, 1, r)[..., None, None].astype(np.float64)
    q8 = np.where(r[..., None, None] == 0, 0, np.clip(np.round(num / den), -128, 127))
    scale = f["d"].astype(np.float32)[..., None] * r.astype(np.float32) / np.float32(4)   # [..., nb, 8]
    return q8.astype(np.int8).reshape(*lead, 256), scale, None


def _q6_k_second(sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Whether Q6_K's pair scale r comes from the second sub-block: sc [..., 2], q [..., 2, 16] -> [...]."""
    low = (q == -32).any(-1)                                             # [..., 2]
    tie = (sc[..., 1] == -sc[..., 0]) & low[..., 1] & ~low[..., 0]       # the second must be r, or it clips
    return (np.abs(sc[..., 1]) > np.abs(sc[..., 0])) | tie


# ggml type -> block fields -> (q in element order [..., nb, block], scale, min or None) per group of 32
_CONVERT = {
    "Q8_0": lambda f: (f["q"], f["d"], None),
    "Q5_0": lambda f: (f["q"].astype(np.int8) - 16, f["d"], None),
    "Q4_0": lambda f: (f["q"].astype(np.int8) - 8, f["d"], None),
    "Q4_1": lambda f: (f["q"], f["d"], f["m"]),
    "Q4_K": _q4_k,
    "Q6_K": _q6_k,
}


def gguf_blocks(t, *, five: bool = True) -> tuple[dict[str, np.ndarray], WeightScheme]:
    """A GGUFTensor of a GGUF_SCHEMES type -> (stored tensors in our layout, its scheme), no float round trip.

    Q8_0: q int8 [out, in], scale f16 [out, in/32]. Q5_0: q - 16 as int8, scale d, scheme int5 (int8
    without `five`: the same bytes row by row, schemes.py). Q4_0: (q - 8)
    packed signed, scale d. Q4_1: q packed unsigned, scale = d, min = m (value q * d + m, as gguf
    computes it). Q4_K: q packed unsigned, scale and min per sub-block of 32 (see _q4_k) rounded to
    f16, or kept f32 where f16 would overflow. Q6_K: int8, f32 scale per pair of sub-blocks (_q6_k).
    """
    scheme = GGUF_SCHEMES.get(t.ggml_type)
    if scheme is None:
        raise QuantizationError(f"{t.gguf_name}: ggml type {t.ggml_type} has no direct import; "
                                f"supported: {sorted(GGUF_SCHEMES)}")
    if not five:
        scheme = scheme.row_by_row()
    lead, n_in = t.shape[:-1], t.shape[-1]
    q, scale, mn = _CONVERT[t.ggml_type](t.block_fields())
    sdt = np.float16 if scheme.scale_dtype == "f16" else np.float32
    with np.errstate(over="ignore"):
        if scale.dtype != sdt and not all(np.isfinite(a.astype(sdt)).all() for a in (scale, mn) if a is not None):
            scheme, sdt = dataclasses.replace(scheme, scale_dtype="f32"), np.float32
    q = q.reshape(*lead, n_in).astype(np.int8)                           # [out, in]
    stored = {"qweight": primitives.pack_int4(q) if scheme.bits == 4 else np.ascontiguousarray(q),
              "scale": np.ascontiguousarray(scale.astype(sdt).reshape(*lead, n_in // 32))}
    if mn is not None:
        stored["min"] = np.ascontiguousarray(mn.astype(sdt).reshape(*lead, n_in // 32))
    return stored, scheme


def kept_blocks(t) -> tuple[dict[str, np.ndarray], WeightScheme]:
    """A Q4_K / Q5_K / Q6_K GGUFTensor -> (qweight: its quants in element order, Q4_K packed two a
    byte, Q5_K / Q6_K int8; scale: each super-block's header bytes as stored, uint8 [..., out,
    in / 256 * 16 | 18]), its block scheme: a lossless repack (quantization/schemes.py)."""
    scheme = WeightScheme.of_block(t.ggml_type)
    lead = t.shape[:-1]
    head = t.blocks()[..., KEPT_BLOCKS[t.ggml_type]].reshape(*lead, -1)            # [..., out, nb * 16 | 18]
    q = t.block_fields()["q"].reshape(*lead, t.shape[-1]).astype(np.int8)          # [..., out, in]
    qweight = primitives.pack_int4(q) if scheme.bits == 4 else q
    return {"qweight": np.ascontiguousarray(qweight), "scale": np.ascontiguousarray(head)}, scheme


def _parts(ts: list, target: WeightScheme, where: str, *, linear: bool) -> list[tuple[dict[str, np.ndarray], WeightScheme]]:
    """Tensors that are one role's weights (every layer's q_proj, ...) -> each one's (stored tensors,
    scheme): a linear's K-quant parts keep their blocks (kept_blocks; where a role mixes block types,
    e.g. a Q4_K_M file's Q4_K and Q6_K down matrices, the layers differ and the scan's period says
    how they are traced), the others as _converted makes them."""
    kept = [linear and t.ggml_type in KEPT_BLOCKS for t in ts]
    rest = iter(_converted([t for t, k in zip(ts, kept) if not k], target, where, linear=linear) if not all(kept) else ())
    return [kept_blocks(t) if k else next(rest) for t, k in zip(ts, kept)]


def _converted(ts: list, target: WeightScheme, where: str, *, linear: bool = False
               ) -> list[tuple[dict[str, np.ndarray], WeightScheme]]:
    """Tensors that are one stored weight (a scanned stack's layers) -> their stored tensors
    in one scheme: each part's own blocks where its GGUF_SCHEMES entry has the scheme's bits and
    symmetry, requantized from its float values with `target` otherwise; f16 scales are widened
    to f32 (exactly) when any part needs f32. Q5_0 parts keep their 5-bit values where the weight is
    `linear` and every part is Q5_0, else they are int8 (exactly: the same values, schemes.py)."""
    five = linear and all(t.ggml_type == "Q5_0" for t in ts)
    natives = [GGUF_SCHEMES.get(t.ggml_type) for t in ts]
    natives = [s if s is None or five else s.row_by_row() for s in natives]
    kinds = {(s.bits, s.symmetric) for s in natives if s is not None}
    if None not in natives and len(kinds) == 1:
        target = natives[0]
    out, schemes = [], []
    for t, s in zip(ts, natives):
        if s is not None and (s.bits, s.symmetric) == (target.bits, target.symmetric):
            stored, s = gguf_blocks(t, five=five)
        else:
            q, s = quantize_tensor(torch.from_numpy(t.dequantize()), target, where)
            stored = {role: a.numpy() for role, a in q.items()}
        out.append(stored)
        schemes.append(s)
    if len({dataclasses.replace(s, scale_dtype="f32", rounding="minmax") for s in schemes}) != 1:
        raise QuantizationError(f"{where}: its parts convert to different schemes ({sorted({s.describe() for s in schemes})}); "
                                f"--quantize-skip it")
    if any(s.scale_dtype == "f32" for s in schemes):
        out = [{r: a.astype(np.float32) if r != "qweight" else a for r, a in st.items()} for st in out]
        schemes = [dataclasses.replace(schemes[0], scale_dtype="f32")] * len(out)
    return [(st, schemes[0]) for st in out]


def stored_by_module(module: torch.nn.Module, ckpt, config: QuantConfig
                     ) -> dict[str, tuple[dict[str, torch.Tensor], WeightScheme]]:
    """The generic step's share of `--quantize gguf`: each nn.Linear / nn.Embedding of `module` (a
    transformers model loaded from the GGUF's Hugging Face directory, layers unscanned) whose weight
    the file holds, as stored tensors from the file's blocks (row by row, HF row order), by module
    name: quantization.convert.quantize_module's `given`. K-quant linears keep their blocks; the other
    tensors of a role across the layers (model.layers.*.self_attn.q_proj, ...) get one scheme, as a
    scanned stack needs, chosen as _converted does (_parts)."""
    roles: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and f"{name}.weight" in ckpt.tensors \
                and not config.skipped(name):
            roles.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    out = {}
    for role, names in roles.items():
        linear = isinstance(module.get_submodule(names[0]), torch.nn.Linear)
        parts = _parts([ckpt.tensors[f"{n}.weight"] for n in names], config.scheme, role, linear=linear)
        for name, (stored, scheme) in zip(names, parts):
            out[name] = {r: torch.from_numpy(a) for r, a in stored.items()}, scheme
    return out


# the experts stacks of one layer in the file (checkpoint names under the experts module)
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
# experts whose every stack is one of these 16-bit types stay 16-bit (the grouped_experts composite)
_SIXTEEN = {"F16": torch.float16, "BF16": torch.bfloat16}


def stored_experts(module: torch.nn.Module, ckpt, config: QuantConfig) -> dict[str, "torch.dtype | dict"]:
    """`--quantize gguf`'s share for the experts modules of `module` (the transformers model, layers
    unscanned) whose stacks the file holds (ckpt.tensors NAME.gate_proj, .up_proj, .down_proj
    [E, out, in]; a name config.skip matches stays as loaded), by module name:

    * every stack of the file F16 (or every one BF16): that dtype; the experts are kept as those 16
      bits (the grouped_experts composite), exactly the file's values;
    * otherwise {"gate_up_proj": (stored, scheme), "down_proj": (stored, scheme)}: all the experts
      stacks of the model as one role, as _converted makes a dense role's (each stack's own blocks
      where its GGUF_SCHEMES entry has the role's bits and symmetry: Q8_0 / Q5_0 -> int8 g32,
      Q4_0 -> int4 g32, Q4_1 -> int4 g32 asym, exactly; Q4_K / Q6_K as their conversion bounds;
      requantized in config.scheme from the dequantized values otherwise), gate and up joined along
      the rows as transformers' gate_up_proj: one scheme for every stack, as the quant_experts
      composite (one bit width) and a scanned stack need. K-quant blocks are not kept: the
      quant_experts composite has no block layout."""
    names = [n for n, _ in module.named_modules() if f"{n}.gate_proj" in ckpt.tensors and not config.skipped(n)]
    if not names:       # a dense model
        return {}
    stacks = [ckpt.tensors[f"{n}.{p}"] for n in names for p in _EXPERT_PARTS]
    kinds = {t.ggml_type for t in stacks}
    if len(kinds) == 1 and next(iter(kinds)) in _SIXTEEN:
        return {n: _SIXTEEN[next(iter(kinds))] for n in names}
    parts = iter(_converted(stacks, config.scheme, "the experts (mlp.experts.*)"))
    out: dict[str, torch.dtype | dict] = {}
    for n in names:
        (gate, scheme), (up, _), (down, _) = next(parts), next(parts), next(parts)
        gate_up = {r: np.concatenate([gate[r], up[r]], axis=-2) for r in gate}      # [E, 2I, .]
        out[n] = {attr: ({r: torch.from_numpy(np.ascontiguousarray(a)) for r, a in st.items()}, scheme)
                  for attr, st in (("gate_up_proj", gate_up), ("down_proj", down))}
    return out
