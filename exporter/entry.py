"""Source: what a checkpoint loader returns (entry points + manifest metadata + extra files).

Kept apart from exporter/sources.py (the loaders) so that model-specific loaders such as
models/hf_causal.py can build one without importing the dispatcher that imports them.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from .export import EntryPoint


@dataclasses.dataclass
class Source:
    """What a checkpoint exports to.

    Attributes:
      entries: entry points, each with default dynamic dims (overridable by --dynamic).
      model: manifest "model" metadata (task, tokenizer files, config).
      files: extra files of the artifact (tokenizer.json, ...), name -> the path copied or the bytes written.
      weight_quant: (artifact weight name, tensor) -> the manifest's WeightSpec.quant or None
        (the QuantRecord of --quantize's module swap).
    """
    description: str
    entries: list["EntryPoint"]
    model: dict = dataclasses.field(default_factory=dict)
    files: dict[str, str | bytes] = dataclasses.field(default_factory=dict)
    weight_quant: Callable[[str, "torch.Tensor"], Any] | None = None
