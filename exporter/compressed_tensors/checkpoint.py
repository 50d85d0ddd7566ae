"""A compressed-tensors checkpoint directory read in place: its quantized modules' integers and
scales in hloserve's stored layout (quantization/schemes.py), its other tensors as a float state dict.

    ckpt = open_checkpoint(path)                    # config.json, the plan (config.py), tensor names
    state = ckpt.float_state_dict(torch.float32)    # what transformers loads: the float tensors, and a
                                                    # zero-stride placeholder for each quantized weight
    given = ckpt.stored_by_module(model, config)    # QuantRequest.stored: {module: (stored tensors, scheme)}

Storage (compressed-tensors' pack-quantized): a row's integers q in [-2^(b-1), 2^(b-1) - 1] are
offset to unsigned (q + 2^(b-1)) and packed into int32 words from the lowest bits up, 32 / b a word
(`weight_packed` [out, ceil(in * b / 32)]); `weight_scale` s [out, in / group] ([out, 1] per
channel, [1] per tensor) in the checkpoint's float dtype; asymmetric: `weight_zero_point` z, packed
the same way down each column ([ceil(out * b / 32), in / group]; per tensor [1], unpacked);
`weight_shape` [out, in]. W = (q - z) * s. int-quantized and naive-quantized store q in `weight`, int8.

Read little-endian, a word's bytes are its elements in order, two 4-bit values a byte, the first in
the low nibble: hloserve's int4 layout. So

    int4 symmetric    qweight = bytes ^ 0x88 (each nibble's offset of 8 removed: two's complement)
    int4 asymmetric   qweight = bytes (q + 8, unsigned); min = -(z + 8) * s: (q + 8) * s + min = (q - z) * s
    int8              qweight = bytes ^ 0x80 as int8 (pack-quantized), or `weight` (int-quantized)

No integer changes and nothing is requantized. Scales keep their values: stored f16 where every
scale and min of a role (model.layers.*.mlp.down_proj) is exactly an f16, else f32 (bf16 widens
exactly). With f16 or bf16 scales, (q - z) * s needs at most 5 + 11 bits, so the float32
dequantization of the quant composite gives compressed-tensors' own float32 decompression bit for bit
(tests/quantization/test_compressed_tensors.py); with f32 scales an asymmetric min is rounded (one ulp).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Mapping

import numpy as np
import torch
from hloserve.quantization import primitives
from hloserve.quantization.schemes import QuantConfig, QuantizationError, WeightScheme

from ..errors import SourceError
from .config import SUPPORTED, Plan, WeightArgs, is_compressed_tensors, read_plan

KEPT = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
# tensors of schemes this import refuses, and what they are
REFUSED = {"weight_g_idx": "an activation-order permutation (actorder group)",
           "weight_global_scale": "a global weight scale (nvfp4)", "input_global_scale": "a global input scale (nvfp4)",
           "input_scale": "a static activation scale", "input_zero_point": "a static activation zero point",
           "output_scale": "a quantized layer output", "k_scale": "a quantized KV cache",
           "v_scale": "a quantized KV cache", "q_scale": "quantized attention"}


@dataclasses.dataclass(frozen=True)
class CompressedCheckpoint:
    """A compressed-tensors directory: `plan` from config.json, `files` tensor name -> safetensors file,
    `quantized` module name -> {"weight_packed" | "weight" | "weight_scale" | ...: tensor name}."""
    path: str
    plan: Plan
    files: Mapping[str, str]
    quantized: Mapping[str, Mapping[str, str]]

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)

    def float_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor but the quantized modules' (their integers, scales, zero points, shapes), and for
        each quantized module a `weight` placeholder in `dtype` of the float shape: one zero expanded
        with stride 0 (no memory), its own, so that no two placeholders look shared. The module swap
        replaces them (stored_by_module); transformers keeps them as they are."""
        mine = {t for parts in self.quantized.values() for t in parts.values()}
        out = {name: self.tensor(name) for name in self.files if name not in mine}
        for module in self.quantized:
            out[f"{module}.weight"] = torch.zeros((), dtype=dtype).expand(*self.float_shape(module))
        return out

    def float_shape(self, module: str) -> tuple[int, int]:
        parts = self.quantized[module]
        if "weight" in parts:
            return tuple(self.tensor(parts["weight"]).shape)   # type: ignore[return-value]
        if "weight_shape" not in parts:
            raise SourceError(f"{self.path}: {module} has weight_packed but no weight_shape; the checkpoint is "
                              f"incomplete: save it again with llm-compressor")
        shape = tuple(int(v) for v in self.tensor(parts["weight_shape"]).tolist())
        if len(shape) != 2:
            raise QuantizationError(f"{self.path}: {module}.weight_shape is {list(shape)}: only 2-D weights (linear "
                                    f"layers, embeddings) are supported")
        return shape   # type: ignore[return-value]

    def stored_by_module(self, model: torch.nn.Module, config: QuantConfig
                         ) -> dict[str, tuple[dict[str, torch.Tensor], WeightScheme]]:
        """QuantRequest.stored for `model` (transformers' model of this checkpoint): each quantized
        module's integers and scales in hloserve's layout, row by row, by module name. One scale
        dtype per role across the layers (a scanned stack holds one). Raises where a quantized module
        has no linear or embedding of its name in `model`, or no config group, or is --quantize-skip'ped."""
        modules = dict(model.named_modules())
        converted = {}
        for name in self.quantized:
            module = modules.get(name)
            args = self._args(name, module, model, config)
            converted[name] = convert(self._read(name), args, self.float_shape(name), f"{self.path}: {name}")
        self._check_targets(modules)
        return {name: ({r: torch.from_numpy(a) for r, a in stored.items()}, scheme)
                for name, (stored, scheme) in _one_dtype_per_role(converted).items()}

    def _args(self, name: str, module, model: torch.nn.Module, config: QuantConfig) -> WeightArgs:
        where = f"{self.path}: {name}"
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            kind = "no module" if module is None else f"a {type(module).__name__}"
            raise QuantizationError(f"{where} is stored quantized, but transformers' model has {kind} of that name "
                                    f"(quantized linear layers and embeddings are supported; quantized mixture-of-"
                                    f"experts weights are not yet)")
        head, table = model.get_output_embeddings(), model.get_input_embeddings()
        if module is head and head is not None and table is not None and head.weight is table.weight:
            raise QuantizationError(f"{where} is stored quantized but tied to the input embedding; untie them "
                                    f"(tie_word_embeddings false) or leave the head unquantized (ignore: [lm_head])")
        if config.skipped(name):
            raise QuantizationError(f"{where}: --quantize-skip matches it, but the checkpoint stores it quantized and "
                                    f"hloserve keeps it so (no float round trip); drop the pattern")
        args = self.plan.args_of(name, _classes(module))
        if args is None:
            raise QuantizationError(f"{where} is stored quantized but no config group of quantization_config targets "
                                    f"it (or ignore lists it); the config does not describe the weights")
        return args

    def _check_targets(self, modules: Mapping[str, torch.nn.Module]) -> None:
        """Every linear / embedding the plan targets is stored quantized (else the config lies)."""
        for name, m in modules.items():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and name not in self.quantized:
                args = self.plan.args_of(name, _classes(m))
                if args is not None and f"{name}.weight" in self.files:
                    raise SourceError(f"{self.path}: {name} is targeted by config group {args.group_name} but "
                                      f"stored as float {name}.weight; the checkpoint is not compressed as its "
                                      f"config says: save it again with llm-compressor")

    def _read(self, module: str) -> dict[str, torch.Tensor]:
        return {part: self.tensor(name) for part, name in self.quantized[module].items() if part != "weight_shape"}


def _classes(module: torch.nn.Module) -> tuple[str, ...]:
    return tuple(c.__name__ for c in type(module).__mro__)


def open_checkpoint(path: str) -> CompressedCheckpoint:
    """Read `path`'s config.json (its quantization_config, read_plan) and its safetensors headers."""
    from safetensors import safe_open
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if not is_compressed_tensors(config):
        raise SourceError(f"{path}: config.json has no compressed-tensors quantization_config")
    plan = read_plan(config["quantization_config"], path)
    files: dict[str, str] = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), "pt") as f:
                files.update({k: os.path.join(path, fname) for k in f.keys()})
    if not files:
        raise SourceError(f"{path} has no *.safetensors weights; compressed-tensors checkpoints are safetensors")
    return CompressedCheckpoint(path, plan, files, _quantized_modules(files, path))


def _quantized_modules(names, path: str) -> dict[str, dict[str, str]]:
    """module -> {part: tensor name} for every module with a weight_scale; refuses the tensors of
    schemes this import does not keep (REFUSED)."""
    out: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if part in REFUSED:
            raise QuantizationError(f"{path}: tensor {name} is {REFUSED[part]}: not supported; {SUPPORTED}")
        if part == "weight_scale":
            out[module] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if module in out and (part in KEPT or part == "weight"):
            out[module][part] = name
    for module, parts in out.items():
        if "weight_packed" not in parts and "weight" not in parts:
            raise SourceError(f"{path}: {module} has a weight_scale but neither weight_packed nor weight; the "
                              f"checkpoint is incomplete: save it again with llm-compressor")
    return out


# -- the integers and scales in hloserve's layout ------------------------------------------------------
def convert(t: Mapping[str, torch.Tensor], args: WeightArgs, shape: tuple[int, int], where: str
            ) -> tuple[dict[str, np.ndarray], WeightScheme]:
    """One module's stored tensors (weight_packed or weight, weight_scale, weight_zero_point) ->
    (qweight, scale[, min] in hloserve's row-by-row layout, its scheme); integers as stored."""
    out_f, in_f = shape
    if args.bits == 4 and in_f % 2:
        raise QuantizationError(f"{where}: input dim {in_f} is odd; hloserve packs int4 two values a byte")
    g = args.group_size if args.strategy == "group" else in_f
    groups = -(-in_f // g)
    scale = _scales(t["weight_scale"], out_f, groups, where)                  # f32 [out, G]
    qweight = _integers(t, args, shape, where)                                 # uint8 [out, in/2] | int8 [out, in]
    stored = {"qweight": qweight, "scale": scale}
    if not args.symmetric:
        z = _zero_points(t.get("weight_zero_point"), args, out_f, groups, where)   # [out, G] in [-8, 7]
        stored["min"] = -((z + 8).astype(np.float32) * scale)
    group = args.group_size if args.strategy == "group" else (in_f if args.bits == 4 else None)
    if group is not None and in_f % group:
        stored, group = _even_groups(stored, group, in_f, where)
    if group is None:
        stored["scale"] = scale[:, 0]                                          # one per output row: [out]
    exact16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for r, a in stored.items() if r != "qweight")
    sdt = "f16" if exact16 else "f32"
    stored = {r: a if r == "qweight" else np.ascontiguousarray(a.astype(np.float16 if exact16 else np.float32))
              for r, a in stored.items()}
    return stored, WeightScheme(args.bits, group, args.symmetric, sdt)


def _even_groups(stored: dict[str, np.ndarray], group: int, in_f: int, where: str
                 ) -> tuple[dict[str, np.ndarray], int]:
    """A last group shorter than the others (input dim 576, group 128: older compressed-tensors wrote
    such ragged groups) -> groups of h = gcd(group, in) elements, each scale (and min) repeated for the
    group / h groups it covers: every element keeps its scale; hloserve's groups must be equal."""
    h = math.gcd(group, in_f)
    if h < 2 or h % 2:
        raise QuantizationError(f"{where}: input dim {in_f} is not a multiple of group_size {group}, and their "
                                f"common divisor {h} is no even group; hloserve needs equal even groups")
    return {r: a if r == "qweight" else np.repeat(a, group // h, axis=1)[:, :in_f // h]
            for r, a in stored.items()}, h


def _integers(t: Mapping[str, torch.Tensor], args: WeightArgs, shape: tuple[int, int], where: str) -> np.ndarray:
    """The integers in hloserve's layout: int4 packed uint8 [out, in / 2] (symmetric: signed nibbles,
    asymmetric: q + 8), int8 [out, in]."""
    out_f, in_f = shape
    if "weight_packed" in t:
        packed = t["weight_packed"]
        words = -(-in_f * args.bits // 32)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out_f, words):
            raise SourceError(f"{where}.weight_packed is {packed.dtype} {list(packed.shape)}; pack-quantized int"
                              f"{args.bits} of a [{out_f}, {in_f}] weight is int32 [{out_f}, {words}]")
        raw = packed.numpy().astype("<i4", copy=False).view(np.uint8)          # [out, 4 words]: elements in order
        if args.bits == 8:
            return np.ascontiguousarray((raw[:, :in_f] ^ 0x80).view(np.int8))
        nibbles = raw[:, :in_f // 2]
        return np.ascontiguousarray(nibbles ^ 0x88 if args.symmetric else nibbles)
    q = t["weight"]
    if q.dtype != torch.int8 or tuple(q.shape) != shape:
        raise SourceError(f"{where}.weight is {q.dtype} {list(q.shape)}; {args.format} stores int8 {list(shape)}")
    q = q.numpy()
    if args.bits == 8:
        return np.ascontiguousarray(q)
    if q.size and (q.min() < -8 or q.max() > 7):
        raise SourceError(f"{where}.weight holds values in [{q.min()}, {q.max()}], outside int4's [-8, 7]")
    return primitives.pack_int4(q if args.symmetric else q.astype(np.int16) + 8)


def _scales(s: torch.Tensor, out_f: int, groups: int, where: str) -> np.ndarray:
    """weight_scale -> f32 [out, G] (a per-tensor scale repeated on every row)."""
    if s.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantizationError(f"{where}.weight_scale is {s.dtype}: scales in float32, float16 or bfloat16 are "
                                f"supported (fp8 block scales are not); {SUPPORTED}")
    a = s.float().numpy()
    if a.size == 1 and groups == 1:
        a = np.full((out_f, 1), a.reshape(()), np.float32)
    if a.shape != (out_f, groups):
        raise SourceError(f"{where}.weight_scale has shape {list(s.shape)}; expected [{out_f}, {groups}]")
    if not np.isfinite(a).all():
        raise SourceError(f"{where}.weight_scale holds values that are not finite; the checkpoint is damaged")
    return a


def _zero_points(z: torch.Tensor | None, args: WeightArgs, out_f: int, groups: int, where: str) -> np.ndarray:
    """weight_zero_point -> int32 [out, G] in [-8, 7]: packed down the columns (int32
    [ceil(out / 8), G]), or as integers [out, G] (older checkpoints), or one per tensor."""
    if z is None:
        raise SourceError(f"{where}: asymmetric weights without weight_zero_point; the checkpoint is incomplete")
    words = -(-out_f * 4 // 32)
    if z.dtype == torch.int32 and tuple(z.shape) == (words, groups) and (words, groups) != (out_f, groups):
        raw = np.ascontiguousarray(z.numpy().astype("<i4", copy=False).T).view(np.uint8)   # [G, 4 words]
        v = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(groups, -1)[:, :out_f]       # [G, out] q + 8
        zp = v.T.astype(np.int32) - 8
    else:
        a = z.float().numpy()
        zp = np.full((out_f, 1), a.reshape(()), np.float32) if a.size == 1 and groups == 1 else a
        if zp.shape != (out_f, groups) or not np.array_equal(zp, np.round(zp)):
            raise SourceError(f"{where}.weight_zero_point is {z.dtype} {list(z.shape)}; expected integers [{out_f}, "
                              f"{groups}] or int32 packed [{words}, {groups}]")
        zp = zp.astype(np.int32)
    if zp.size and (zp.min() < -8 or zp.max() > 7):
        raise SourceError(f"{where}.weight_zero_point holds values in [{zp.min()}, {zp.max()}], outside int4's [-8, 7]")
    return zp


def _one_dtype_per_role(converted: dict[str, tuple[dict[str, np.ndarray], WeightScheme]]
                        ) -> dict[str, tuple[dict[str, np.ndarray], WeightScheme]]:
    """Where a role's layers (model.layers.*.self_attn.q_proj) share a scheme but not a scale dtype,
    every layer's scales widen to f32 (exactly), so the layers stack into one scanned tensor."""
    roles: dict[str, list[str]] = {}
    for name in converted:
        roles.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    out = dict(converted)
    for names in roles.values():
        schemes = {converted[n][1] for n in names}
        if len(schemes) > 1 and len({dataclasses.replace(s, scale_dtype="f32") for s in schemes}) == 1:
            for n in names:
                stored, scheme = converted[n]
                out[n] = ({r: a if r == "qweight" else a.astype(np.float32) for r, a in stored.items()},
                          dataclasses.replace(scheme, scale_dtype="f32"))
    return out
