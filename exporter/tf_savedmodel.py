"""Artifact -> TensorFlow SavedModel whose functions call the artifact's StableHLO through XlaCallModule.

    hloserve tf ART -o SAVEDMODEL [--function F] [--serving-default F]
                 [--xla-call-module-version N] [--platforms cpu,tpu] [--stablehlo-version V]
    info = to_savedmodel("art/", "savedmodel/")      # -> SavedModelInfo

What the SavedModel holds:
  - one tf.Variable per weight the functions use, in the weight's own dtype (int8/uint8/int32
    quantized storage stays integer), saved in the variables/ checkpoint shards, so there is no
    2 GB protobuf limit on the weights;
  - one signature per artifact function, keyed by the function's name, plus `serving_default`
    (the artifact's first function unless told otherwise). Inputs and outputs keep the artifact's
    names; symbolic dims are None; dtypes are the artifact's (int64 was narrowed to int32 at
    export, so integer inputs are int32);
  - each function is `tf.function(jit_compile=True)` around one XlaCallModule op whose `module`
    is the artifact's serialized StableHLO (functions/NAME.mlirbc; the jax_exported file gives
    the calling convention, platforms and the argument indices the module keeps).

Buffer and input mutations ("updated:NAME" outputs) are returned, never assigned back to the
variables, as in the runtime: the SavedModel's functions are pure.

XlaCallModule has only an XLA kernel: TensorFlow compiles it with XLA (on CPU too); TensorFlow
Serving needs `--xla_cpu_compilation_enabled=true` on CPU (see docs/deploy.md).

Version skew. The op's `version` attribute is the jax calling-convention version. TensorFlow
accepts versions up to `tfxla.call_module_maximum_supported_version()`; a module exported as 10
runs unchanged as 9 (10 only adds the Shardy partitioner flag), so by default the version is
min(module's, TensorFlow's). Versions below 9 are a different calling convention (tokens) and
are refused with what to upgrade. The StableHLO inside is a portable artifact with a target
version; `stablehlo_version` re-serializes it for an older consumer.

Nothing here imports torch; TensorFlow is imported only inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Mapping, Sequence

import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact import weights as weights_io

from .errors import HloserveError

SERVING_DEFAULT = "serving_default"
# jax's oldest calling convention; older XlaCallModule versions need effect tokens jax no longer emits
MIN_CALL_MODULE_VERSION = 9
# the version that added `use_shardy_partitioner`; modules without Shardy meshes run as 9 as well
SHARDY_CALL_MODULE_VERSION = 10
TF_INSTALL_HINT = "pip install 'hloserve[tf]' (tensorflow-cpu 2.21, XlaCallModule up to version 10)"


class SavedModelError(HloserveError):
    """The artifact cannot be converted to a SavedModel with the given options or this TensorFlow."""


@dataclasses.dataclass(frozen=True)
class SignatureInfo:
    """One signature of the written SavedModel.

    Attributes:
      key: the signature key ("serving_default", "forward", ...).
      function: the artifact function it calls.
      inputs: (name, TF dtype name, shape with None for symbolic dims) per input, in call order.
      outputs: the same for outputs.
    """
    key: str
    function: str
    inputs: tuple[tuple[str, str, tuple[int | None, ...]], ...]
    outputs: tuple[tuple[str, str, tuple[int | None, ...]], ...]


@dataclasses.dataclass(frozen=True)
class SavedModelInfo:
    """What `to_savedmodel` wrote.

    Attributes:
      path: the SavedModel directory.
      signatures: signature key -> SignatureInfo (serving_default first).
      call_module_version: the XlaCallModule `version` attribute used for every function.
      platforms: the XlaCallModule `platforms` attribute (upper case).
      platform_check: False when the platform check is disabled (the module may run on any platform).
      stablehlo_version: target version of the embedded StableHLO (the artifact's unless re-serialized).
      variables: number of tf.Variables (weights used by the exported functions).
      variable_bytes: their total size in bytes.
      tensorflow: the TensorFlow version that wrote it.
    """
    path: str
    signatures: Mapping[str, SignatureInfo]
    call_module_version: int
    platforms: tuple[str, ...]
    platform_check: bool
    stablehlo_version: str
    variables: int
    variable_bytes: int
    tensorflow: str


@dataclasses.dataclass(frozen=True)
class _CallPlan:
    """One artifact function, ready to become an XlaCallModule op (no TensorFlow needed to build it).

    Attributes:
      spec: the manifest's FunctionSpec.
      module: serialized StableHLO for the op's `module` attribute.
      module_version: the calling convention the module was exported with.
      platforms: the platforms the module was lowered for (lower case, jax's names).
      kept: indices into (weights..., inputs...) of the arguments the module takes (jax drops unused ones).
      out_shapes: per output, its shape with None for symbolic dims (the op's `Sout`).
      uses_shardy: the module carries Shardy meshes (needs XlaCallModule version >= 10).
      disabled_checks: jax safety checks disabled at export, as XlaCallModule spells them.
    """
    spec: artifact.FunctionSpec
    module: bytes
    module_version: int
    platforms: tuple[str, ...]
    kept: tuple[int, ...]
    out_shapes: tuple[tuple[int | None, ...], ...]
    uses_shardy: bool
    disabled_checks: tuple[str, ...]


def _static(shape: Sequence[int | str]) -> tuple[int | None, ...]:
    """Manifest shape -> TF shape: symbolic dims (names or expressions) become None."""
    return tuple(d if isinstance(d, int) else None for d in shape)


def plan_function(path: str, manifest: artifact.Manifest, name: str, *,
                  stablehlo_version: str | None = None) -> _CallPlan:
    """Read functions/NAME.{mlirbc,jax_exported} and check that XlaCallModule can run the module."""
    from jax import export as jax_export

    spec = manifest.functions[name]
    fdir = os.path.join(path, "functions")
    try:
        with open(os.path.join(fdir, f"{name}.jax_exported"), "rb") as f:
            exp = jax_export.deserialize(bytearray(f.read()))
        with open(os.path.join(fdir, f"{name}.mlirbc"), "rb") as f:
            module = f.read()
    except OSError as e:
        raise SavedModelError(f"artifact {path}: function {name!r}: {e}; re-export the artifact") from e
    if module != bytes(exp.mlir_module_serialized):
        raise SavedModelError(f"artifact {path}: functions/{name}.mlirbc differs from the module in "
                              f"functions/{name}.jax_exported (edited or mixed exports); re-export the artifact")
    if exp.nr_devices != 1:
        raise SavedModelError(f"function {name!r} was exported for {exp.nr_devices} devices; a SavedModel runs "
                              f"one device: re-export without a mesh")
    if exp.ordered_effects or exp.unordered_effects:
        raise SavedModelError(f"function {name!r} has effects {exp.ordered_effects + exp.unordered_effects} "
                              f"(callbacks, debug prints); XlaCallModule in a SavedModel cannot run them: "
                              f"remove them from the model and re-export")
    n_args = len(spec.weights) + len(spec.inputs)
    if len(exp.in_avals) != n_args or len(exp.out_avals) != len(spec.outputs):
        raise SavedModelError(f"artifact {path}: function {name!r} takes {len(exp.in_avals)} arguments and returns "
                              f"{len(exp.out_avals)} in its jax_exported file, but the manifest lists {n_args} and "
                              f"{len(spec.outputs)}; re-export the artifact")
    text = exp.mlir_module()
    if stablehlo_version is not None and stablehlo_version != spec.stablehlo_version:
        module = _reserialize(module, stablehlo_version, name)
    return _CallPlan(
        spec=spec, module=module, module_version=exp.calling_convention_version,
        platforms=tuple(exp.platforms), kept=tuple(exp.module_kept_var_idx),
        out_shapes=tuple(_static(t.shape) for t in spec.outputs),
        uses_shardy="sdy.mesh" in text,
        disabled_checks=tuple(str(c) for c in exp.disabled_safety_checks))


def _reserialize(module: bytes, target: str, name: str) -> bytes:
    """The same StableHLO as a portable artifact for an older consumer (target like "1.0.0")."""
    from ._private import stablehlo_dialect as hlo

    lo, hi = str(hlo.get_minimum_version()), str(hlo.get_current_version())
    try:
        plain = hlo.deserialize_portable_artifact_str(module)
        return bytes(hlo.serialize_portable_artifact_str(plain, target))
    except Exception as e:  # noqa: BLE001 - the MLIR bindings raise plain ValueError/RuntimeError
        raise SavedModelError(f"function {name!r}: cannot re-serialize its StableHLO for version {target!r} "
                              f"({type(e).__name__}: {e}); this jax writes StableHLO versions {lo} to {hi}, and "
                              f"ops newer than the target cannot be expressed in it") from e


def tf_max_call_module_version() -> int:
    """The newest XlaCallModule version the installed TensorFlow accepts."""
    tfxla = _tfxla()
    try:
        return int(tfxla.call_module_maximum_supported_version())
    except AttributeError:
        return 6  # TensorFlow before the query existed (2.13 and older) accepted at most 6


def choose_call_module_version(plans: Sequence[_CallPlan], tf_max: int, requested: int | None = None,
                               tf_version: str = "installed") -> int:
    """The XlaCallModule version for every function: `requested`, or min(module's, TensorFlow's).

    A module exported as version 10 runs as 9 unless it uses the Shardy partitioner. Anything
    that cannot work raises a SavedModelError that says what to change.
    """
    module_version = max(p.module_version for p in plans)
    shardy = [p.spec.name for p in plans if p.uses_shardy]
    floor = SHARDY_CALL_MODULE_VERSION if shardy else MIN_CALL_MODULE_VERSION
    version = requested if requested is not None else min(module_version, tf_max)
    if requested is not None and requested > tf_max:
        raise SavedModelError(
            f"XlaCallModule version {requested} was requested, but TensorFlow {tf_version} supports at most "
            f"{tf_max}; pass --xla-call-module-version {tf_max} (or leave it out), or upgrade: {TF_INSTALL_HINT}")
    if version < floor:
        why = (f"functions {shardy} use the Shardy partitioner (version >= {SHARDY_CALL_MODULE_VERSION})" if shardy
               else f"jax exports calling convention >= {MIN_CALL_MODULE_VERSION} only")
        if requested is not None and requested < floor and tf_max >= floor:
            fix = f"pass --xla-call-module-version {min(module_version, tf_max)} or leave it out"
        else:
            fix = f"upgrade TensorFlow: {TF_INSTALL_HINT}"
        raise SavedModelError(
            f"XlaCallModule version {version} cannot run this artifact (module version {module_version}; {why}; "
            f"TensorFlow {tf_version} accepts up to {tf_max}); {fix}")
    return version


def _tfxla():
    try:
        from tensorflow.compiler.tf2xla.python import xla as tfxla
    except ImportError as e:
        raise SavedModelError(f"TensorFlow is not installed ({e}); {TF_INSTALL_HINT}") from e
    return tfxla


def _call_platforms(plans: Sequence[_CallPlan], platforms: Sequence[str] | None) -> tuple[tuple[str, ...], bool]:
    """XlaCallModule `platforms` (the lowering platforms, upper case) and whether to check them.

    A module lowered for several platforms has a platform-index argument, so the attribute must
    list exactly those platforms in order. A single-platform module may run with the check off
    (`platforms=[]`, the "platform" disabled check), e.g. a CPU-lowered module on a GPU host.
    """
    lowered = plans[0].platforms
    for p in plans:
        if p.platforms != lowered:
            raise SavedModelError(f"functions {plans[0].spec.name!r} and {p.spec.name!r} were lowered for different "
                                  f"platforms ({','.join(lowered)} vs {','.join(p.platforms)}); re-export with one "
                                  f"--platforms list")
    upper = tuple(p.upper() for p in lowered)
    if platforms is None:
        return upper, True
    want = tuple(p.strip().lower() for p in platforms if p.strip())
    if not want:
        if len(lowered) > 1:
            raise SavedModelError(f"the platform check cannot be disabled for a module lowered for several "
                                  f"platforms ({','.join(lowered)}); pass --platforms {','.join(lowered)}")
        return upper, False   # XlaCallModule needs non-empty platforms; the check is a disabled_checks entry
    if want != lowered:
        raise SavedModelError(f"--platforms {','.join(want)}: the artifact's functions were lowered for "
                              f"{','.join(lowered)}, and XlaCallModule runs only those; re-export the artifact with "
                              f"`hloserve export ... --platforms {','.join(want)}` or pass --platforms "
                              f"{','.join(lowered)} ('none' disables the check for a single-platform module)")
    return upper, True


def _variable_name(weight: str) -> str:
    """Weight name -> a TF op name (letters, digits, '_', '.', '-', '/'; no leading '.')."""
    safe = "".join(c if c.isalnum() or c in "_.-/" else "_" for c in weight)
    return safe if safe[:1].isalnum() else "w_" + safe


def to_savedmodel(path: str, out_dir: str, *, functions: Sequence[str] | None = None,
                  serving_default: str | None = None, call_module_version: int | None = None,
                  platforms: Sequence[str] | None = None, stablehlo_version: str | None = None,
                  verify: bool = True) -> SavedModelInfo:
    """Write the artifact at `path` as a SavedModel at `out_dir` (replaced if it exists).

    Args:
      functions: artifact functions to export (default: all of them, each as its own signature).
      serving_default: the function behind `serving_default` (default: the first exported one).
      call_module_version: XlaCallModule `version` (default: min(module's, installed TensorFlow's)).
      platforms: XlaCallModule `platforms` (default: the artifact's lowering platforms; [] disables
        the platform check of a single-platform module).
      stablehlo_version: re-serialize the StableHLO for this older target (default: keep the artifact's).
      verify: check the artifact's file and weight sha256s first.
    """
    manifest = artifact.read_manifest(path)
    names = list(functions or manifest.functions)
    for n in names:
        if n not in manifest.functions:
            raise SavedModelError(f"artifact {path} has no function {n!r}; it has {sorted(manifest.functions)}")
    default = serving_default or names[0]
    if default not in names:
        raise SavedModelError(f"--serving-default {default!r} is not among the exported functions {names}")
    if SERVING_DEFAULT in names:
        raise SavedModelError(f"artifact function {SERVING_DEFAULT!r} would clash with the default signature key")
    if verify:
        artifact.verify_files(path, manifest)
    plans = {n: plan_function(path, manifest, n, stablehlo_version=stablehlo_version) for n in names}
    call_platforms, check_platform = _call_platforms(list(plans.values()), platforms)

    tf_max = tf_max_call_module_version()   # imports TensorFlow (seconds)
    import tensorflow as tf

    version = choose_call_module_version(list(plans.values()), tf_max, call_module_version, tf.__version__)
    reader = weights_io.Reader(os.path.join(path, artifact.WEIGHTS))
    if verify:
        artifact.verify_weights(path, manifest, reader)

    # one variable per weight some module keeps, shared by every function
    used: dict[str, None] = {}
    for p in plans.values():
        for i in p.kept:
            if i < len(p.spec.weights):
                used.setdefault(p.spec.weights[i])
    root = tf.Module()
    root.weights = [tf.Variable(np.asarray(reader[w]), trainable=False, name=_variable_name(w)) for w in used]
    variables = dict(zip(used, root.weights))

    signatures: dict[str, Any] = {}
    infos: dict[str, SignatureInfo] = {}
    for n in [default] + [m for m in names if m != default]:
        fn = _tf_function(tf, plans[n], variables, version, call_platforms, check_platform)
        setattr(root, n, fn)
        concrete = fn.get_concrete_function()
        spec = plans[n].spec
        info = SignatureInfo(
            key=n, function=n,
            inputs=tuple((t.name, tf.as_dtype(artifact.numpy_dtype(t.dtype)).name, _static(t.shape))
                         for t in spec.inputs),
            outputs=tuple((t.name, tf.as_dtype(artifact.numpy_dtype(t.dtype)).name, s)
                          for t, s in zip(spec.outputs, plans[n].out_shapes)))
        if n == default:
            signatures[SERVING_DEFAULT] = concrete
            infos[SERVING_DEFAULT] = dataclasses.replace(info, key=SERVING_DEFAULT)
        signatures[n] = concrete
        infos[n] = info

    if os.path.exists(out_dir):
        if not os.path.exists(os.path.join(out_dir, "saved_model.pb")):
            raise SavedModelError(f"{out_dir} exists and is not a SavedModel; choose another -o or remove it")
        shutil.rmtree(out_dir)
    tf.saved_model.save(root, out_dir, signatures=signatures)
    first = next(iter(plans.values()))
    return SavedModelInfo(
        path=out_dir, signatures=infos, call_module_version=version, platforms=call_platforms,
        platform_check=check_platform,
        stablehlo_version=stablehlo_version or first.spec.stablehlo_version, variables=len(variables),
        variable_bytes=sum(int(v.shape.num_elements()) * v.dtype.size for v in variables.values()),
        tensorflow=tf.__version__)


def _tf_function(tf, plan: _CallPlan, variables: Mapping[str, Any], version: int,
                 platforms: tuple[str, ...], check_platform: bool):
    """tf.function(jit_compile=True) of the artifact's inputs -> {output name: tensor}."""
    tfxla = _tfxla()
    spec = plan.spec
    in_sig = [tf.TensorSpec(_static(t.shape), tf.as_dtype(artifact.numpy_dtype(t.dtype)), name=t.name)
              for t in spec.inputs]
    tout = [tf.as_dtype(artifact.numpy_dtype(t.dtype)) for t in spec.outputs]
    attrs: dict[str, Any] = dict(version=version, module=plan.module, Tout=tout, Sout=list(plan.out_shapes),
                                 platforms=list(platforms), function_list=(), has_token_input_output=False,
                                 disabled_checks=list(plan.disabled_checks))
    if not check_platform and "platform" not in plan.disabled_checks:
        attrs["disabled_checks"].append("platform")   # jax's DisabledSafetyCheck.platform()
    if version >= SHARDY_CALL_MODULE_VERSION:
        attrs["use_shardy_partitioner"] = plan.uses_shardy
    weights = [variables.get(w) for w in spec.weights]

    def call(*inputs):
        args = weights + list(inputs)   # the module's argument order: weights, then inputs
        results = tfxla.call_module([args[i].read_value() if i < len(weights) else args[i] for i in plan.kept],
                                    **attrs)
        return {t.name: tf.identity(r, name=_variable_name(t.name)) for t, r in zip(spec.outputs, results)}

    call.__name__ = spec.name
    return tf.function(call, input_signature=in_sig, jit_compile=True, autograph=False)
