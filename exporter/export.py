"""Export entry points to an artifact directory.

Per entry point: capture (torch.export, core ATen) -> symbols (one jax scope)
-> interpreter (one lowering per node) -> jax.export -> .mlir / .mlirbc /
.jax_exported. Then every weight of every entry point is streamed once into
weights.safetensors and the manifest is written last (an artifact without a
manifest is incomplete by construction).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import threading
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import torch
from hloserve.runtime import artifact
from hloserve.runtime.artifact import weights as weights_io
from hloserve.runtime.paths import disk_full, partial_dir, remove_partials
from hloserve.runtime.progress import QUIET, Reporter
from jax import export as jax_export

from . import dtypes
from ._private import stablehlo_dialect
from .capture import capture
from .errors import HloserveError
from .interpreter import Interpreter
from .lowerings import default_registry
from .shapes import SymbolTable

DEFAULT_PLATFORMS = ("cpu",)
# An LLM step is lowered for every platform hloserve serves on: one artifact, a kernel per platform
# substituted at load (runtime/kernels/). jax lowers once and branches only where lowerings differ.
LLM_PLATFORMS = ("cpu", "cuda", "tpu")


def default_platforms(model: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The lowering platforms when none are given: LLM_PLATFORMS for an LLM step, else DEFAULT_PLATFORMS."""
    return LLM_PLATFORMS if model and model.get("llm") is not None else DEFAULT_PLATFORMS


@dataclasses.dataclass
class EntryPoint:
    """One function of the artifact.

    Give either `module` + `args` (captured here) or an ExportedProgram as `program`.
    Attributes:
      dynamic_shapes: aligned with args: per arg {dim: torch.export.Dim} or None.
      input_names / output_names: names in the manifest (default: forward's arg names; output_N).
      donated: input names the runtime may donate (updated in place, e.g. a KV cache).
      paddable: symbol names the runtime may pad to a bucket without changing results.
    """
    name: str
    module: torch.nn.Module | None = None
    args: Sequence[Any] = ()
    dynamic_shapes: Sequence[Any] | None = None
    program: torch.export.ExportedProgram | None = None
    input_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None
    donated: Sequence[str] = ()
    paddable: Sequence[str] = ()


@dataclasses.dataclass
class _Lowered:
    spec: artifact.FunctionSpec
    symbols: dict[str, artifact.SymbolSpec]
    weights: dict[str, torch.Tensor]
    constants: frozenset[str]


def stablehlo_target_version() -> str:
    """The StableHLO version jax.export serializes portable artifacts for."""
    return str(stablehlo_dialect.get_version_from_compatibility_requirement(
        stablehlo_dialect.StablehloCompatibilityRequirement.WEEK_4))


@dataclasses.dataclass(frozen=True)
class Traced:
    """One entry point lowered to a jax `Exported` in memory; nothing is written.

    Attributes:
      exported: the jax.export.Exported; call it as `exported.call(*weights, *inputs)`.
      symbols: the program's symbol table (one jax scope).
      weight_names: weight names in call order (they come first).
      weight_values: weight name -> torch tensor.
      inputs: (name, torch fake value) per user input, in call order after the weights.
      outputs: (name, torch fake value) per result, in result order.
      mutations: output name -> the buffer or input it updates.
      constants: the weights that are tensors the traced code made (torch.export's lifted
        constants), named after the entry point.
    """
    exported: jax_export.Exported
    symbols: SymbolTable
    weight_names: tuple[str, ...]
    weight_values: Mapping[str, torch.Tensor]
    inputs: tuple[tuple[str, Any], ...]
    outputs: tuple[tuple[str, Any], ...]
    mutations: Mapping[str, str]
    constants: frozenset[str] = frozenset()


def trace_entry(entry: EntryPoint, *, platforms: Sequence[str] = DEFAULT_PLATFORMS,
                reporter: Reporter = QUIET, batch_invariant: bool = False) -> Traced:
    """Capture (unless `entry.program` is given), interpret and jax.export one entry point
    (`batch_invariant`: the Interpreter's)."""
    ep = entry.program
    if ep is None:
        reporter.stage(f"{entry.name}: torch.export + core-ATen decompositions")
        ep = capture(entry.module, entry.args, entry.dynamic_shapes)
    symbols = SymbolTable.from_program(ep, entry.dynamic_shapes)
    interp = Interpreter(default_registry(), symbols, batch_invariant=batch_invariant)
    interp.check_supported(ep.graph_module)

    sig = ep.graph_signature
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    weight_names: list[str] = []
    weight_values: dict[str, torch.Tensor] = {}
    constants: set[str] = set()
    user: list[tuple[str, Any]] = []
    unused: set[str] = set()
    for node, spec in zip(placeholders, sig.input_specs):
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            if not node.users and not any(o.target == spec.target for o in sig.output_specs):
                unused.add(node.name)
                continue  # unused by this entry point (e.g. another head of the module): not an argument
            name = spec.target if kind != "CONSTANT_TENSOR" else f"{entry.name}.{spec.target}"
            value = ep.state_dict.get(spec.target)
            if value is None:
                value = ep.constants.get(spec.target)
            if not isinstance(value, torch.Tensor):
                raise HloserveError(f"{entry.name}: {kind.lower()} {spec.target!r} is not a tensor "
                                    f"({type(value).__name__}); script objects cannot be exported")
            weight_names.append(name)
            weight_values[name] = value
            if kind == "CONSTANT_TENSOR":
                constants.add(name)
        elif kind == "USER_INPUT":
            user.append((node.name, node.meta["val"]))
        else:
            raise HloserveError(f"{entry.name}: input kind {kind} ({spec.arg}) is not supported")
    input_names = list(entry.input_names or [n for n, _ in user])
    if len(input_names) != len(user):
        raise HloserveError(f"{entry.name}: {len(input_names)} input names for {len(user)} inputs")

    input_of_placeholder = {n: input_names[i] for i, (n, _) in enumerate(user)}
    outputs, mutations = _outputs(entry, ep, input_of_placeholder)

    def avals(fake):
        return jax.ShapeDtypeStruct(symbols.shape(fake), dtypes.jax_of_torch(fake.dtype))

    in_avals = [avals(weight_values[n]) for n in weight_names] + [avals(v) for _, v in user]

    def fn(*args):
        # re-insert None for weights this entry point does not use
        it = iter(args)
        full = [None if n.name in unused else next(it) for n in placeholders]
        return tuple(interp.run(ep.graph_module, full))

    reporter.stage(f"{entry.name}: lowering {sum(1 for n in ep.graph.nodes if n.op == 'call_function')} ops "
                   f"to StableHLO (platforms: {', '.join(platforms)})")
    exp = jax_export.export(jax.jit(fn), platforms=tuple(platforms))(*in_avals)
    return Traced(exp, symbols, tuple(weight_names), weight_values,
                  tuple((n, v) for n, (_, v) in zip(input_names, user)), tuple(outputs), mutations,
                  frozenset(constants))


def _outputs(entry: EntryPoint, ep: Any, input_of_placeholder: Mapping[str, str]
             ) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """The entry point's outputs (name, fake value) in the program's order, and the mutations among
    them (output name -> the buffer or input it updates: `updated:<name>`)."""
    sig = ep.graph_signature
    outputs: list[tuple[str, Any]] = []
    mutations: dict[str, str] = {}
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    user_outs = [o for o in sig.output_specs if o.kind.name == "USER_OUTPUT"]
    out_names = list(entry.output_names or [f"output_{i}" if len(user_outs) > 1 else "output" for i in range(len(user_outs))])
    k = 0
    for o, val_node in zip(sig.output_specs, out_node.args[0]):
        val = val_node.meta["val"] if isinstance(val_node, torch.fx.Node) else val_node
        kind = o.kind.name
        if kind == "USER_OUTPUT":
            outputs.append((out_names[k], val))
            k += 1
        elif kind == "BUFFER_MUTATION":
            outputs.append((f"updated:{o.target}", val))
            mutations[f"updated:{o.target}"] = o.target
        elif kind == "USER_INPUT_MUTATION":
            target = input_of_placeholder.get(o.target, o.target)
            outputs.append((f"updated:{target}", val))
            mutations[f"updated:{target}"] = target
        else:
            raise HloserveError(f"{entry.name}: output kind {kind} is not supported")
    return outputs, mutations


def lower_entry(entry: EntryPoint, out_dir: str, *, platforms: Sequence[str] = DEFAULT_PLATFORMS,
                reporter: Reporter = QUIET, batch_invariant: bool = False) -> _Lowered:
    traced = trace_entry(entry, platforms=platforms, reporter=reporter, batch_invariant=batch_invariant)
    exp, symbols, input_names = traced.exported, traced.symbols, [n for n, _ in traced.inputs]
    fdir = os.path.join(out_dir, "functions")
    os.makedirs(fdir, exist_ok=True)
    files = {
        f"{entry.name}.mlir": exp.mlir_module().encode(),
        f"{entry.name}.mlirbc": bytes(exp.mlir_module_serialized),
        f"{entry.name}.jax_exported": bytes(exp.serialize()),
    }
    digests = {}
    for fname, data in files.items():
        with open(os.path.join(fdir, fname), "wb") as f:
            f.write(data)
        digests[fname] = artifact.file_digest(os.path.join(fdir, fname))

    def tspec(name, fake):
        return artifact.TensorSpec(name, dtypes.artifact_name_of_torch(fake.dtype), tuple(symbols.shape_strings(fake)))

    for d in entry.donated:
        if d not in input_names:
            raise HloserveError(f"{entry.name}: donated input {d!r} is not an input ({input_names})")
    for s in entry.paddable:
        if s not in symbols.symbols:
            raise HloserveError(f"{entry.name}: paddable dim {s!r} is not a symbolic dim ({sorted(symbols.symbols)})")
    spec = artifact.FunctionSpec(
        name=entry.name, weights=traced.weight_names,
        inputs=tuple(tspec(n, v) for n, v in traced.inputs),
        outputs=tuple(tspec(n, v) for n, v in traced.outputs), mutations=dict(traced.mutations),
        donated=tuple(entry.donated), paddable=tuple(entry.paddable), files=digests,
        stablehlo_version=stablehlo_target_version(), platforms=tuple(platforms))
    syms = {s.name: artifact.SymbolSpec(s.name, s.min, s.max) for s in symbols.symbols.values()}
    return _Lowered(spec, syms, dict(traced.weight_values), traced.constants)


_SMALL_CONSTANT = 1 << 16   # elements: a lifted constant up to this size is identified by its value


def _identity(t: torch.Tensor, constant: bool = False) -> tuple:
    """Two names with the same identity are one tensor (tied weights, shared submodules). A small
    constant the traced code made is identified by its value: each entry point's trace makes its
    own copy (a scanned step's per-layer index rows), which is stored once."""
    if constant and t.numel() <= _SMALL_CONSTANT:
        raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
        return ("value", t.dtype, tuple(t.shape), raw.numpy().tobytes())
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch tensor -> numpy in the artifact's dtype (64-bit narrowed, bf16 via ml_dtypes)."""
    t = t.detach().cpu().contiguous()
    want = dtypes.jax_of_torch(t.dtype)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(want)
    arr = t.numpy()
    return arr.astype(want) if arr.dtype != want else arr


def export_artifact(out_dir: str, entries: Sequence[EntryPoint], *, source: str, model: Mapping[str, Any] | None = None,
                    platforms: Sequence[str] | None = None, reporter: Reporter = QUIET,
                    extra_weights: Mapping[str, np.ndarray] | None = None,
                    files: Mapping[str, str | bytes] | None = None,
                    weight_quant: Callable[[str, torch.Tensor], Mapping[str, Any] | None] | None = None,
                    batch_invariant: bool = False) -> artifact.Manifest:
    """Lower every entry point and write the artifact directory `out_dir`.

    `weight_quant(name, tensor)` gives a weight's quantization scheme for the manifest
    (WeightSpec.quant; quantization.convert.QuantRecord), None for plain weights.

    `files` (name -> a path, copied, or bytes, written) are the artifact's extra files
    (tokenizer.json, ...), listed with their sha256 in manifest.model["files"].

    The artifact is written into `out_dir.partial-PID` and renamed into place when complete
    (replacing an artifact already there), so an export killed at any point leaves no half-written
    artifact at `out_dir`; the next export removes what a dead one left. A disk that fills up on the
    way ends it the same way, as one HloserveError naming the disk.

    `platforms`: the lowering platforms (default: `default_platforms(model)`, cpu, cuda and tpu for
    an LLM step). `batch_invariant`: `hloserve export --batch-invariant` (the Interpreter's), recorded
    as the manifest's `model.batch_invariant: true`.
    """
    platforms = tuple(platforms) if platforms is not None else default_platforms(model)
    final = out_dir
    if os.path.isdir(final) and os.listdir(final) and not os.path.exists(os.path.join(final, artifact.MANIFEST)):
        raise HloserveError(f"{final} is a non-empty directory that is not an artifact; choose a new directory "
                            f"(an existing artifact is overwritten)")
    remove_partials(final)
    out_dir = partial_dir(final)    # written here, renamed into place when complete
    try:
        os.makedirs(out_dir)
        manifest = _write_artifact(out_dir, entries, source=source, model=model, platforms=platforms,
                                   reporter=reporter, extra_weights=extra_weights, files=files,
                                   weight_quant=weight_quant, batch_invariant=batch_invariant)
    except BaseException as e:
        shutil.rmtree(out_dir, ignore_errors=True)
        if disk_full(e):
            raise HloserveError(f"{final}: the disk is full ({e.strerror}); nothing was written there: free space "
                                f"or export to a disk with room") from None
        raise
    if os.path.isdir(final):                # an artifact (replaced) or an empty directory
        shutil.rmtree(final)
    os.replace(out_dir, final)
    reporter.stage(f"artifact written to {final}")
    return manifest


def _model_json(model: Mapping[str, Any], stored: Mapping[str, Any]) -> dict:
    """The manifest's `model` metadata, its typed specs (typed until here) written as JSON: an LLM
    step's contract, its tensor-parallel split naming only weights the artifact stores (the spec is
    made from the model's modules, which name a tied table twice, embedding and head; the writer keeps
    one), and the text spec."""
    out = dict(model)
    llm, text = out.get("llm"), out.get("text")
    if isinstance(llm, artifact.LLMSpec):
        tp = llm.tensor_parallel
        if tp is not None and not set(tp.weights) <= set(stored):
            tp = dataclasses.replace(tp, weights={n: d for n, d in tp.weights.items() if n in stored})
            llm = dataclasses.replace(llm, tensor_parallel=tp)
        out["llm"] = llm.to_json()
    if isinstance(text, artifact.TextSpec):
        out["text"] = text.to_json()
    return out


def _write_artifact(out_dir: str, entries: Sequence[EntryPoint], *, source: str, model: Mapping[str, Any] | None,
                    platforms: Sequence[str], reporter: Reporter, extra_weights: Mapping[str, np.ndarray] | None,
                    files: Mapping[str, str | bytes] | None,
                    weight_quant: Callable[[str, torch.Tensor], Mapping[str, Any] | None] | None,
                    batch_invariant: bool = False) -> artifact.Manifest:
    functions: dict[str, artifact.FunctionSpec] = {}
    symbols: dict[str, artifact.SymbolSpec] = {}
    tensors: dict[str, torch.Tensor] = {}
    canonical: dict[tuple, str] = {}   # storage identity -> the first name seen (tied weights stored once)
    path = os.path.join(out_dir, artifact.WEIGHTS)
    early: _BackgroundWeights | None = None
    try:
        for i, entry in enumerate(entries):
            if entry.name in functions:
                raise HloserveError(f"two entry points are named {entry.name!r}; names must be unique")
            lowered = lower_entry(entry, out_dir, platforms=platforms, reporter=reporter,
                                  batch_invariant=batch_invariant)
            rename = {}
            for name, t in lowered.weights.items():
                rename[name] = canonical.setdefault(_identity(t, name in lowered.constants), name)
            functions[entry.name] = dataclasses.replace(lowered.spec, weights=tuple(rename[n] for n in lowered.spec.weights))
            for name, sym in lowered.symbols.items():
                if name in symbols and symbols[name] != sym:
                    raise HloserveError(f"dim {name!r} has range [{sym.min}, {sym.max}] in {entry.name!r} but "
                                        f"[{symbols[name].min}, {symbols[name].max}] elsewhere; give one range per name")
                symbols[name] = sym
            for name, t in lowered.weights.items():
                name = rename[name]
                if name in tensors and tensors[name] is not t and not (
                        tensors[name].shape == t.shape and tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)):
                    raise HloserveError(f"weight {name!r} differs between entry points; shared weights must be identical")
                tensors.setdefault(name, t)
            if i == 0 and len(entries) > 1:
                # the entry points of one model share its weights (an LLM step's prefill and decode):
                # they are written while the others are lowered (the write is I/O and hashing, which
                # release the GIL; lowering is Python)
                early = _BackgroundWeights(path, _weight_arrays(tensors, extra_weights), reporter)
        if early is not None and list(early.arrays) == [*tensors, *(extra_weights or {})]:
            arrays, digests = early.arrays, early.finish(reporter)
        else:
            if early is not None:      # a later entry point reads weights the first does not: all written again
                early.cancel()
                early = None
            arrays = _weight_arrays(tensors, extra_weights)
            digests = _write_weights(path, arrays, reporter)
    except BaseException:
        if early is not None:
            early.cancel()
        raise
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "unknown"

    specs = _specs(arrays)
    model = _model_json(model or {}, specs)
    if batch_invariant:   # what the artifact's steps were lowered as, recorded where they are lowered
        model["batch_invariant"] = True
    if files:
        for name, content in files.items():
            if isinstance(content, bytes):
                with open(os.path.join(out_dir, name), "wb") as f:
                    f.write(content)
            else:
                shutil.copy(content, os.path.join(out_dir, name))
        model["files"] = {name: artifact.file_digest(os.path.join(out_dir, name)) for name in files}
    manifest = artifact.Manifest(
        format_version=artifact.FORMAT_VERSION,
        producer={"hloserve": version("hloserve"), "torch": torch.__version__, "jax": jax.__version__},
        source=source, functions=functions,
        weights={n: artifact.WeightSpec(n, d, s, digests[n], weight_quant(n, tensors[n])
                                        if weight_quant is not None and n in tensors else None)
                 for n, (d, s) in specs.items()},
        symbols=symbols, model=model)
    artifact.write_manifest(out_dir, manifest)
    return manifest


def _weight_arrays(tensors: Mapping[str, torch.Tensor], extra: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Every weight as the numpy array the artifact stores (views where the dtype allows), in file order."""
    return {**{n: to_numpy(t) for n, t in tensors.items()}, **(extra or {})}


def _specs(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (dtypes.name_of_numpy(a.dtype), tuple(a.shape)) for n, a in arrays.items()}


def _weights_message(arrays: Mapping[str, np.ndarray]) -> str:
    return f"{len(arrays)} weights ({sum(a.nbytes for a in arrays.values()) / 2**20:.1f} MiB) to {artifact.WEIGHTS}"


def _write_weights(path: str, arrays: Mapping[str, np.ndarray], reporter: Reporter) -> dict[str, str]:
    reporter.stage(f"writing {_weights_message(arrays)}")
    with reporter.bar(sum(a.nbytes for a in arrays.values()), "weights") as advance:
        return weights_io.write(path, _specs(arrays), arrays.__getitem__, progress=advance)


class _Cancelled(Exception):
    pass


class _BackgroundWeights:
    """weights.safetensors written on a thread; `finish` waits for it (a progress bar for the
    rest), `cancel` stops it after the tensor being written."""

    def __init__(self, path: str, arrays: dict[str, np.ndarray], reporter: Reporter):
        self.arrays = arrays
        self.total = sum(a.nbytes for a in arrays.values())
        self.written = 0
        self._stop = threading.Event()
        reporter.stage(f"writing {_weights_message(arrays)}, while the other entry points are lowered")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hloserve-weights")
        self._future = self._pool.submit(weights_io.write, path, _specs(arrays), arrays.__getitem__,
                                         progress=self._advance)
        self._pool.shutdown(wait=False)

    def _advance(self, nbytes: int) -> None:
        if self._stop.is_set():
            raise _Cancelled()
        self.written += nbytes

    def finish(self, reporter: Reporter) -> dict[str, str]:
        if not self._future.done():
            shown = self.written
            with reporter.bar(self.total, "weights") as advance:
                advance(shown)
                while True:
                    try:
                        digests = self._future.result(timeout=0.1)
                        break
                    except concurrent.futures.TimeoutError:
                        advance(self.written - shown)
                        shown = self.written
                advance(self.total - shown)
            return digests
        return self._future.result()

    def cancel(self) -> None:
        self._stop.set()
        try:
            self._future.result()
        except Exception:  # noqa: BLE001 - cancelled or failed: the caller is already raising or rewriting
            pass
