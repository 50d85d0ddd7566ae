"""Higher-order ops (torch.cond, while_loop, scan, map) against torch eager, plus the
StableHLO structure they lower to (one stablehlo.case / stablehlo.while per op,
bodies emitted once)."""
from __future__ import annotations

import os
import re

import numpy as np
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.export import Dim

from hloserve.exporter.export import EntryPoint, export_artifact
from hloserve.runtime import load

ATOL = 1e-5  # f32; the bodies are a few ops deep


def _export(tmp_path, module, args, dynamic=None):
    """Export `module(*args)`; returns (the loaded function, the .mlir text)."""
    out = str(tmp_path / "art")
    export_artifact(out, [EntryPoint("forward", module, args, dynamic)], source="test_control_flow")
    with open(os.path.join(out, "functions", "forward.mlir")) as f:
        text = f.read()
    return load(out).functions["forward"], text


def _check(fn, module, args, atol=ATOL):
    """Run the artifact and eager on `args`; compare every output."""
    got = fn(**{t.name: a.numpy() for t, a in zip(fn.spec.inputs, args)})
    with torch.no_grad():
        want = module(*args)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want)
    for (name, g), w in zip(got.items(), want):
        g = np.asarray(g)
        assert g.shape == tuple(w.shape), name
        np.testing.assert_allclose(g, w.numpy(), atol=atol, rtol=0, err_msg=name)
    return got


def _count(text, op):
    return len(re.findall(rf"\b{re.escape(op)}\b", text))


def _branches(text):
    """jax emits a two-way cond as stablehlo.case (older versions: stablehlo.if)."""
    return _count(text, "stablehlo.case") + _count(text, "stablehlo.if")


# -- cond ------------------------------------------------------------------------
class CondWithClosures(torch.nn.Module):
    """Branches close over a Linear, a buffer and a second input."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x, y):                      # x, y: (B, 4)
        return torch.cond(x.sum() > y.sum(), lambda x: self.lin(x) + y, lambda x: x - self.shift * y, (x,))


def test_cond_takes_both_branches(tmp_path):
    torch.manual_seed(0)
    m = CondWithClosures().eval()
    b = Dim("batch", min=1, max=32)
    fn, text = _export(tmp_path, m, (torch.randn(3, 4), torch.randn(3, 4)), ({0: b}, {0: b}))
    assert _branches(text) == 1
    assert re.search(r"tensor<\?x4xf32>", text)
    true_in = (torch.randn(5, 4) + 3, torch.randn(5, 4))
    false_in = (torch.randn(2, 4) - 3, torch.randn(2, 4))
    assert bool(true_in[0].sum() > true_in[1].sum()) and not bool(false_in[0].sum() > false_in[1].sum())
    _check(fn, m, true_in)
    _check(fn, m, false_in)


class CondOnShape(torch.nn.Module):
    def forward(self, x):                         # x: (B, 4)
        return torch.cond(x.shape[0] > 4, lambda x: x * 2, lambda x: x + 100, (x,))


def test_cond_on_a_symbolic_dim_is_decided_at_run_time(tmp_path):
    m = CondOnShape()
    fn, text = _export(tmp_path, m, (torch.randn(3, 4),), ({0: Dim("batch", min=1, max=32)},))
    assert _branches(text) == 1
    small = _check(fn, m, (torch.randn(2, 4),))
    big = _check(fn, m, (torch.randn(7, 4),))
    assert np.asarray(small["output"]).min() > 90 and np.asarray(big["output"]).max() < 90


class CondWithSizes(torch.nn.Module):
    """A branch reshapes with the symbolic batch size (a SymInt operand) and both return an int tensor too."""

    def forward(self, x):                         # x: (B, 4)
        b = x.shape[0]

        def yes(x):
            return x.argmax(-1), x.reshape(b, 2, 2).sum(1) + b

        def no(x):
            return x.argmin(-1), x[:, :2] * 2.0

        return torch.cond(x.sum() > 0, yes, no, (x,))


def test_cond_with_symbolic_size_operands_and_int_outputs(tmp_path):
    m = CondWithSizes()
    fn, text = _export(tmp_path, m, (torch.randn(3, 4),), ({0: Dim("batch", min=1, max=32)},))
    assert _branches(text) == 1
    assert [t.dtype for t in fn.spec.outputs] == ["i32", "f32"]
    _check(fn, m, (torch.randn(5, 4) + 1,))
    _check(fn, m, (torch.randn(6, 4) - 1,))


# -- while_loop ----------------------------------------------------------------------
class Countdown(torch.nn.Module):
    """A counter carried with a value; the trip count is an input."""

    def forward(self, x, n):                      # x: (B, 3), n: () int
        def cond(i, acc):
            return i < n

        def body(i, acc):
            return i + 1, acc * 1.5 + 1

        return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), x))


def test_while_loop_with_a_counter(tmp_path):
    m = Countdown()
    fn, text = _export(tmp_path, m, (torch.randn(2, 3), torch.tensor(5)), ({0: Dim("batch", max=16)}, None))
    assert _count(text, "stablehlo.while") == 1
    for n in (0, 1, 7):
        got = _check(fn, m, (torch.randn(4, 3), torch.tensor(n)), atol=1e-3)  # values grow to ~1e2
        assert int(np.asarray(got["output_0"])) == n


class ConvergeWithWeights(torch.nn.Module):
    """The body uses a parameter and the stop test an input: both are additional inputs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x, limit):                  # x: (2, 4), limit: () f32
        def cond(i, h):
            return (h.abs().sum() < limit) & (i < 50)

        def body(i, h):
            return i + 1, h @ self.w + 1.0

        return while_loop(cond, body, (torch.tensor(0), x))


def test_while_loop_with_closures_and_data_dependent_stop(tmp_path):
    torch.manual_seed(1)
    m = ConvergeWithWeights().eval()
    fn, text = _export(tmp_path, m, (torch.randn(2, 4), torch.tensor(100.0)))
    assert _count(text, "stablehlo.while") == 1
    assert fn.spec.weights[0] == "w"  # then the lifted torch.tensor(0)
    for limit in (0.0, 30.0, 1e4):
        _check(fn, m, (torch.randn(2, 4), torch.tensor(limit)), atol=1e-4)


# -- scan --------------------------------------------------------------------------
class RnnScan(torch.nn.Module):
    """Two carries (state, running sum) and two stacked ys; closes over a parameter and an input."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, h0, xs, scale):             # h0: (B, 8), xs: (T, B, 8), scale: ()
        def step(h, total, x):
            h = torch.tanh(h @ self.w + x * scale)
            return (h, total + h), (h * 2, h.sum(-1))

        (h, total), (ys, sums) = scan(lambda c, x: step(*c, x), (h0, torch.zeros_like(h0)), xs)
        return h, total, ys, sums


def test_scan_carry_and_stacked_ys_with_dynamic_batch_and_length(tmp_path):
    torch.manual_seed(2)
    m = RnnScan().eval()
    b, t = Dim("batch", min=1, max=32), Dim("steps", min=1, max=100)
    fn, text = _export(tmp_path, m, (torch.randn(2, 8), torch.randn(5, 2, 8), torch.tensor(0.5)),
                       ({0: b}, {0: t, 1: b}, None))
    assert _count(text, "stablehlo.while") == 1
    assert re.search(r"tensor<\?x\?x8xf32>", text)  # ys stacked along the scanned dim, both symbolic
    for batch, steps in ((1, 5), (6, 1), (3, 17)):
        _check(fn, m, (torch.randn(batch, 8), torch.randn(steps, batch, 8), torch.tensor(0.7)))


class LiftedScan(torch.nn.Module):
    """exporter/_private.scan_lifted: the body reads a stacked parameter row, a whole buffer, a
    second input and a plain tensor that is neither (a constant), all passed in, none closed over."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8) * 0.3)     # [L, 8, 8]: a row per iteration
        self.register_buffer("bias", torch.randn(4, 8))             # read whole, indexed by the step
        self.table = torch.randn(8)                                 # no module tensor: a constant

    def forward(self, h0, scale):                 # h0: (B, 8), scale: ()
        from hloserve.exporter._private import scan_lifted

        def body(h, x, lifted):
            w, i = x
            b = torch.index_select(lifted["bias"], 0, i.reshape(1))[0]
            h = torch.tanh(h @ w + b * lifted["scale"] + lifted["table"])
            return h, h.sum()

        h, (sums,) = scan_lifted(body, h0, (self.w, torch.arange(4)),
                                 {"bias": self.bias, "scale": scale, "table": self.table})
        return h, sums


def test_scan_lifted_reads_only_what_it_is_passed(tmp_path):
    torch.manual_seed(3)
    m = LiftedScan().eval()
    fn, text = _export(tmp_path, m, (torch.randn(2, 8), torch.tensor(0.5)), ({0: Dim("batch", max=8)}, None))
    assert _count(text, "stablehlo.while") == 1
    got = _check(fn, m, (torch.randn(3, 8), torch.tensor(0.7)))
    h = torch.randn(3, 8)          # eager scan_lifted is the plain loop
    want = h
    for i in range(4):
        want = torch.tanh(want @ m.w[i] + m.bias[i] * 0.7 + m.table)
    torch.testing.assert_close(m(h, torch.tensor(0.7))[0], want, rtol=0, atol=0)
    assert len(got) == 2


class ReverseScanOverDim1(torch.nn.Module):
    def forward(self, init, xs):                  # init: (B, 3), xs: (B, T, 3)
        def step(c, x):
            c = c * 0.5 + x
            return c, c.sum(-1)

        return scan(step, init, xs, dim=1, reverse=True)


def test_scan_reverse_over_another_dim(tmp_path):
    m = ReverseScanOverDim1()
    fn, text = _export(tmp_path, m, (torch.randn(2, 3), torch.randn(2, 6, 3)), ({0: Dim("batch", max=8)},) * 2)
    assert _count(text, "stablehlo.while") == 1
    _check(fn, m, (torch.randn(4, 3), torch.randn(4, 6, 3)))


class CondInsideScan(torch.nn.Module):
    def forward(self, init, xs):                  # init: (3,), xs: (T, 3)
        def step(c, x):
            c = torch.cond(x.sum() > 0, lambda c, x: c + x, lambda c, x: c - x, (c, x))
            return c, c.clone()

        return scan(step, init, xs)


def test_cond_nested_in_scan_is_emitted_once(tmp_path):
    m = CondInsideScan()
    fn, text = _export(tmp_path, m, (torch.randn(3), torch.randn(6, 3)))
    assert _count(text, "stablehlo.while") == 1 and _branches(text) == 1
    _check(fn, m, (torch.randn(3), torch.randn(6, 3)))


class MapRows(torch.nn.Module):
    def forward(self, xs, y):                     # xs: (T, 3), y: (3,)
        from torch._higher_order_ops.map import map as map_rows
        return map_rows(lambda x, y: torch.sin(x) * y + 1, xs, y)


def test_map_lowers_to_one_loop(tmp_path):
    m = MapRows()
    fn, text = _export(tmp_path, m, (torch.randn(5, 3), torch.randn(3)))
    assert _count(text, "stablehlo.while") == 1
    _check(fn, m, (torch.randn(5, 3), torch.randn(3)))


# -- a 24-layer stack written with scan is the size of one layer ---------------------
class ResidualStack(torch.nn.Module):
    """Pre-norm residual MLP layers over stacked weights; `scanned` picks scan vs a Python loop.
    (benchmarks/export.py measures the same stack at hidden 256 for compile time.)"""

    def __init__(self, layers, hidden, scanned):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers, self.scanned = layers, scanned
        self.norm = torch.nn.Parameter(torch.ones(layers, hidden))
        self.w1 = torch.nn.Parameter(torch.randn(layers, hidden, 4 * hidden, generator=g) / hidden ** 0.5)
        self.b1 = torch.nn.Parameter(torch.randn(layers, 4 * hidden, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(layers, 4 * hidden, hidden, generator=g) / (4 * hidden) ** 0.5)
        self.b2 = torch.nn.Parameter(torch.randn(layers, hidden, generator=g) * 0.1)

    def layer(self, h, norm, w1, b1, w2, b2):
        x = torch.nn.functional.rms_norm(h, (h.shape[-1],), norm)
        return h + (torch.nn.functional.gelu(x @ w1 + b1) @ w2 + b2) / self.layers

    def forward(self, h):                         # h: (B, hidden)
        ws = (self.norm, self.w1, self.b1, self.w2, self.b2)
        if self.scanned:
            h, _ = scan(lambda c, w: (self.layer(c, *w), c.new_zeros(())), h, ws)
            return h
        for i in range(self.layers):
            h = self.layer(h, *(w[i] for w in ws))
        return h


def _ops(text):
    return len(re.findall(r"^\s*(?:%[^=]+=\s*)?\"?stablehlo\.\w+", text, re.M))


def test_scanned_24_layer_stack_is_the_size_of_one_layer(tmp_path):
    hidden, dyn = 64, ({0: Dim("batch", max=64)},)
    x = torch.randn(3, hidden)
    one = _export(tmp_path / "one", ResidualStack(1, hidden, False), (x,), dyn)[1]
    scanned_model = ResidualStack(24, hidden, True)
    fn, scanned = _export(tmp_path / "scan", scanned_model, (x,), dyn)
    unrolled = _export(tmp_path / "unrolled", ResidualStack(24, hidden, False), (x,), dyn)[1]

    assert _count(scanned, "stablehlo.while") == 1 and _count(unrolled, "stablehlo.while") == 0
    assert _count(one, "stablehlo.dot_general") == 2
    assert _count(scanned, "stablehlo.dot_general") == 2                  # the layer body, once
    assert _count(unrolled, "stablehlo.dot_general") == 48
    # one layer plus the loop's bookkeeping, far from 24 layers
    assert _ops(scanned) <= 1.2 * _ops(one) and len(scanned) <= 1.3 * len(one)
    assert _ops(unrolled) >= 15 * _ops(one)
    # weights stay stacked arguments: 5 tensors of [24, ...], no per-layer copies
    assert fn.spec.weights == ("norm", "w1", "b1", "w2", "b2")
    _check(fn, scanned_model, (torch.randn(5, hidden),), atol=1e-4)
