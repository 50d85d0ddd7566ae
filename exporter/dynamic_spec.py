"""The CLI's --dynamic SPEC: parsed into torch.export Dims (its syntax checked without torch or jax,
so `hloserve export` refuses a typo before loading anything)."""
from __future__ import annotations

from typing import Any, Sequence

from .errors import ShapeSpecError


def parse_dynamic_spec(spec: str, input_names: Sequence[str] | None) -> dict[str, dict[int, Any]]:
    """Parse the CLI's --dynamic SPEC into torch.export Dims per input.

    Grammar (inputs separated by ';'):
        input_ids:0=batch[1,64],1=seq[1,512];attention_mask:0=batch,1=seq
        x:0=batch[1,32];y:0=2*batch
    A dim name may carry [min,max] once; later uses refer to the same Dim.
    `K*name`, `name+K`, `name-K` and `K*name+K` give derived dims.
    `input_names` None checks the syntax only (before the model is loaded; no torch) and
    returns {}.
    """
    import re

    check_only = input_names is None

    dims: dict[str, Any] = {}
    out: dict[str, dict[int, Any]] = {}
    if not spec.strip():
        return out
    pattern = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]\w*)(?:\[(\d+),(\d+|inf)\])?(?:([+-])(\d+))?$")
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, sep, dims_spec = entry.partition(":")
        if not sep:
            raise ShapeSpecError(f"--dynamic entry {entry!r} needs INPUT:DIM=NAME, e.g. input_ids:0=batch[1,64]")
        if not check_only and name not in input_names:
            raise ShapeSpecError(f"--dynamic names input {name!r}, but the model's inputs are {list(input_names)}")
        for item in re.split(r",(?![^\[]*\])", dims_spec):  # commas outside [min,max]
            if not item.strip():
                continue
            idx, eq, dname = item.partition("=")
            m = pattern.match(dname.strip()) if eq else None
            if not m or not idx.strip().isdigit():
                raise ShapeSpecError(
                    f"--dynamic item {item!r} of input {name!r} is not DIM=NAME[min,max] "
                    f"(e.g. 0=batch[1,64], 1=seq, 0=2*batch)"
                )
            scale, base, lo, hi, sign, offset = m.groups()
            if lo is not None and hi != "inf" and int(lo) > int(hi):
                raise ShapeSpecError(f"--dynamic range [{lo},{hi}] of {base!r} is empty (min > max)")
            if check_only:
                continue
            import torch
            if base not in dims:
                kwargs = {}
                if lo is not None:
                    kwargs["min"] = int(lo)
                    if hi != "inf":
                        kwargs["max"] = int(hi)
                dims[base] = torch.export.Dim(base, **kwargs)
            elif lo is not None:
                raise ShapeSpecError(f"--dynamic gives a range for {base!r} twice; give it once")
            dim = dims[base]
            if scale:
                dim = int(scale) * dim
            if offset:
                dim = dim + int(offset) if sign == "+" else dim - int(offset)
            out.setdefault(name, {})[int(idx)] = dim
    return out
