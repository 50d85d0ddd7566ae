"""The exporter's errors: they say what happened, where, and what to do.

The base class HloserveError (and ArtifactError, ShapeConstraintError) belong to the artifact format
(hloserve.runtime.artifact.errors) and are re-exported here for the exporter's modules.
"""
from __future__ import annotations

import dataclasses

from hloserve.runtime.artifact.errors import ArtifactError, HloserveError, ShapeConstraintError  # noqa: F401

ADDING_OPS_DOC = "docs/adding-ops.md"


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What we know about an FX node, for error messages."""
    name: str
    target: str
    location: str          # "model.py:42" or "<unknown>"
    in_shapes: str         # "f32[b,128], i32[]"

    def describe(self) -> str:
        return f"{self.target} at {self.location} (node %{self.name}, inputs {self.in_shapes or 'none'})"


class UnsupportedOpError(HloserveError):
    """One or more ops have no lowering. Lists all of them at once."""

    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes
        targets = sorted({n.target for n in nodes})
        lines = "; ".join(n.describe() for n in nodes)
        super().__init__(
            f"no lowering for {len(targets)} op(s) [{', '.join(targets)}]: {lines}. "
            f"Add a lowering with @lower(...) in the matching family module of "
            f"exporter/lowerings/ (see {ADDING_OPS_DOC})."
        )


class LoweringError(HloserveError):
    """A lowering exists but failed on this node."""

    def __init__(self, node: NodeInfo, cause: BaseException):
        self.node = node
        self.cause = cause
        super().__init__(
            f"lowering of {node.describe()} failed: {type(cause).__name__}: {cause}. "
            f"Fix the lowering in exporter/lowerings/ or change the model code at {node.location}."
        )


class ShapeSpecError(HloserveError):
    """A --dynamic spec or dynamic_shapes entry cannot be used."""


class SourceError(HloserveError):
    """A checkpoint source cannot be read."""


class CaptureError(HloserveError):
    """torch.export failed on the model."""
