"""SPMD: a device mesh plus partition rules (regex on weight names -> PartitionSpec).

Weights are placed sharded across the mesh; user inputs are replicated. The
artifact's functions were exported for one device, so their StableHLO has no
sharding annotations: XLA's SPMD partitioner propagates the weights' shardings
through the program and inserts the collectives (all-reduce after a row split).

Megatron-style rules for an MLP `down(act(up(x)))` with torch Linear weights
stored [out, in]:

    rules = [(r"up\\.weight$", ("model", None)),   # column split: each device has out/4 rows
             (r"up\\.bias$", ("model",)),
             (r"down\\.weight$", (None, "model")),  # row split: partial sums, one all-reduce
             (r".*", ())]                           # everything else replicated

The first rule whose pattern `re.search`es the weight name wins; weights no rule
matches are replicated.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np
from hloserve.runtime.artifact.errors import HloserveError
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

Rules = Sequence[tuple[str, Any]]


class ShardingError(HloserveError):
    """A mesh or partition rule cannot be applied."""


def make_mesh(mesh: Any, devices: Sequence[Any]) -> Mesh:
    """A jax Mesh as is, or {axis: size} / [(axis, size), ...] laid over `devices` in order (-1: the rest)."""
    if isinstance(mesh, Mesh):
        return mesh
    items = list(mesh.items()) if isinstance(mesh, Mapping) else [tuple(x) for x in mesh]
    if not items:
        raise ShardingError("mesh has no axes; give e.g. {'model': 4}")
    sizes = [int(s) for _, s in items]
    known = int(np.prod([s for s in sizes if s != -1]))
    if sizes.count(-1) > 1 or known <= 0:
        raise ShardingError(f"mesh {dict(items)}: at most one axis may be -1 and sizes must be positive")
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(devices) // known
    need = int(np.prod(sizes))
    if need > len(devices) or need <= 0:
        raise ShardingError(f"mesh {dict(zip([a for a, _ in items], sizes))} needs {need} devices, "
                            f"but {len(devices)} are available; on CPU set "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax starts")
    return Mesh(np.array(devices[:need], dtype=object).reshape(sizes), tuple(a for a, _ in items))


def _spec(value: Any) -> PartitionSpec:
    if isinstance(value, PartitionSpec):
        return value
    if value is None:
        return PartitionSpec()
    return PartitionSpec(*value)


def spec_for(name: str, shape: Sequence[int], rules: Rules, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of weight `name` (shape `shape`) under `rules`, checked against the mesh."""
    for pattern, value in rules:
        try:
            hit = re.search(pattern, name)
        except re.error as e:
            raise ShardingError(f"partition rule {pattern!r} is not a valid regex: {e}") from None
        if not hit:
            continue
        spec = _spec(value)
        if len(spec) > len(shape):
            raise ShardingError(f"partition rule {pattern!r} gives {spec} (rank {len(spec)}) for weight {name!r} "
                                f"of shape {list(shape)} (rank {len(shape)}); fix the rule or make it more specific")
        for d, axes in enumerate(spec):
            if axes is None:
                continue
            axes = axes if isinstance(axes, tuple) else (axes,)
            for a in axes:
                if a not in mesh.shape:
                    raise ShardingError(f"partition rule {pattern!r} names mesh axis {a!r}; the mesh has "
                                        f"{dict(mesh.shape)}")
            n = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[d] % n:
                raise ShardingError(f"weight {name!r} dim {d} has size {shape[d]}, not divisible by {n} "
                                    f"devices of mesh axes {axes} (rule {pattern!r}); shard another dim or "
                                    f"replicate it")
        return spec
    return PartitionSpec()


def weight_shardings(weights: Mapping[str, Sequence[int]], rules: Rules | None, mesh: Mesh | None,
                     device: Any) -> dict[str, Any]:
    """name -> jax Sharding for every weight: SingleDeviceSharding without a mesh."""
    if mesh is None:
        if rules:
            raise ShardingError("partition_rules need a mesh; pass mesh={'model': N} as well")
        single = SingleDeviceSharding(device)
        return {n: single for n in weights}
    return {n: NamedSharding(mesh, spec_for(n, shape, rules or (), mesh)) for n, shape in weights.items()}


def place(value: Any, sharding: Any) -> Any:
    """jax.device_put of a host array, also when the sharding spans other processes' devices (a
    multi-host mesh): this process then places only the parts its own devices hold."""
    import jax
    if sharding.is_fully_addressable or isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(np.shape(value), sharding, lambda index: np.asarray(value[index]))


def input_sharding(mesh: Mesh | None, device: Any) -> Any:
    """User inputs are replicated over the mesh (or live on the one device)."""
    return SingleDeviceSharding(device) if mesh is None else NamedSharding(mesh, PartitionSpec())


def input_shardings(inputs: Sequence[Any], rules: Rules | None, mesh: Mesh | None) -> dict[str, Any]:
    """name -> NamedSharding for the function inputs (artifact TensorSpecs) a rule matches, e.g. a KV
    cache split by heads; the rest keep input_sharding. Symbolic dims are checked when called."""
    if not rules:
        return {}
    if mesh is None:
        raise ShardingError("input_rules need a mesh; pass mesh={'model': N} as well")
    out = {}
    for t in inputs:
        static = [d if isinstance(d, int) else 0 for d in t.shape]   # 0 divides by anything
        spec = spec_for(t.name, static, rules, mesh)
        if len(spec):
            out[t.name] = NamedSharding(mesh, spec)
    return out
