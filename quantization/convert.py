"""Module swap and GGUF block import: float modules -> quantized storage + the custom ops.

    record = quantize_module(module, config)            # nn.Linear / nn.Embedding swapped in place
    qw = quantize_llama(weights, config)                # stacked LlamaWeights -> QuantizedLlamaWeights
    qw = llama_from_gguf(cfg, ckpt, config)             # GGUF Q8_0/Q4_0/Q4_1 blocks kept as they are
    source = quantize_source(source, config)            # what `hloserve export --quantize` calls

Every stored tensor is registered in a `QuantRecord` by its storage identity, so the exporter
can write each weight's scheme into the manifest (WeightSpec.quant) whatever name torch.export
gives it. Stacked Llama weights stay stacked ([L, out, in] int8 or [L, out, in/2] packed int4,
scales [L, out, G]): the layer scan slices one layer of each per iteration and dequantizes
only that layer.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from . import primitives
from .modules import QuantizedEmbedding, QuantizedLinear
from .schemes import MIN_SUFFIX, SCALE_SUFFIX, QuantConfig, QuantizationError, WeightScheme

_ROLE_SUFFIX = {"qweight": "", "scale": SCALE_SUFFIX, "min": MIN_SUFFIX}


def _identity(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class QuantRecord:
    """Storage identity of each stored tensor -> (scheme, role, float shape).

    Called as `record(name, tensor)` by the exporter: returns the manifest's WeightSpec.quant for
    a quantized tensor (with "of", the float weight's artifact name) or None.
    """

    def __init__(self) -> None:
        self._by_id: dict[tuple, tuple[WeightScheme, str, tuple[int, ...]]] = {}

    def add(self, tensors: Mapping[str, torch.Tensor], scheme: WeightScheme, shape: tuple[int, ...]) -> None:
        for role, t in tensors.items():
            self._by_id[_identity(t)] = (scheme, role, tuple(shape))

    def update(self, other: "QuantRecord") -> None:
        self._by_id.update(other._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __call__(self, name: str, tensor: torch.Tensor) -> dict[str, Any] | None:
        found = self._by_id.get(_identity(tensor))
        if found is None:
            return None
        scheme, role, shape = found
        suffix = _ROLE_SUFFIX[role]
        of = name[:-len(suffix)] if suffix and name.endswith(suffix) else name
        return scheme.manifest_entry(role, of, shape)


def to_torch(qa: primitives.QuantizedArray) -> dict[str, torch.Tensor]:
    return {role: torch.from_numpy(np.ascontiguousarray(a)) for role, a in qa.tensors().items()}


def _quantize_tensor(w: torch.Tensor, scheme: WeightScheme, where: str) -> tuple[dict[str, torch.Tensor], WeightScheme]:
    """(stored tensors, the scheme used: `scheme` fitted to w's input dim, see WeightScheme.fitted)."""
    scheme = scheme.fitted(w.shape[-1])
    return to_torch(primitives.quantize(w.detach().float().cpu().numpy(), scheme, where=where)), scheme


# -- generic modules --------------------------------------------------------------
def quantize_module(module: torch.nn.Module, config: QuantConfig, record: QuantRecord | None = None) -> QuantRecord:
    """Swap every nn.Linear / nn.Embedding of `module` (not matched by config.skip) in place.

    Module names are the dotted paths of named_modules() ("encoder.layer.0.attention.self.query").
    A weight whose input dim does not fit the scheme's group raises (skip it or pick a group).
    Modules sharing one weight (tied embeddings) share one quantized tensor.
    """
    record = record if record is not None else QuantRecord()
    shared: dict[tuple, tuple[dict[str, torch.Tensor], WeightScheme]] = {}
    targets = [(n, m) for n, m in module.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    for name, child in targets:
        if config.skipped(name):
            continue
        w = child.weight
        key = _identity(w)
        if key not in shared:
            shared[key] = _quantize_tensor(w, config.scheme, name)
            record.add(shared[key][0], shared[key][1], tuple(w.shape))
        tensors, scheme = shared[key]
        if isinstance(child, torch.nn.Linear):
            new: torch.nn.Module = QuantizedLinear(child.in_features, child.out_features, scheme, tensors,
                                                   child.bias, w.dtype)
        else:
            if child.max_norm is not None:
                raise QuantizationError(f"{name}: Embedding(max_norm=...) renormalizes its weight; skip it "
                                        f"(--quantize-skip '{name}')")
            new = QuantizedEmbedding(child.num_embeddings, child.embedding_dim, scheme, tensors, w.dtype,
                                     child.padding_idx)
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
    return record


# -- the Llama step model (stacked weights) ----------------------------------------------
_MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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

    def linear(self, x: torch.Tensor, lw: Mapping[str, torch.Tensor], name: str, bias: torch.Tensor | None):
        if name not in self.schemes:
            return F.linear(x, lw[name], bias)
        s = self.schemes[name]
        return torch.ops.hloserve.quantized_linear(x, lw[name], lw[name + SCALE_SUFFIX], lw.get(name + MIN_SUFFIX),
                                                   bias, s.bits, s.group or 0)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        name = "embed_tokens" if self.lm_head is None else "lm_head"
        if name not in self.schemes:
            return F.linear(h, getattr(self, name))
        s = self.schemes[name]
        return torch.ops.hloserve.quantized_linear(h, getattr(self, name), getattr(self, name + SCALE_SUFFIX),
                                                   getattr(self, name + MIN_SUFFIX, None), None, s.bits, s.group or 0)


def _store(out: dict, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    for role, t in tensors.items():
        out[name + _ROLE_SUFFIX[role]] = t


def quantize_llama(weights, config: QuantConfig, record: QuantRecord | None = None) -> QuantizedLlamaWeights:
    """Requantize a float LlamaWeights (stacked) with config.scheme.

    Skip patterns match "embed_tokens", "lm_head" and "layers.NAME" (e.g. "layers.down_proj").
    """
    record = record if record is not None else QuantRecord()
    layers: dict[str, torch.Tensor] = {}
    schemes: dict[str, WeightScheme] = {}
    for n in weights.layer_names:
        t = weights.layers[n].detach()
        if n in _MATMULS and not config.skipped(f"layers.{n}"):
            q, scheme = _quantize_tensor(t, config.scheme, f"layers.{n}")
            record.add(q, scheme, tuple(t.shape))
            _store(layers, n, q)
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
        q, scheme = _quantize_tensor(t, config.scheme, n)
        record.add(q, scheme, tuple(t.shape))
        _store(globals_, n, q)
        schemes[n] = scheme
    return QuantizedLlamaWeights(weights.cfg, weights.dtype, layers, globals_, schemes, weights.rope_inv_freq)


# -- GGUF blocks, kept as they are ---------------------------------------------------------
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
    from hloserve.exporter.models.llama import _layer_layout, rope_inv_freq

    record = record if record is not None else QuantRecord()
    tensors = ckpt.tensors

    def native(names: list[str]) -> WeightScheme | None:
        kinds = {tensors[n].ggml_type for n in names}
        return GGUF_SCHEMES.get(kinds.pop()) if len(kinds) == 1 else None

    def dequantized(names: list[str]) -> torch.Tensor:
        return torch.cat([torch.from_numpy(tensors[n].dequantize()) for n in names], 0)

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
        if stacked not in _MATMULS or config.skipped(f"layers.{stacked}"):
            layers[stacked] = torch.stack([dequantized(names) for names in per_layer]).to(dtype)
            continue
        scheme = native(flat)
        if scheme is not None:
            blocks = [[gguf_blocks(tensors[n]) for n in names] for names in per_layer]
            q = {role: torch.from_numpy(np.stack([np.concatenate([b[role] for b in bl], 0) for bl in blocks]))
                 for role in blocks[0][0]}                               # [L, rows, ...] each
        else:
            q, scheme = _quantize_tensor(torch.stack([dequantized(names) for names in per_layer]), config.scheme,
                                         stacked)
        record.add(q, scheme, shape)
        _store(layers, stacked, q)
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
        if scheme is not None:
            q = {role: torch.from_numpy(a) for role, a in gguf_blocks(t).items()}
        else:
            q, scheme = _quantize_tensor(torch.from_numpy(t.dequantize()), config.scheme, n)
        record.add(q, scheme, tuple(t.shape))
        _store(globals_, n, q)
        schemes[n] = scheme
    return QuantizedLlamaWeights(cfg, dtype, layers, globals_, schemes, rope_inv_freq(cfg))


def gguf_weights_builder(config: QuantConfig, dtype: torch.dtype = torch.float32):
    """(build_weights for llama_source.from_gguf, the QuantRecord it fills): the file's own blocks."""
    record = QuantRecord()

    def build(cfg, ckpt):
        return llama_from_gguf(cfg, ckpt, config, record, dtype)

    return build, record


# -- sources ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Quantized:
    """What quantize_source did: the record for the manifest and a summary for the model metadata."""
    record: QuantRecord
    summary: dict[str, Any]


def quantize_source(source, config: QuantConfig):
    """Quantize a Source's modules in place (LlamaStep entries share one QuantizedLlamaWeights).

    Returns the source, with source.weight_quant set to the record and
    source.model["quantization"] describing the config.
    """
    from hloserve.exporter.models.llama import LlamaStep

    record = QuantRecord()
    done: dict[int, torch.nn.Module] = {}
    for e in source.entries:
        if e.module is None:
            raise QuantizationError(f"entry {e.name!r} is a pre-captured program (.pt2); --quantize needs the "
                                    f"model's modules: export from a HF directory, GGUF or module:factory")
        if isinstance(e.module, LlamaStep):
            w = e.module.model
            if id(w) not in done:
                done[id(w)] = w if isinstance(w, QuantizedLlamaWeights) else quantize_llama(w, config, record)
            e.module.model = done[id(w)]
        elif id(e.module) not in done:
            quantize_module(e.module, config, record)
            done[id(e.module)] = e.module
    if not len(record) and not any(isinstance(m, QuantizedLlamaWeights) for m in done.values()):
        raise QuantizationError(f"--quantize {config.spec}: no Linear or Embedding weight was quantized "
                                f"(skip patterns {list(config.skip)} matched all, or the model has none)")
    prev = getattr(source, "weight_quant", None)
    if isinstance(prev, QuantRecord):
        record.update(prev)
    source.weight_quant = record
    source.model["quantization"] = config.to_json()
    return source
