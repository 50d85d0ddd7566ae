"""Adapter slots of the LLM step (`hloserve export --lora-slots N --max-lora-rank R`): one artifact
serves any LoRA adapters of rank <= R on the targeted projections, several adapters in one batch.

    request = LoraRequest(slots=4, max_rank=16)            # targets: every linear of the decoder layers
    spec = request.resolve(model)                          # LoraSpec: names and (in, out) of the targets
    attach(model, spec)                                    # each target adds its slot's low-rank product

The adapters are not weights of the artifact: their A/B stacks are inputs of the step
(runtime/artifact/llm.py LoraSpec: `lora_a.T` [L, in, slots*R], `lora_b.T` [L, slots*R, out], every
slot's block side by side, and `lora_slots` int32[T]), so the server loads, replaces and drops
adapters by writing device arrays, with no re-export and no recompile. The product is added by a
forward hook on each targeted module (whatever the module became: a 16-bit LayerLinear, a quantized
linear), so the model's module tree, its weight names and the layer scan are untouched. A forward
pre-hook on each decoder layer records the step and the layer index the layer is called with
(hf_layers.ScannedLayers calls its body with the scan's iteration as `step.layer`).

Per token, with its slot s (0: no adapter):

    y += ((x @ A_all) * onehot_R(s)) @ B_all         A_all = [A_1^T | ... | A_n^T], B_all = [B_1^T*scale_1; ...]

two dense products over every slot's rank, no gather: at R = 16 and 4 slots on SmolLM2-135M the
A/B products add ~18% of a decoder layer's matmul work (docs/performance.md, "LoRA adapter slots").
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from hloserve.runtime.artifact.llm import LORA_SLOTS, LoraSpec

from ..errors import SourceError
from .attention import STEP_KWARG
from .hf_layers import decoder_layers

# what PEFT calls "all-linear" within a decoder layer (the LM head is never a target)
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraRequest:
    """--lora-slots, --max-lora-rank and --lora-targets as given (targets None: every nn.Linear of
    the decoder layers, by its name in the layer: q_proj, k_proj, ..., down_proj)."""
    slots: int
    max_rank: int
    targets: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.slots < 1 or self.max_rank < 1:
            raise SourceError(f"--lora-slots {self.slots} / --max-lora-rank {self.max_rank}: both must be at "
                              f"least 1 (e.g. --lora-slots 4 --max-lora-rank 16)")

    def resolve(self, model: torch.nn.Module) -> LoraSpec:
        """The LoraSpec of `model`'s decoder layers (run before any module swap: the targets are
        found as nn.Linear). SourceError when a target is missing or differs between layers."""
        found = decoder_layers(model)
        if found is None:
            raise SourceError(f"{type(model).__name__} has no list of decoder layers to put adapter slots on")
        layers = found[2]
        shapes = [_linears(layer) for layer in layers]
        names = self.targets if self.targets is not None else tuple(shapes[0])
        known = sorted(shapes[0])
        for t in names:
            if t not in shapes[0]:
                raise SourceError(f"--lora-targets {t}: the decoder layers of {type(model).__name__} have no linear "
                                  f"named {t}; they have {', '.join(known)}")
            if any(s.get(t) != shapes[0][t] for s in shapes):
                raise SourceError(f"--lora-targets {t}: its shape differs between decoder layers; leave it out")
        return LoraSpec(slots=self.slots, max_rank=self.max_rank, num_layers=len(layers),
                        targets={t: shapes[0][t] for t in names})


def _linears(layer: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """A decoder layer's nn.Linear modules by their own name (the last part of the path) -> (in, out);
    a name that occurs twice in one layer is left out (PEFT would match both)."""
    out: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    for path, m in layer.named_modules():
        if isinstance(m, torch.nn.Linear):
            name = path.rpartition(".")[2]
            if name in seen:
                out.pop(name, None)
                continue
            seen.add(name)
            out[name] = (int(m.in_features), int(m.out_features))
    return out


class _Hooks:
    """The step and layer index the current decoder layer runs with (set by its pre-hook), read by
    its targets' hooks."""

    def __init__(self, spec: LoraSpec):
        self.spec = spec
        self.step = None
        self.layer: torch.Tensor | None = None

    def enter(self, index: int, module, args, kwargs):
        step = kwargs.get(STEP_KWARG)
        if step is not None:
            self.step = step
            self.layer = step.layer if step.layer is not None else torch.tensor(index, dtype=torch.int32)
        return None

    def add(self, target: str, module, args, out):
        x = self.step.x
        R = self.spec.max_rank
        layer = self.layer.reshape(1).to(torch.int64)
        a = torch.index_select(x[f"lora_a.{target}"], 0, layer)[0]         # [in, W]
        b = torch.index_select(x[f"lora_b.{target}"], 0, layer)[0]         # [W, out]
        h = args[0].reshape(-1, a.shape[0]).float()                        # [T, in]
        slots = x[LORA_SLOTS].to(torch.int64)                              # [T]
        owner = torch.arange(a.shape[1], device=h.device) // R + 1         # [W]: the slot of each column
        xa = torch.where(slots[:, None] == owner[None, :], h @ a, 0.0)     # [T, W]: only the token's slot
        return out + (xa @ b).reshape(out.shape).to(out.dtype)             # [..., out]


def attach(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Hook every decoder layer and each of its targets (see the module docstring)."""
    hooks = _Hooks(spec)
    for i, layer in enumerate(decoder_layers(model)[2]):
        layer.register_forward_pre_hook(functools.partial(hooks.enter, i), with_kwargs=True)
        for path, m in layer.named_modules():
            name = path.rpartition(".")[2]
            if name in spec.targets:
                m.register_forward_hook(functools.partial(hooks.add, name))

