"""Shape buckets: which concrete sizes a symbolic dim is compiled for, and padding to them.

XLA compiles static shapes, so every distinct size of a symbolic dim is a new
executable. For each dim the artifact declares paddable (FunctionSpec.paddable,
`hloserve export --pad batch`), calls are padded up to the smallest bucket that
holds them and outputs are sliced back; dims that are not paddable compile per
exact size, because padding them (a sequence without a mask) changes results.

Buckets are powers of two from the dim's minimum up to its maximum (the maximum
itself is always a bucket), or an explicit list per dim.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact.errors import HloserveError, ShapeConstraintError

# Above this, an unbounded dim gets no more default buckets (sizes up to the next power of two still bucket).
_DEFAULT_CAP = 1 << 16


class BucketError(HloserveError):
    """A bucket list is invalid for its dim."""


def powers_of_two(lo: int, hi: int | None) -> tuple[int, ...]:
    """lo, then every power of two in (lo, hi), then hi: (1, 2, 4, ..., 64); (3, 4, 8, 10) for [3, 10]."""
    top = hi if hi is not None else _DEFAULT_CAP
    out = [lo]
    p = 1
    while p <= lo:
        p *= 2
    while p < top:
        out.append(p)
        p *= 2
    if top > lo:
        out.append(top)
    return tuple(out)


def geometric(lo: int, hi: int, growth: int = 2) -> tuple[int, ...]:
    """lo, lo*growth, lo*growth**2, ... below hi, then hi: (1, 2, 4, 8, 12) for [1, 12]."""
    out, p = [], lo
    while p < hi:
        out.append(p)
        p *= growth
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Bucket sizes per paddable dim (sorted ascending); dims not listed compile per exact size.

    Attributes:
      sizes: dim name -> bucket sizes.
    """
    sizes: Mapping[str, tuple[int, ...]]

    @classmethod
    def build(cls, symbols: Mapping[str, artifact.SymbolSpec], paddable: Sequence[str],
              explicit: Mapping[str, Sequence[int]] | None = None) -> "Buckets":
        """Default power-of-two buckets for every paddable dim, overridden by `explicit` per dim.

        Explicit lists are checked against the dim's range; a list for a dim that
        is not paddable is an error (padding it would change results).
        """
        explicit = dict(explicit or {})
        sizes: dict[str, tuple[int, ...]] = {}
        for name in paddable:
            sym = symbols.get(name)
            if sym is None:
                continue
            sizes[name] = powers_of_two(sym.min, sym.max)
        for name, given in explicit.items():
            sym = symbols.get(name)
            if sym is None:
                raise BucketError(f"buckets given for {name!r}, which is not a dim of the artifact "
                                  f"(dims: {sorted(symbols)})")
            if name not in paddable:
                raise BucketError(f"buckets given for {name!r}, but the artifact does not declare it paddable "
                                  f"(paddable: {sorted(paddable) or 'none'}); padding it could change results. "
                                  f"Re-export with --pad {','.join([*paddable, name])} if padding is safe")
            vals = sorted({int(v) for v in given})
            if not vals:
                raise BucketError(f"bucket list for {name!r} is empty")
            bad = [v for v in vals if v < sym.min or (sym.max is not None and v > sym.max)]
            if bad:
                hi = "inf" if sym.max is None else sym.max
                raise BucketError(f"buckets {bad} for {name!r} are outside its range [{sym.min}, {hi}]")
            sizes[name] = tuple(vals)
        return cls(sizes)

    def bucket(self, name: str, value: int) -> int | None:
        """The smallest bucket of `name` holding `value`; `value` for unbucketed dims; None above the last bucket."""
        sizes = self.sizes.get(name)
        if not sizes:
            return value
        i = int(np.searchsorted(sizes, value))
        if i < len(sizes):
            return sizes[i]
        return None

    def plan(self, env: Mapping[str, int]) -> dict[str, int]:
        """Padded symbol values for concrete ones; values above the last bucket stay exact."""
        out = {}
        for name, value in env.items():
            b = self.bucket(name, value)
            out[name] = value if b is None else b
        return out


def pad_to(name: str, value: Any, target: tuple[int, ...]) -> Any:
    """Zero-pad `value` at the end of each dim up to `target` (numpy on the host; no compile)."""
    shape = tuple(np.shape(value))
    if shape == target:
        return value
    if any(t < s for s, t in zip(shape, target)):
        raise ShapeConstraintError(f"input {name!r} of shape {list(shape)} is larger than its bucket {list(target)}")
    arr = np.asarray(value)
    return np.pad(arr, [(0, t - s) for s, t in zip(shape, target)])


def slice_to(value: Any, target: tuple[int, ...]) -> Any:
    """`value`[:t0, :t1, ...] as a host view when padded, else `value` untouched (no compile)."""
    if tuple(value.shape) == target:
        return value
    host = np.asarray(value)
    return host[tuple(slice(0, t) for t in target)]
