"""hloserve's TPU and GPU kernels (Pallas) for the artifact's composites, as a kernel backend.

    backend = PallasBackend("tpu")                          # runtime/kernels/__init__.py's support()
    s = backend.specialize(exported)                        # at load: placeholders, s.per_shape below
    plans = pallas.plan(exported, "tpu")                    # which composite -> which kernel (inspect)
    static = pallas.for_shapes(pending, "tpu", avals)       # per compiled shape (s.per_shape)

A Pallas kernel is compiled for one static shape (its grid and tiles are Python integers), while the
artifact's step is symbolic in its tokens, sequences and blocks. So the substitution has two
halves. At load, `specialize` turns each composite a kernel serves into a placeholder custom call
(one target per composite, `PENDING`: the composite's attributes as its config, its result dims for
shape refinement) and every other composite into a call of its decomposition, as the CPU
`specialize` does. When the runtime compiles a shape, `for_shapes` exports the step at those static
shapes, refines every shape inside (jax's shape refinement; a placeholder inside the layer loop's
body too), lowers the Pallas kernel for each placeholder at its now static operand shapes and links
it in. The artifact stays portable: nothing of this is written.

What runs where (docs/deploy.md):
* `hloserve.paged_attention` (version 1, and version 2 with the window an operand, read by the
  kernels as data): TPU -> `pallas_tpu.ragged_paged_attention` (tpu.py), GPU (cuda) ->
  `pallas_triton.paged_attention` (gpu.py).
* `hloserve.quant_linear` version 2 (int8 per channel or grouped, int4 packed symmetric or
  asymmetric, rows interleaved by 16: what the exporter gives linear layers wherever their shape
  allows): TPU -> `pallas_tpu.quant_linear` (quant_tpu.py), GPU -> `pallas_triton.quant_linear`
  (quant_gpu.py); the weights are read where they lie in the stack at the layer and dequantized next
  to the dot (quant.py). Version 3 (GGUF K-quants: Q4_K, Q5_K, Q6_K): the same modules'
  `kquant_linear` (`pallas_tpu.kquant_linear`, `pallas_triton.kquant_linear`): the quants read in
  place, the layer's sub-block scales decoded in the graph. Version 4 (5-bit values, GGUF Q5_0
  kept): `five_linear` (`pallas_tpu.five_linear`, `pallas_triton.five_linear`): nibbles and
  fifth-bit masks read in place. Version 1 (rows one by one): the decomposition.
* `hloserve.layer_linear`: GPU (cuda) -> `pallas_triton.layer_linear` (linear_gpu.py) for
  decode-sized calls (up to 64 rows), reading the layer's tiles in place in the stack; above 64 rows
  that module runs XLA's dot (cuBLAS) on the sliced layer. XLA:GPU hands cuBLAS a copy of the
  layer's slice (an H200 step 6x its bandwidth floor, docs/performance.md, 2026-11-30), which the
  kernel avoids. Off by default until a GPU has compiled and timed it (it was written without one):
  `HLOSERVE_GPU_LAYER_LINEAR=1` turns it on. TPU: XLA's dot (the decomposition): the MXU takes the
  bf16 operands and accumulates in f32, which is the composite's contract.
* Over a mesh, or with HLOSERVE_PALLAS_KERNELS=0, every composite's decomposition.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any, Sequence

from hloserve.runtime.artifact.kernels import (COMPOSITES, LAYER_LINEAR, PAGED_ATTENTION, PAGED_ATTENTION_V2, QUANT_LINEAR,
                                               QUANT_LINEAR_V2, QUANT_LINEAR_V3, QUANT_LINEAR_V4, QUANT_LINEAR_V5,
                                               QUANT_LINEAR_V6, Holds)

from ... import _private
from ..backend import Specialized, WeightLayout
from ..rewrite import CompositeOp, attribute_value, composite_of, custom_call, decomposition_call, rewrite, swap
from . import quant
from .paged import PagedParams

ENV = "HLOSERVE_PALLAS_KERNELS"   # "0": the accelerators run every composite's decomposition
# composite name -> its placeholder custom call, replaced once shapes are static
PENDING = {PAGED_ATTENTION.name: "hloserve_pallas_paged_attention", QUANT_LINEAR.name: quant.PENDING,
           LAYER_LINEAR.name: "hloserve_pallas_layer_linear"}
LAYER_LINEAR_ENV = "HLOSERVE_GPU_LAYER_LINEAR"   # "1": GPUs run layer_linear's Triton kernel (default off)
# jax's platform names for lowering (a GPU device reports "gpu")
LOWERING = {"tpu": "tpu", "gpu": "cuda", "cuda": "cuda"}
# the composites a Pallas kernel runs (where the cache shape suits it: `choose`; GPUs: layer_linear opt-in)
SERVED = frozenset({PAGED_ATTENTION.key, PAGED_ATTENTION_V2.key, QUANT_LINEAR_V2.key, QUANT_LINEAR_V3.key,
                    QUANT_LINEAR_V4.key, QUANT_LINEAR_V5.key, QUANT_LINEAR_V6.key})
# what the layer_linear composite runs on a TPU, and why (see the module docstring)
XLA_DOT = "XLA's dot (the decomposition): the MXU takes the 16-bit operands with f32 sums, as the contract asks"
# the result dims of each placeholder for shape refinement ((operand, dim), None: static); default: x's
RESULT_DIMS = {QUANT_LINEAR.name: ((0, 0), None), LAYER_LINEAR.name: ((0, 0), None)}


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One composite of a function on one platform: the kernel that runs it (None: its
    decomposition), with the static parameters the kernel is built with, and why."""
    composite: str
    version: int
    platform: str
    kernel: str | None
    params: dict[str, Any]
    why: str

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        runs = f"{self.kernel}({params})" if self.kernel else "decomposition"
        return f"{self.composite} v{self.version} -> {runs}: {self.why}"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def linear_kernel_on() -> bool:
    """Whether GPUs run `hloserve.layer_linear` through linear_gpu.py's kernel (opt-in: unmeasured)."""
    return enabled() and os.environ.get(LAYER_LINEAR_ENV, "0") in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class PallasBackend:
    """The Pallas kernels of `platform` ("tpu" or "cuda"); with `interpret`, run in Pallas interpret
    mode on the device in use (the accelerator path, substitution included, checked on a CPU)."""
    platform: str
    interpret: bool = False
    composites: frozenset[tuple[str, int]] = SERVED

    def __post_init__(self):
        if self.composites is SERVED and LOWERING.get(self.platform) == "cuda" and linear_kernel_on():
            object.__setattr__(self, "composites", SERVED | {LAYER_LINEAR.key})

    @property
    def name(self) -> str:
        return f"pallas-{self.platform}"

    def runs(self, name: str, version: int) -> bool:
        return (name, version) in self.composites

    def layouts(self, exported: Any) -> dict[int, WeightLayout]:
        return {}                                 # every kernel reads the artifact's layouts

    def specialize(self, exported: Any, *, every_row_count: bool = False,
                   laid_out: frozenset[int] = frozenset()) -> Specialized:
        """Pallas kernels compile for static shapes: placeholders now, the kernels per compiled shape."""
        pending, plans = specialize(exported, self.platform)
        n = sum(p.kernel is not None for p in plans)
        if not n:
            return Specialized(pending)
        return Specialized(pending, n, functools.partial(for_shapes, pending, self.platform, interpret=self.interpret),
                           digest(self.platform, plans))


def _module(platform: str, composite: str = PAGED_ATTENTION.name):
    """The kernel module serving `composite` on `platform` (imported on use: each imports its Pallas
    lowering)."""
    tpu_side = LOWERING[platform] == "tpu"
    if composite == LAYER_LINEAR.name:
        if tpu_side:
            return None
        from . import linear_gpu
        return linear_gpu
    if composite == QUANT_LINEAR.name:
        if tpu_side:
            from . import quant_tpu
            return quant_tpu
        from . import quant_gpu
        return quant_gpu
    if tpu_side:
        from . import tpu
        return tpu
    from . import gpu
    return gpu


def digest(platform: str, plans: Sequence[KernelPlan] = ()) -> str:
    """Identifies the kernels' code for `platform` and which composites run them (`plans`: a switch
    such as HLOSERVE_GPU_LAYER_LINEAR=1 changes the function compiled): executable-cache keys."""
    import jax
    h = hashlib.sha256(jax.__version__.encode())
    h.update(repr(sorted({(p.composite, p.version, p.kernel) for p in plans}, key=repr)).encode())
    modules = [m.__name__.rsplit(".", 1)[1] + ".py" for m in map(functools.partial(_module, platform), PENDING) if m]
    for name in ("paged.py", "quant.py", *modules, "__init__.py"):
        with open(os.path.join(os.path.dirname(__file__), name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def choose(platform: str, name: str, version: int, attrs: dict[str, Any], kv_shape: Sequence[Any] = ()) -> KernelPlan:
    """The plan for one composite (name, version, attributes) on `platform`."""
    if platform not in LOWERING:
        raise ValueError(f"platform {platform!r} has no accelerator kernels; use one of tpu, cuda")
    contract = COMPOSITES.get((name, version))
    if contract is None:
        return KernelPlan(name, version, platform, None, {}, "no kernel knows this composite (version)")
    if name == LAYER_LINEAR.name:
        return _choose_linear(platform, version, attrs)
    if name == QUANT_LINEAR.name:
        return _choose_quant(platform, version, attrs)
    assert name == PAGED_ATTENTION.name
    params = dataclasses.asdict(PagedParams.from_attributes(attrs))
    if not enabled():
        return KernelPlan(name, version, platform, None, params, f"{ENV}=0")
    module = _module(platform)
    why = module.supports(*kv_shape[-2:]) if len(kv_shape) >= 2 else None
    if why:
        return KernelPlan(name, version, platform, None, params, why)
    return KernelPlan(name, version, platform, module.NAME, params,
                      "reads each sequence's blocks in place from the paged cache")


def _choose_linear(platform: str, version: int, attrs: dict[str, Any]) -> KernelPlan:
    """The plan for a layer_linear: the GPU's kernel (decode-sized calls), or XLA's dot."""
    name, params = LAYER_LINEAR.name, {"holds": int(attrs.get("holds", 1))}
    if LOWERING[platform] == "tpu":
        return KernelPlan(name, version, platform, None, {}, XLA_DOT)
    if not linear_kernel_on():
        return KernelPlan(name, version, platform, None, params,
                          f"XLA's dot: the Triton kernel is off until measured on a GPU ({LAYER_LINEAR_ENV}=1 turns it on)")
    module = _module(platform, name)
    return KernelPlan(name, version, platform, module.NAME, params,
                      f"reads the layer's tiles in place in the stack (calls of up to {module.MAX_ROWS} rows; "
                      "more: XLA's dot on the sliced layer)")


def _choose_quant(platform: str, version: int, attrs: dict[str, Any]) -> KernelPlan:
    """The plan for a quant_linear: version 2's, 3's, 4's or 5's kernel, or why its decomposition runs."""
    name = QUANT_LINEAR.name
    why = quant.why_not(version, attrs)
    if why:
        return KernelPlan(name, version, platform, None, {}, why)
    kquant = version in (QUANT_LINEAR_V3.version, QUANT_LINEAR_V5.version)
    params = dataclasses.asdict((quant.KQuantParams if kquant else quant.QuantParams).from_attributes(attrs))
    params.pop("bf16", None)   # a property of each compiled shape (version 6), not of the composite
    if not enabled():
        return KernelPlan(name, version, platform, None, params, f"{ENV}=0")
    module = _module(platform, name)
    if version == QUANT_LINEAR_V5.version:
        return KernelPlan(name, version, platform, module.NAME, params,
                          "version 2's kernel on the interleaved K-quant bytes, read in place; the layer's sub-block "
                          "scales decoded in the graph")
    if kquant:
        return KernelPlan(name, version, platform, module.KQUANT_NAME, params,
                          "reads the layer's K-quant bytes in place, its sub-block scales decoded in the graph, "
                          "and dequantizes them next to the dot")
    if version == QUANT_LINEAR_V4.version:
        return KernelPlan(name, version, platform, module.FIVE_NAME, params,
                          "reads the layer's 5-bit nibbles and fifth-bit masks in place and dequantizes them next "
                          "to the dot")
    chunks = (f"; from {attrs['bf16_rows']} rows x and the dequantized tiles rounded to bf16"
              if version == QUANT_LINEAR_V6.version else "")
    return KernelPlan(name, version, platform, module.NAME, params,
                      "reads the layer's int8 / int4 bytes in place and dequantizes them next to the dot" + chunks)


def _plan_of(api, info: CompositeOp, platform: str) -> KernelPlan:
    """The plan for one composite op read by `composite_of` (its cache's shape from its operands)."""
    kv = api.ir.RankedTensorType(info.operands[1].type).shape if info.name == PAGED_ATTENTION.name else ()
    return choose(platform, info.name, info.version, info.attributes, kv)


def plan(exported: Any, platform: str) -> list[KernelPlan]:
    """What each composite of `exported` runs on `platform` (reads the module, changes nothing)."""
    plans = []

    def look(op, api) -> bool:
        plans.append(_plan_of(api, composite_of(api, op), platform))
        return False

    _private.rewrite_composites(exported.mlir_module_serialized, look)
    return plans


def specialize(exported: Any, platform: str) -> tuple[Any, list[KernelPlan]]:
    """`exported` with each composite a kernel serves on `platform` as a `PENDING` placeholder and
    every other one a call of its decomposition. Returns (function, plans); the function must go
    through `for_shapes` before it compiles when any plan names a kernel."""
    plans = []

    def replace(op, api) -> bool:
        info = composite_of(api, op)
        p = _plan_of(api, info, platform)
        plans.append(p)
        with api.ir.InsertionPoint(op):
            if p.kernel is None:
                swap(op, decomposition_call(api, op))
            else:   # quant_linear's placeholders say their version (3 and 5 have the same attributes)
                config = info.config if info.name != QUANT_LINEAR.name else {
                    **info.config, "version": api.ir.IntegerAttr.get(api.ir.IntegerType.get_signless(64), info.version)}
                swap(op, custom_call(api, PENDING[info.name], [r.type for r in op.results], info.operands, config,
                                     RESULT_DIMS.get(info.name)))
        return True

    return rewrite(exported, replace)[0], plans


def for_shapes(pending: Any, platform: str, avals: Sequence[Any], *, interpret: bool = False) -> Any:
    """`pending` (from `specialize`) exported at the static `avals` for `platform` with its
    kernels linked in: an Exported whose `call` compiles for that platform. With `interpret`, the
    kernels run in Pallas interpret mode and the function is lowered for the platform in use
    (tests on CPU: the same substitution, the kernels as plain XLA)."""
    import jax
    from jax import export as jax_export

    lowering = jax.default_backend() if interpret else LOWERING[platform]
    lowering = LOWERING.get(lowering, lowering)
    static = jax_export.export(jax.jit(pending.call), platforms=(lowering,),
                               disabled_checks=[jax_export.DisabledSafetyCheck.custom_call(t) for t in PENDING.values()])(
                                   *avals)
    build = functools.partial(_build_kernel, platform=platform, lowering=lowering, interpret=interpret)
    body, _ = _private.link_kernels(static.mlir_module_serialized, set(PENDING.values()), build)
    return dataclasses.replace(static, mlir_module_serialized=body)


def _build_kernel(target: str, config: dict, operand_types: list, api, *, platform: str, lowering: str,
                  interpret: bool) -> bytes:
    """The serialized jax export of the kernel for one placeholder, at its static operand types."""
    import jax
    from jax import export as jax_export
    attrs = {k: attribute_value(api.ir, v) for k, v in config.items()}
    if target == PENDING[LAYER_LINEAR.name]:
        contract = LAYER_LINEAR
        holds = Holds(int(attrs.get("holds", Holds.BF16)))
        kernel = functools.partial(_module(platform, LAYER_LINEAR.name).layer_linear, dtype=holds.dtype_name,
                                   interpret=interpret)
    elif target == quant.PENDING and int(attrs.get("version", 0)) == QUANT_LINEAR_V5.version:   # interleaved K-quants
        contract = QUANT_LINEAR_V5
        kernel = functools.partial(_module(platform, QUANT_LINEAR.name).kquant16_linear,
                                   params=quant.KQuantParams.from_attributes(attrs), interpret=interpret)
    elif target == quant.PENDING and "kind" in attrs:    # version 3: K-quant blocks
        contract = QUANT_LINEAR_V3
        kernel = functools.partial(_module(platform, QUANT_LINEAR.name).kquant_linear,
                                   params=quant.KQuantParams.from_attributes(attrs), interpret=interpret)
    elif target == quant.PENDING and int(attrs["bits"]) == 5:   # version 4: 5-bit values (GGUF Q5_0)
        contract = QUANT_LINEAR_V4
        kernel = functools.partial(_module(platform, QUANT_LINEAR.name).five_linear,
                                   params=quant.QuantParams.from_attributes(attrs), interpret=interpret)
    elif target == quant.PENDING:   # versions 2 and 6 (6: at bf16_rows rows and more, x and W rounded to bf16)
        contract = QUANT_LINEAR_V2
        params = quant.QuantParams.from_attributes(attrs)
        if int(attrs.get("version", 0)) == QUANT_LINEAR_V6.version:
            rows = api.ir.RankedTensorType(operand_types[0]).shape[0]
            params = dataclasses.replace(params, bf16=rows >= int(attrs["bf16_rows"]))
        kernel = functools.partial(_module(platform, QUANT_LINEAR.name).quant_linear, params=params,
                                   interpret=interpret)
    else:
        params = PagedParams.from_attributes(attrs)
        # the placeholder's leading operands are the contract's (version 2's window the last), then any result shapes
        contract = PAGED_ATTENTION if params.window is not None else PAGED_ATTENTION_V2
        kernel = functools.partial(_module(platform).paged_attention, params=params, interpret=interpret)
    avals = [jax.ShapeDtypeStruct(tuple(api.ir.RankedTensorType(t).shape), _dtype(str(api.ir.RankedTensorType(t).element_type)))
             for t in operand_types[:len(contract.operands)]]
    checks = [jax_export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    # keep_unused: the call passes every operand (a symmetric quant_linear's empty min is unused)
    return jax_export.export(jax.jit(lambda *a: kernel(*a), keep_unused=True), platforms=(lowering,),
                             disabled_checks=checks)(
        *avals).mlir_module_serialized


_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i32": "int32", "i16": "int16",
           "i8": "int8", "ui8": "uint8", "i64": "int64"}


def _dtype(mlir_name: str):
    import jax.numpy as jnp
    return jnp.dtype(_DTYPES[mlir_name])


def kernels_in(exported: Any, *, sites: bool = True) -> dict[str, int]:
    """Custom-call targets a lowered function's main runs, with how many call sites each has (what
    `inspect --platform` names: tpu_custom_call for Mosaic, __gpu$xla.gpu.triton for Triton): a
    kernel function linked once for several composites (link_kernels) counts once per call of it;
    with `sites` False, once (the kernels compiled)."""
    import functools
    functions = _private.calls_by_function(exported.mlir_module_serialized)

    @functools.cache
    def counts(name: str) -> tuple[tuple[str, int], ...]:
        targets, callees = functions.get(name, ((), ()))
        total: dict[str, int] = {}
        for target in targets:
            if target != "shape_assertion":   # jax's shape checks, not a kernel
                total[target] = total.get(target, 0) + 1
        for callee in callees if sites else ():
            for target, n in counts(callee):
                total[target] = total.get(target, 0) + n
        return tuple(total.items())

    if sites:
        return dict(counts("main"))
    linked: dict[str, int] = {}
    for f in functions:
        for target, n in counts(f):
            linked[target] = linked.get(target, 0) + n
    return linked

