"""LoRA adapters in a step's adapter slots (runtime/artifact/llm.py LoraSpec): PEFT directories read
and written into the slot stacks the step takes as inputs, by name.

    table = AdapterTable(llm.lora)
    ref = table.load("sql", "/adapters/sql")      # PEFT: adapter_config.json + adapter_model.safetensors
    table.stacks()                                # {"lora_a.q_proj": f32[L, in, slots*R], ...}: the runner places them
    table.unload("sql")

A request names an adapter by its `model`; its SamplingParams carry the adapter's AdapterRef (slot,
and a key unique to this load, which salts the prefix cache's block hashes: the K/V of a prompt under
one adapter is not another's). Slot s (1-based) occupies columns (s-1)*R .. (s-1)*R+r-1 of each A
stack and the same rows of each B stack; a rank r < R leaves the rest zero, and B holds
B^T * scale (PEFT's lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora). Pure numpy: the
runner owns the device copies. A freed slot is reused last (least recently freed first), so a
request still running on an unloaded adapter keeps its slot's zeros (the base model) as long as
possible; unloading an adapter in use is the operator's call, as in vLLM.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading

import numpy as np
from hloserve.runtime.artifact.errors import ArtifactError
from hloserve.runtime.artifact.llm import LORA_SLOTS, LoraSpec
from hloserve.runtime.artifact.weights import Reader

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# a PEFT tensor name: ...layers.<i>.<path>.<target>.lora_<A|B>.weight (an adapter name may sit before .weight)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]*\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# PEFT config fields whose use this reader cannot serve, with why
_REFUSED = {"use_dora": "DoRA adapters (use_dora) scale the weight's norm, which slots do not hold",
            "modules_to_save": "modules_to_save replaces whole modules, which slots do not hold",
            "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
            "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter, what is wrong and the fix."""


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """What a request carries: its adapter's slot (1..slots) and the key of that load (the prefix
    cache's salt)."""
    slot: int
    key: str


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its name, directory, rank, scale and where it sits."""
    name: str
    path: str
    rank: int
    scale: float
    ref: AdapterRef


class AdapterTable:
    """Adapters by name in the slots of one LoraSpec, with the host stacks the step takes."""

    def __init__(self, spec: LoraSpec):
        self.spec = spec
        self._lock = threading.Lock()
        self._adapters: dict[str, Adapter] = {}
        self._free = list(range(1, spec.slots + 1))          # free slots, the next one to take first
        self._loads = 0
        self._stacks = {name: np.zeros(dims, np.float32) for name, (dims, _) in spec.inputs().items()
                        if name != LORA_SLOTS}

    def names(self) -> list[str]:
        return list(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def stacks(self) -> dict[str, np.ndarray]:
        """Every A and B stack (host arrays; a copy is placed on the device after each change)."""
        return dict(self._stacks)

    def load(self, name: str, path: str) -> Adapter:
        """Read the PEFT directory at `path` into a free slot under `name` (AdapterError, nothing
        changed, when it cannot be served)."""
        tensors, rank, scale = read_peft(name, path, self.spec)
        with self._lock:
            if name in self._adapters:
                raise AdapterError(f"adapter '{name}' is already loaded; unload it first or choose another name")
            if not self._free:
                raise AdapterError(f"adapter '{name}': all {self.spec.slots} adapter slots are in use "
                                   f"({', '.join(self._adapters)}); unload one, or export with more --lora-slots")
            slot = self._free.pop(0)
            self._loads += 1
            self._write(slot, tensors, rank, scale)
            adapter = Adapter(name, path, rank, scale, AdapterRef(slot, f"{name}#{self._loads}"))
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise AdapterError(f"adapter '{name}' is not loaded (loaded: {', '.join(self._adapters) or 'none'})")
            self._write(adapter.ref.slot, {}, 0, 0.0)
            self._free.append(adapter.ref.slot)
        return adapter

    def _write(self, slot: int, tensors: dict, rank: int, scale: float) -> None:
        """Slot `slot`'s columns of every A and rows of every B: the adapter's (zeros where it has none)."""
        R = self.spec.max_rank
        cols = slice((slot - 1) * R, slot * R)
        for target in self.spec.targets:
            a, b = self._stacks[f"lora_a.{target}"], self._stacks[f"lora_b.{target}"]
            a[:, :, cols] = 0.0
            b[:, cols, :] = 0.0
            for layer in range(self.spec.num_layers):
                pair = tensors.get((layer, target))
                if pair is not None:
                    a[layer, :, cols][:, :rank] = pair[0].T                 # [in, r]
                    b[layer, cols, :][:rank] = pair[1].T * scale            # [r, out]


def read_peft(name: str, path: str, spec: LoraSpec) -> tuple[dict, int, float]:
    """A PEFT LoRA directory checked against `spec`: ({(layer, target): (A [r, in], B [out, r])}, r,
    scale); AdapterError naming what is wrong."""
    where = f"adapter '{name}' ({path})"
    config = _read_config(where, path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{where}: {CONFIG} needs an integer r >= 1 and a number lora_alpha")
    if rank > spec.max_rank:
        raise AdapterError(f"{where}: rank {rank} is above the artifact's --max-lora-rank {spec.max_rank}; "
                           f"re-export with --max-lora-rank {rank} or more")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        hint = " (convert adapter_model.bin with PEFT's save_pretrained)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError(f"{where}: {WEIGHTS} is missing{hint}")
    try:
        reader = Reader(file)
    except ArtifactError:
        raise AdapterError(f"{where}: {WEIGHTS} is not a valid safetensors file") from None
    found: dict[tuple[int, str], list] = {}
    for key in reader.names():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A/B of a decoder layer's projection")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in spec.targets:
            raise AdapterError(f"{where}: it targets {target}, which this artifact has no adapter slots for "
                               f"(it has {', '.join(spec.targets)}); re-export with --lora-targets including {target}")
        if layer >= spec.num_layers:
            raise AdapterError(f"{where}: tensor {key} is for layer {layer}; the model has {spec.num_layers}")
        found.setdefault((layer, target), [None, None])["AB".index(which)] = np.asarray(reader[key], np.float32)
    return {k: _checked(where, k, pair, rank, spec) for k, pair in found.items()}, rank, scale


def _read_config(where: str, path: str) -> dict:
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{where}: {CONFIG} is missing; give a PEFT LoRA directory (save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: {CONFIG} cannot be read ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: {CONFIG} is not a LoRA adapter's (peft_type "
                           f"{config.get('peft_type') if isinstance(config, dict) else None})")
    for field, why in _REFUSED.items():
        if config.get(field):
            raise AdapterError(f"{where}: {why} cannot be served in adapter slots")
    return config


def _checked(where: str, key: tuple[int, str], pair: list, rank: int, spec: LoraSpec) -> tuple:
    """(A, B) of one projection with the shapes the slots need."""
    layer, target = key
    a, b = pair
    fan_in, fan_out = spec.targets[target]
    if a is None or b is None:
        raise AdapterError(f"{where}: layer {layer} {target} has lora_{'A' if a is None else 'B'} missing")
    if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
        raise AdapterError(f"{where}: layer {layer} {target} has A {list(a.shape)} and B {list(b.shape)}; this model "
                           f"needs [{rank}, {fan_in}] and [{fan_out}, {rank}] (an adapter of another base model?)")
    return a, b
