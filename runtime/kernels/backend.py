"""What a kernel backend is: the one face `runtime.load` calls, whatever the platform.

    backend = kernels.support("cpu", mesh=False)       # runtime/kernels/__init__.py picks it
    backend.runs("hloserve.paged_attention", 2)         # known before the artifact loads
    s = backend.specialize(exported)                    # at load, per function
    s.exported, s.kernels, s.per_shape, s.digest
    backend.layouts(exported)                           # {input: WeightLayout} its kernels could read
    s = backend.specialize(exported, laid_out={3})      # input 3 laid out so at load (runtime.load)

Backends: `Decompositions` (below: every composite runs the portable StableHLO the artifact
carries), the CPU's C++ kernels (runtime/kernels/cpu/) and the Pallas kernels of TPUs and GPUs
(runtime/kernels/pallas/). A backend never imports the face (tests/test_layers.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

from .rewrite import decomposition_call, rewrite, swap


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """A layout a backend's kernel reads a weight in, other than the artifact's: the same shape,
    dtype and values, the elements in another order. The runtime lays a weight out once at load,
    where every function loaded reads it only through such kernels (runtime.load).

    name: the layout's name (in the executable-cache key through the kernels' digest).
    arrange: the artifact's array -> a view whose C order is the layout, in any dtype (the runtime
      copies it once, then views the copy as the weight's dtype and shape).
    """
    name: str
    arrange: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Specialized:
    """One exported function with its composites resolved for a backend.

    exported: the function to compile (composites replaced by kernel calls or decomposition calls).
    kernels: how many composites run as kernels.
    per_shape: for backends whose kernels compile per static shape (Pallas), avals -> the function
      at those shapes with its kernels linked in; None otherwise.
    digest: identifies the kernels' code, and (CPU) which composites call them up to how many rows
      (part of the executable-cache key); None without kernels.
    """
    exported: Any
    kernels: int = 0
    per_shape: Callable[[Sequence[Any]], Any] | None = None
    digest: str | None = None


class KernelBackend(Protocol):
    """A platform's kernels for the artifact's composites."""
    name: str

    @property
    def composites(self) -> frozenset[tuple[str, int]]:
        """The (name, version) of every composite run as a kernel (the rest run their decomposition)."""

    def runs(self, name: str, version: int) -> bool: ...

    def layouts(self, exported: Any) -> dict[int, WeightLayout]:
        """The inputs of `exported` (indices into its in_avals) this backend's kernels would read in a
        layout of their own: only inputs that nothing but those kernels reads."""

    def specialize(self, exported: Any, *, every_row_count: bool = False,
                   laid_out: frozenset[int] = frozenset()) -> Specialized:
        """`exported` with its composites resolved; `every_row_count`: a kernel runs at every row count
        where it runs at all (a batch-invariant artifact: a row's bits must not depend on whether its
        step's rows went to the kernel or to the decomposition), not only where it is the faster;
        `laid_out`: inputs the runtime lays out as `layouts` offered them (their readers then run
        the kernels that read that layout, at every row count)."""


@dataclasses.dataclass(frozen=True)
class Decompositions:
    """No kernels: every composite is a call of its decomposition. Used over a mesh (XLA cannot
    partition a custom call, while the decomposition is partitioned with the rest), where kernels are
    turned off, and where they cannot be built.

    The decompositions are called, not left as composites, because jax 0.10's shape refinement
    does not enter a composite's decomposition: a composite over symbolic dims fails to compile
    ("operand ... has type tensor<6x...>, but decomposition has type tensor<?x...>")."""
    name: str = "decompositions"
    composites: frozenset[tuple[str, int]] = frozenset()

    def runs(self, name: str, version: int) -> bool:
        return False

    def layouts(self, exported: Any) -> dict[int, WeightLayout]:
        return {}

    def specialize(self, exported: Any, *, every_row_count: bool = False,
                   laid_out: frozenset[int] = frozenset()) -> Specialized:
        def replace(op, api) -> bool:
            with api.ir.InsertionPoint(op):
                swap(op, decomposition_call(api, op))
            return True
        return Specialized(rewrite(exported, replace)[0])
