"""Op coverage through the export path, over torch's OpInfo database.

For every OpInfo in `op_db`, each float32 CPU sample is wrapped in a tiny
module, captured (exporter.capture: torch.export + core-ATen decompositions),
lowered by our interpreter and jax.export (exporter.export.trace_entry, the
same path artifacts take), run through PJRT on CPU and compared with torch
eager.

Per sample the outcome is one of:
  passed       every output matches eager within tolerance
  failed       a lowering raised, or an output differs (shape, dtype or values)
  unsupported  the graph has an op with no lowering
  skipped      the sample is out of scope, with a reason: torch.export cannot
               capture it, the graph keeps an op that is neither core ATen nor
               lowered by us, it draws random numbers, its shapes depend on data,
               or its output is not a tensor we can compare
An op is `passed` when every sample it ran passed, `unsupported` when some
sample lacked a lowering, `failed` when some sample failed, and `skipped` when
every sample was skipped. Ops in scope are those with at least one sample that
was not skipped (so a non-core op we do lower, such as linalg_inv_ex, is in
scope); the pass rate is passed / in scope.

Ops that write to an input (batch_norm's running stats) are also compared on
the updated input. Samples are static-shape exports (no Dim): the point is op
coverage, and symbolic shapes have their own tests. Several samples share one
program (Runner.batch; run_group shares one across ops): torch.export, the
decompositions and the XLA compile cost ~1 s per program, whatever its size.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.utils._pytree as pytree

# -- tolerances ---------------------------------------------------------------
# Default for float32 outputs. XLA's CPU kernels (vectorized transcendental
# functions, different summation orders) differ from ATen's in the last ulps.
ATOL = 1e-5
RTOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    reason: str
    shape_only: bool = False
    up_to_sign: tuple[int, ...] = ()   # outputs compared in absolute value (vectors unique up to sign)


# Per-op overrides, keyed by OpInfo full name ("name" or "name.variant").
TOLERANCES: Mapping[str, Tolerance] = {
    "matrix_exp": Tolerance(1e-1, 1e-4, "entries span 1e-1..1e5; float32 scaling-and-squaring is accurate to ~1e-6 "
                                        "of the matrix norm (torch itself is 0.05 off float64 on this sample)"),
}

# Ops not run at all, with the reason (checked before any sample is built).
SKIP: Mapping[str, str] = {
}

# Ops whose values are unspecified: only output shapes and dtypes are compared.
SHAPE_ONLY: Mapping[str, str] = {
    name: "uninitialized memory: torch returns whatever the allocator holds; we lower to zeros"
    for name in ("empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided")
}


# Ops whose vector outputs are unique only up to sign: those outputs (by index) are compared in
# absolute value. Sign choices of LAPACK's gesdd/syevd differ between torch's and jax's calls.
UP_TO_SIGN: Mapping[str, tuple[int, ...]] = {
    "svd": (0, 2), "linalg.svd": (0, 2),    # U, Vh
    "linalg.eigh": (1,),                    # eigenvectors
}


def tolerance(name: str) -> Tolerance:
    tol = TOLERANCES.get(name, Tolerance(ATOL, RTOL, "default"))
    if name in SHAPE_ONLY:
        tol = dataclasses.replace(tol, shape_only=True)
    return dataclasses.replace(tol, up_to_sign=UP_TO_SIGN.get(name, ()))


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class SampleOutcome:
    status: Status
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class OpOutcome:
    """What happened to one OpInfo.

    Attributes:
      name: OpInfo full name, "name" or "name.variant_test_name".
      status: see the module docstring.
      reason: why it is not `passed` (first failing / unsupported / skip reason).
      samples: samples run; passed: of those, how many passed; skipped: how many were skipped.
      seconds: wall time spent on the op (sample generation included).
    """
    name: str
    status: Status
    reason: str
    samples: int
    passed: int
    skipped: int
    seconds: float


def full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db() -> list:
    """torch's OpInfo list (importing it takes a few seconds)."""
    from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


# -- samples --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A sample ready to export: flat (args, kwargs) leaves, its tensors, and torch eager's outputs."""
    leaves: list
    spec: Any
    slots: list[tuple[int, int]]      # (leaf index, index into inputs) per tensor leaf
    inputs: list[torch.Tensor]        # distinct tensors, in call order
    arrays: list[np.ndarray]          # the inputs as the artifact sees them (64-bit narrowed), before eager
    expected: list[torch.Tensor]      # eager outputs, flattened
    after: list[torch.Tensor]         # the inputs after eager ran (ops like batch_norm update some in place)
    fn: Callable                      # the op
    tol: Tolerance                    # how its float outputs are compared


class _Batch(torch.nn.Module):
    """forward(*tensors) -> every sample's outputs, flattened and concatenated.

    Several samples of one op go into one program, so torch.export, the
    core-ATen decompositions (~0.7 s a call) and the XLA compile run once per
    batch, not once per sample.
    """

    def __init__(self, samples: list[_Prepared]):
        super().__init__()
        self.samples = samples

    def forward(self, *tensors):
        outs, k = [], 0
        for p in self.samples:
            leaves = list(p.leaves)
            for leaf, i in p.slots:
                leaves[leaf] = tensors[k + i]
            k += len(p.inputs)
            args, kwargs = pytree.tree_unflatten(leaves, p.spec)
            outs.extend(pytree.tree_leaves(p.fn(*args, **kwargs)))
        return tuple(outs)


def _prepare(fn: Callable, sample, tol: Tolerance) -> _Prepared | SampleOutcome:
    """Flatten a sample, run it eagerly, or say why it is skipped."""
    from hloserve.exporter.export import to_numpy
    leaves, spec = pytree.tree_flatten(((sample.input, *sample.args), dict(sample.kwargs)))
    slots, inputs, seen = [], [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in seen:  # the same tensor object twice: one input, used twice
                seen[id(leaf)] = len(inputs)
                inputs.append(leaf)
            slots.append((i, seen[id(leaf)]))
    if any(t.is_complex() for t in inputs):
        return SampleOutcome(Status.SKIPPED, "complex input")
    if any(t.layout != torch.strided for t in inputs):
        return SampleOutcome(Status.SKIPPED, "sparse input")
    if any(t.dtype not in _SUPPORTED_DTYPES for t in inputs):
        return SampleOutcome(Status.SKIPPED, f"input dtype {next(t.dtype for t in inputs if t.dtype not in _SUPPORTED_DTYPES)}")
    arrays = [to_numpy(t).copy() for t in inputs]   # copies: eager may write to its inputs
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - samples eager rejects are not ours to test
        return SampleOutcome(Status.SKIPPED, f"eager raised {_first_line(e)}")
    expected = pytree.tree_leaves(out)
    if not expected or not all(isinstance(t, torch.Tensor) for t in expected):
        return SampleOutcome(Status.SKIPPED, "output is not a tensor (or a tuple of tensors)")
    if any(t.is_complex() for t in expected):
        return SampleOutcome(Status.SKIPPED, "complex output")
    if any(t.dtype not in _SUPPORTED_DTYPES for t in expected):
        return SampleOutcome(Status.SKIPPED, f"output dtype {next(t.dtype for t in expected if t.dtype not in _SUPPORTED_DTYPES)}")
    return _Prepared(leaves, spec, slots, inputs, arrays, [t.detach().clone() for t in expected],
                     [t.detach().clone() for t in inputs], fn, tol)


# Dtypes the artifact carries (dtypes.py); 64-bit types narrow to 32-bit.
_SUPPORTED_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                     torch.int16, torch.int8, torch.uint8, torch.bool}


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _graph_checks(ep, registry) -> SampleOutcome | None:
    from hloserve.exporter.interpreter import _SKIP as NEEDS_NO_LOWERING  # asserts the interpreter drops
    """Skip reasons found in the captured graph: random ops, non-core ops we don't lower, data-dependent shapes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    random, foreign = set(), set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        val = node.meta.get("val")
        if val is not None and free_unbacked_symbols(val):
            return SampleOutcome(Status.SKIPPED, f"data-dependent output shape ({_target(target)})")
        tags = getattr(target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            random.add(_target(target))
        elif isinstance(target, torch._ops.OpOverload) and torch.Tag.core not in tags \
                and target not in registry and target not in NEEDS_NO_LOWERING:
            foreign.add(_target(target))
    if random:
        return SampleOutcome(Status.SKIPPED, f"random op ({', '.join(sorted(random))})")
    if foreign:
        return SampleOutcome(Status.SKIPPED, f"does not decompose to core ATen ({', '.join(sorted(foreign))})")
    return None


def _target(target) -> str:
    from hloserve.exporter.registry import target_name
    return target_name(target)


def _compare(expected: list[torch.Tensor], got: list, tol: Tolerance) -> SampleOutcome:
    from hloserve.exporter.export import to_numpy
    for i, (e, g) in enumerate(zip(expected, got)):
        want = to_numpy(e)
        g = np.asarray(g)
        where = f"output {i}" if len(expected) > 1 else "output"
        if g.shape != want.shape:
            return SampleOutcome(Status.FAILED, f"{where} shape {g.shape}, torch gives {want.shape}")
        if g.dtype != want.dtype:
            return SampleOutcome(Status.FAILED, f"{where} dtype {g.dtype}, torch gives {want.dtype}")
        if tol.shape_only:
            continue
        if i in tol.up_to_sign:
            want, g = np.abs(want), np.abs(g)
        if np.issubdtype(want.dtype, np.floating):
            w64, g64 = want.astype(np.float64), g.astype(np.float64)
            bad = ~np.isclose(g64, w64, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
            if bad.any():
                err = np.abs(np.where(np.isnan(w64) | np.isnan(g64), 0, g64 - w64))
                k = int(np.argmax(bad.reshape(-1)))
                return SampleOutcome(
                    Status.FAILED,
                    f"{where}: {int(bad.sum())}/{bad.size} values differ (atol {tol.atol:g}, rtol {tol.rtol:g}), "
                    f"max abs err {float(err.max()):.3g}; first at flat index {k}: got {g.reshape(-1)[k]!r}, "
                    f"torch {want.reshape(-1)[k]!r}")
        elif not np.array_equal(g, want):
            bad = g != want
            k = int(np.argmax(bad.reshape(-1)))
            return SampleOutcome(Status.FAILED, f"{where}: {int(bad.sum())}/{bad.size} values differ (exact, "
                                                f"{want.dtype}); first at flat index {k}: got {g.reshape(-1)[k]!r}, "
                                                f"torch {want.reshape(-1)[k]!r}")
    return SampleOutcome(Status.PASSED)


@dataclasses.dataclass(frozen=True)
class Runner:
    """Exports samples in batches of `batch` through our path and compares with eager.

    A batch that fails anywhere (capture, a skip reason, lowering, the run) is
    re-run one sample at a time, so every outcome belongs to one sample.
    """
    batch: int = 16
    platforms: tuple[str, ...] = ("cpu",)

    def run_samples(self, name: str, fn: Callable, samples: Iterable) -> list[SampleOutcome]:
        prepared = [_prepare(fn, s, tolerance(name)) for s in samples]
        ready = [i for i, p in enumerate(prepared) if isinstance(p, _Prepared)]
        outcomes = list(prepared)
        for c in range(0, len(ready), self.batch):
            idx = ready[c:c + self.batch]
            chunk = [prepared[i] for i in idx]
            got = self._run(name, chunk) if len(chunk) > 1 else None
            if got is None:
                got = [self._run(name, [p])[0] for p in chunk]
            for i, o in zip(idx, got):
                outcomes[i] = o
        return outcomes

    def _run(self, name: str, chunk: list[_Prepared]) -> list[SampleOutcome] | None:
        """Outcomes of one program holding `chunk`; None if a batch of several broke before comparing."""
        import jax
        from hloserve.exporter.capture import capture
        from hloserve.exporter.errors import LoweringError, UnsupportedOpError
        from hloserve.exporter.export import EntryPoint, to_numpy, trace_entry
        from hloserve.exporter.lowerings import default_registry

        single = len(chunk) == 1

        def each(outcome: SampleOutcome) -> list[SampleOutcome] | None:
            return [outcome] if single else None

        inputs = [t for p in chunk for t in p.inputs]
        try:
            ep = capture(_Batch(chunk), inputs)
        except Exception as e:  # noqa: BLE001
            return each(SampleOutcome(Status.SKIPPED, f"torch.export: {_first_line(e.__cause__ or e)}"))
        skip = _graph_checks(ep, default_registry())
        if skip is not None:  # random / non-core ops / data-dependent shapes: the op's nature, not one sample's
            return [skip] * len(chunk) if all(p.fn is chunk[0].fn for p in chunk) else None
        try:
            traced = trace_entry(EntryPoint(name, program=ep), platforms=self.platforms)
        except UnsupportedOpError as e:
            return each(SampleOutcome(Status.UNSUPPORTED, "no lowering for " + ", ".join(sorted({n.target for n in e.nodes}))))
        except LoweringError as e:
            return each(SampleOutcome(Status.FAILED, f"lowering {e.node.target}: {_first_line(e.cause)}"))
        except Exception as e:  # noqa: BLE001 - any other export error is ours
            return each(SampleOutcome(Status.FAILED, f"export: {_first_line(e)}"))
        # Program outputs: in-place updates of inputs ("updated:NAME"), then the user outputs in sample order.
        owner, want, user = [], [], iter([(j, e) for j, p in enumerate(chunk) for e in p.expected])
        first_input = list(itertools.accumulate([0] + [len(p.inputs) for p in chunk]))
        input_index = {n: i for i, (n, _) in enumerate(traced.inputs)}
        for oname, _ in traced.outputs:
            if oname.startswith("updated:"):
                i = input_index.get(oname[len("updated:"):])
                if i is None:
                    return each(SampleOutcome(Status.SKIPPED, f"program updates a non-input ({oname})"))
                j = max(k for k, f in enumerate(first_input[:-1]) if f <= i)
                owner.append(j)
                want.append(chunk[j].after[i - first_input[j]])
            else:
                j, e = next(user, (None, None))
                if j is None:
                    return each(SampleOutcome(Status.FAILED, f"{len(traced.outputs)} outputs, more than eager gives"))
                owner.append(j)
                want.append(e)
        if next(user, None) is not None:
            return each(SampleOutcome(Status.FAILED, f"{len(traced.outputs)} outputs, fewer than eager gives"))
        weights = [to_numpy(traced.weight_values[n]) for n in traced.weight_names]
        try:
            got = jax.jit(traced.exported.call)(*weights, *[a for p in chunk for a in p.arrays])
        except Exception as e:  # noqa: BLE001
            return each(SampleOutcome(Status.FAILED, f"PJRT run: {_first_line(e)}"))
        return [_compare([w for w, o in zip(want, owner) if o == j], [g for g, o in zip(got, owner) if o == j],
                         chunk[j].tol) for j in range(len(chunk))]


# -- one op ---------------------------------------------------------------------
def run_op(op, *, max_samples: int | None = None, runner: Runner | None = None) -> OpOutcome:
    """Run the first `max_samples` float32 CPU samples of `op` (all when None)."""
    name = full_name(op)
    t0 = time.perf_counter()
    runner = runner or Runner()
    if name in SKIP:
        return OpOutcome(name, Status.SKIPPED, SKIP[name], 0, 0, 0, 0.0)
    if torch.float32 not in op.supported_dtypes("cpu"):
        return OpOutcome(name, Status.SKIPPED, "no float32 CPU support", 0, 0, 0, 0.0)
    try:
        samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32), max_samples))
    except Exception as e:  # noqa: BLE001 - a broken sample generator skips the op, with its reason
        return OpOutcome(name, Status.SKIPPED, f"sample_inputs raised {_first_line(e)}", 0, 0, 0,
                         time.perf_counter() - t0)
    outcomes = runner.run_samples(name, op.op, samples)
    return _classify(name, outcomes, time.perf_counter() - t0)


def run_group(ops: list, *, max_samples: int | None = None, runner: Runner | None = None) -> list[OpOutcome]:
    """Like run_op for each op, but all their samples go into ONE program when that works.

    Used by the pytest run, where most ops are expected to pass: one capture
    and one compile for a dozen ops. If the shared program breaks anywhere,
    each op is run on its own (run_op), so outcomes stay per op.
    """
    runner = runner or Runner()
    t0 = time.perf_counter()
    per_op, chunk = [], []
    for op in ops:
        name = full_name(op)
        if name in SKIP or torch.float32 not in op.supported_dtypes("cpu"):
            return [run_op(op, max_samples=max_samples, runner=runner) for op in ops]
        try:
            samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32), max_samples))
        except Exception:  # noqa: BLE001 - run_op reports it
            return [run_op(op, max_samples=max_samples, runner=runner) for op in ops]
        prepared = [_prepare(op.op, s, tolerance(name)) for s in samples]
        per_op.append((name, prepared))
        chunk.extend(p for p in prepared if isinstance(p, _Prepared))
    got = runner._run("group", chunk) if chunk else []
    if got is None:
        return [run_op(op, max_samples=max_samples, runner=runner) for op in ops]
    results, it = [], iter(got)
    seconds = (time.perf_counter() - t0) / max(len(ops), 1)
    for name, prepared in per_op:
        results.append(_classify(name, [next(it) if isinstance(p, _Prepared) else p for p in prepared], seconds))
    return results


def _classify(name: str, outcomes: list[SampleOutcome], seconds: float) -> OpOutcome:
    n = len(outcomes)
    passed = sum(o.status is Status.PASSED for o in outcomes)
    skipped = sum(o.status is Status.SKIPPED for o in outcomes)
    if n == 0:
        return OpOutcome(name, Status.SKIPPED, "no float32 samples", 0, 0, 0, seconds)
    for status in (Status.UNSUPPORTED, Status.FAILED):
        bad = [o for o in outcomes if o.status is status]
        if bad:
            return OpOutcome(name, status, f"{len(bad)}/{n} samples: {bad[0].reason}", n, passed, skipped, seconds)
    if skipped == n:
        reasons = sorted({o.reason for o in outcomes}, key=lambda r: -sum(o.reason == r for o in outcomes))
        return OpOutcome(name, Status.SKIPPED, reasons[0], n, 0, skipped, seconds)
    return OpOutcome(name, Status.PASSED, f"{skipped} samples skipped: {next(o.reason for o in outcomes if o.status is Status.SKIPPED)}"
                     if skipped else "", n, passed, skipped, seconds)


# -- all ops ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Summary:
    counts: Mapping[Status, int]
    in_scope: int          # passed + failed + unsupported
    pass_rate: float       # passed / in_scope


def summarize(outcomes: Iterable[OpOutcome]) -> Summary:
    counts = {s: 0 for s in Status}
    for o in outcomes:
        counts[o.status] += 1
    in_scope = counts[Status.PASSED] + counts[Status.FAILED] + counts[Status.UNSUPPORTED]
    return Summary(counts, in_scope, counts[Status.PASSED] / in_scope if in_scope else 0.0)


def run_all(ops: Iterable, *, max_samples: int | None = None,
            progress: Callable[[int, int, OpOutcome], None] | None = None) -> Iterator[OpOutcome]:
    ops = list(ops)
    runner = Runner()
    for i, op in enumerate(ops):
        out = run_op(op, max_samples=max_samples, runner=runner)
        if progress:
            progress(i + 1, len(ops), out)
        yield out
