"""torch.export + core-ATen decompositions -> ExportedProgram (no StableHLO here)."""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from .errors import CaptureError


def capture(module: torch.nn.Module, args: Sequence[Any], dynamic_shapes: Sequence[Any] | None = None,
            *, strict: bool = False) -> torch.export.ExportedProgram:
    """Export `module(*args)` and decompose it to core ATen.

    `dynamic_shapes` is aligned with `args`: per arg a dict {dim: Dim} or None.
    Buffer mutations stay in the program as BUFFER_MUTATION outputs.
    """
    module = module.eval()
    dyn = tuple(dynamic_shapes) if dynamic_shapes else None
    params = inspect.signature(module.forward).parameters.values()
    if dyn is not None and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        dyn = (dyn,)  # forward(*args): torch.export sees one tuple argument
    try:
        # an inference graph: with autograd off, a model's own no_grad/enable_grad blocks trace no
        # grad-mode regions (torch wraps those in set-grad subgraphs, which its passes then split)
        with torch.no_grad():
            ep = torch.export.export(module, tuple(args), dynamic_shapes=dyn, strict=strict)
    except Exception as e:  # noqa: BLE001 - torch's message is long; keep its first line and add the fix
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"torch.export could not capture {type(module).__name__}: {type(e).__name__}: {first}. "
            f"Check --dynamic ranges against the model's constraints, or export the model with "
            f"torch.export.export directly to see torch's full report."
        ) from e
    return decompose(ep)


def decompose(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Core-ATen decompositions, keeping ops we lower better whole."""
    table = torch.export.default_decompositions()
    # SDPA stays whole (lowered in lowerings/nn.py). Decomposing it re-traces the
    # math path, whose output strides differ from the fused kernel's that export
    # recorded; a later `.view` then fails at decomposition time (HF GPT-2's
    # Conv1D: "Cannot view a tensor with shape [s0, s1, 32] and strides ...").
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    ep = ep.run_decompositions(table)
    # Side-effecting ops (linalg error checks, prints) come wrapped in with_effects with token
    # inputs/outputs; a jax function orders nothing by tokens, so call the ops directly.
    if any(n.target is torch.ops.higher_order.with_effects for n in ep.graph.nodes):
        from torch.export._remove_effect_tokens_pass import _remove_effect_tokens
        ep = _remove_effect_tokens(ep)
    return ep
