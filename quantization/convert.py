"""The generic module swap: float nn.Linear / nn.Embedding -> quantized storage + the custom ops.

    record = quantize_module(module, config)            # swapped in place
    q, scheme = quantize_tensor(w, scheme, "name")      # one weight -> stored tensors (qweight, scale[, min])

Every stored tensor is registered in a `QuantRecord` by its storage identity, so the exporter
can write each weight's scheme into the manifest (WeightSpec.quant) whatever name torch.export
gives it. This package knows no model: model-specific quantization (the stacked Llama weights,
GGUF blocks) lives next to the model in hloserve.exporter.llm and uses these pieces.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np
import torch

from . import primitives
from .modules import QuantizedEmbedding, QuantizedLinear
from .schemes import MIN_SUFFIX, SCALE_SUFFIX, QuantConfig, QuantizationError, WeightScheme

ROLE_SUFFIX = {"qweight": "", "scale": SCALE_SUFFIX, "min": MIN_SUFFIX}


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

    def add_stack(self, parts: list[torch.Tensor], stacked: torch.Tensor) -> None:
        """`stacked` is torch.stack(parts) (layers stacked for a scan): recorded as the parts' scheme
        and role over a leading layer dim, when the parts are quantized tensors."""
        found = self._by_id.get(_identity(parts[0]))
        if found is not None:
            scheme, role, shape = found
            self._by_id[_identity(stacked)] = (scheme, role, (len(parts), *shape))

    def update(self, other: "QuantRecord") -> None:
        self._by_id.update(other._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __call__(self, name: str, tensor: torch.Tensor) -> dict[str, Any] | None:
        found = self._by_id.get(_identity(tensor))
        if found is None:
            return None
        scheme, role, shape = found
        suffix = ROLE_SUFFIX[role]
        of = name[:-len(suffix)] if suffix and name.endswith(suffix) else name
        return scheme.manifest_entry(role, of, shape)


def to_torch(qa: primitives.QuantizedArray, rows: int = 0) -> dict[str, torch.Tensor]:
    """The stored tensors of `qa` (row by row) as torch tensors, interleaved if `rows` is nonzero."""
    tensors = {role: torch.from_numpy(np.ascontiguousarray(a)) for role, a in qa.tensors().items()}
    return interleaved(tensors, qa.scheme) if rows else tensors


def interleaved(tensors: Mapping[str, torch.Tensor], scheme: WeightScheme) -> dict[str, torch.Tensor]:
    """Stored tensors row by row (qweight [..., N, K | K/2], scale/min [..., N, G] or per channel
    [..., N]) -> interleaved by 16 rows (WeightScheme.rows; primitives.interleave_rows); a K-quant
    weight's quants only (its headers stay row by row)."""
    if scheme.block:   # K-quants: the quants interleaved, each row's headers where they are
        q, _, _ = primitives.interleave_rows(tensors["qweight"].numpy(), None, None, scheme.bits)
        return {"qweight": torch.from_numpy(q), "scale": tensors["scale"]}

    def grouped(role):
        a = tensors.get(role)
        return None if a is None else (a if scheme.group else a[..., None]).numpy()   # [..., N, G]
    q, scale, mn = primitives.interleave_rows(tensors["qweight"].numpy(), grouped("scale"), grouped("min"), scheme.bits)
    out = {"qweight": q, "scale": scale, **({} if mn is None else {"min": mn})}
    return {role: torch.from_numpy(a) for role, a in out.items()}


def quantize_tensor(w: torch.Tensor, scheme: WeightScheme, where: str, *, linear: bool = False,
                    ) -> tuple[dict[str, torch.Tensor], WeightScheme]:
    """(stored tensors, the scheme used: `scheme` fitted to w's input dim, see WeightScheme.fitted;
    with `linear`, a weight only linear layers read, interleaved where WeightScheme.for_linear says)."""
    scheme = scheme.fitted(w.shape[-1])
    qa = primitives.quantize(w.detach().float().cpu().numpy(), scheme, where=where)
    if linear:
        scheme = scheme.for_linear(tuple(w.shape))
    return to_torch(qa, scheme.rows), scheme


@dataclasses.dataclass(frozen=True)
class QuantRequest:
    """`--quantize` as a loader applies it: the config, the record the exporter reads the manifest's
    WeightSpec.quant from, and the weights the checkpoint already holds quantized (`stored(module)`:
    {module name: (stored tensors, scheme)}, a GGUF's own blocks, a compressed-tensors checkpoint's
    integers), used as they are. `only_stored`: the other modules stay float (a compressed-tensors
    checkpoint exported without --quantize), except, with `table`, an input embedding table an LM head
    is tied to (stored once in config.scheme, read by both). `experts(module)`: the experts modules'
    stored stacks a checkpoint holds (a GGUF's, exporter/gguf/quant.py stored_experts), for the
    exporter's experts swap (exporter/llm/hf_experts.py quantize_experts)."""
    config: QuantConfig
    record: QuantRecord = dataclasses.field(default_factory=lambda: QuantRecord())
    stored: Callable[[torch.nn.Module], Mapping[str, tuple[dict[str, torch.Tensor], WeightScheme]]] | None = None
    only_stored: bool = False
    table: bool = False
    experts: Callable[[torch.nn.Module], Mapping[str, Any]] | None = None

    def apply(self, module: torch.nn.Module) -> None:
        """The module swap on `module` (its real, unscanned layers)."""
        quantize_module(module, self.config, self.record, self.stored(module) if self.stored is not None else None,
                        only_given=self.only_stored, table=self.table)


# -- generic modules --------------------------------------------------------------
def quantize_module(module: torch.nn.Module, config: QuantConfig, record: QuantRecord | None = None,
                    given: Mapping[str, tuple[dict[str, torch.Tensor], WeightScheme]] | None = None, *,
                    only_given: bool = False, table: bool = False) -> QuantRecord:
    """Swap every nn.Linear / nn.Embedding of `module` (not matched by config.skip) in place.

    `given` maps module names to weights already stored (row by row) in a scheme, e.g. a GGUF file's
    own blocks (exporter/gguf/quant.py): those are used as they are, not requantized. With
    `only_given`, only those are swapped, and with `table` too the input embeddings and the linear
    layers tied to them (a compressed-tensors checkpoint's float table and its tied LM head).

    Module names are the dotted paths of named_modules() ("encoder.layer.0.attention.self.query").
    A weight whose input dim does not fit the scheme's group raises (skip it or pick a group).
    Modules sharing one weight share one quantized tensor: a head tied to an embedding reads the
    table's tensors, stored once, interleaved by 16 rows for the head's kernel where its shape allows
    (WeightScheme.for_linear); the embedding gathers its rows where they lie (primitives.gather_rows).
    """
    record = record if record is not None else QuantRecord()
    shared: dict[tuple, tuple[dict[str, torch.Tensor], WeightScheme]] = {}
    kept = [(n, m) for n, m in module.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and not config.skipped(n)]
    embedded = {_identity(m.weight) for n, m in kept if isinstance(m, torch.nn.Embedding)}
    tied = {_identity(m.weight) for n, m in kept if isinstance(m, torch.nn.Linear)} & embedded
    targets = [(n, m) for n, m in kept if not only_given or n in (given or {})
               or (table and _identity(m.weight) in tied)]
    for name, child in targets:
        w = child.weight
        key = _identity(w)
        if key not in shared:   # interleaved unless only embeddings read it
            shared[key] = _stored(w, name, config.scheme, (given or {}).get(name), linear=key not in embedded or key in tied)
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


def _stored(w: torch.Tensor, name: str, scheme: WeightScheme, given, *, linear: bool
            ) -> tuple[dict[str, torch.Tensor], WeightScheme]:
    """One weight's stored tensors and scheme: `given` (row by row) as it is, or `w` quantized; with
    `linear` (a linear layer reads it), interleaved where WeightScheme.for_linear says."""
    if given is None:
        return quantize_tensor(w, scheme, name, linear=linear)
    tensors, scheme = given
    rows = scheme.for_linear(tuple(w.shape))
    return (interleaved(tensors, rows), rows) if linear and rows.rows else given


def store(out: dict, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put a quantized weight's tensors into `out` under their stored names (name, name_scale, name_min)."""
    for role, t in tensors.items():
        out[name + ROLE_SUFFIX[role]] = t
