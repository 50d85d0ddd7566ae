"""Every private jax and torch API the exporter uses, in one place (checked on jax 0.10.x with torch 2.13, and jax 0.11.2 with torch 2.11 on a GPU).

An upgrade that moves one of these breaks here, with the rest of the exporter untouched. Each name
says what it is for; none of them is re-exported beyond the exporter.
"""
from __future__ import annotations

from jax._src import core as _jax_core
from jax._src.lib.mlir.dialects import hlo as stablehlo_dialect  # noqa: F401  StableHLO versions, portable artifacts

# symbolic-dim arithmetic that jax.export does not expose publicly
max_dim = _jax_core.max_dim
min_dim = _jax_core.min_dim
InconclusiveDimensionOperation = _jax_core.InconclusiveDimensionOperation


def torch_scan():
    """torch's `scan` higher-order op (lowered to a StableHLO while loop); imported on use."""
    from torch._higher_order_ops.scan import scan
    return scan


def scan_lifted(body, init, xs, lifted):
    """torch's scan op over `body(carry, x, lifted) -> (carry, y)`, called directly: every tensor
    the body reads besides the carry and its row of `xs` is passed in `lifted` (its additional
    inputs), so nothing needs finding. `torch_scan()` compiles the body with dynamo first to lift
    closed-over tensors, seconds per traced body (docs/performance.md); a body that closes over a
    traced tensor fails under this one (torch: "Mixing fake modes"). Returns (carry, [y leaves]);
    eager, it runs the body once per row."""
    import torch
    from torch._higher_order_ops.scan import scan_op
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _pytree as pytree

    init_leaves, init_spec = pytree.tree_flatten(init)
    xs_leaves, xs_spec = pytree.tree_flatten(xs)
    lifted_leaves, lifted_spec = pytree.tree_flatten(lifted)
    if any(isinstance(t, FakeTensor) for t in init_leaves):   # traced: a real tensor enters as a constant's copy
        lifted_leaves = [t.clone() if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
                         for t in lifted_leaves]
    init_leaves, xs_leaves, lifted_leaves = _unaliased(init_leaves, xs_leaves, lifted_leaves)
    ni, nx = len(init_leaves), len(xs_leaves)

    def flat(*args):
        carry = pytree.tree_unflatten(list(args[:ni]), init_spec)
        x = pytree.tree_unflatten(list(args[ni:ni + nx]), xs_spec)
        closed = pytree.tree_unflatten(list(args[ni + nx:]), lifted_spec)
        carry, y = body(carry, x, closed)
        return [*pytree.tree_leaves(carry), *pytree.tree_leaves(y)]

    out = scan_op(flat, init_leaves, xs_leaves, tuple(lifted_leaves))
    return pytree.tree_unflatten(list(out[:ni]), init_spec), list(out[ni:])


def _unaliased(*groups):
    """The scan's operands with each one that shares storage with an earlier one cloned: torch's
    scan refuses operands that alias each other (when the exported program is decomposed), and
    models pass views of one tensor (GPT-J splits one sin/cos table into its two halves)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = set()

    def own(t):
        if not isinstance(t, torch.Tensor):
            return t
        key = StorageWeakRef(t.untyped_storage())
        if key in seen:
            return t.clone()
        seen.add(key)
        return t

    return [[own(t) for t in group] for group in groups]


def composite(decomposition, name: str, version: int):
    """`jax.lax.composite`, also under symbolic shapes: jax's own lowering passes the operands
    but not the dimension variables its decomposition function takes first (jax 0.10: "has 7
    operand(s), but decomposition has 8"); this one passes them as the leading operands."""
    import functools as _functools

    from jax import tree_util
    from jax._src import api_util
    from jax._src.lax import lax as _lax

    prim = _composite_primitive()

    def call(*args, **kwargs):
        flat_args, in_tree = tree_util.tree_flatten(args)
        in_avals = tuple(_jax_core.typeof(x) for x in flat_args)
        debug = api_util.debug_info("composite", decomposition, args, kwargs)
        jaxpr, consts, out_tree = _lax._trace_composite_to_jaxpr(
            _functools.partial(decomposition, **kwargs), in_tree, in_avals, name, debug)
        attributes = tuple((k, *tree_util.tree_flatten(v)) for k, v in kwargs.items())
        attributes = tuple((k, tuple(leaves), tree) for k, leaves, tree in attributes)
        out = prim.bind(*consts, *flat_args, name=name, attributes=attributes, version=version, jaxpr=jaxpr)
        return tree_util.tree_unflatten(out_tree, out)

    return call


@__import__("functools").cache
def _composite_primitive():
    """The primitive behind `composite` (registered with jax on first use)."""
    from jax._src import util
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    prim = _jax_core.Primitive("hloserve_composite")
    prim.multiple_results = True
    # our own rules: jax's composite rules renamed their jaxpr parameter in 0.11
    prim.def_impl(lambda *args, jaxpr, **_: _jax_core.jaxpr_as_fun(jaxpr)(*args))
    prim.def_abstract_eval(lambda *args, jaxpr, **_: jaxpr.out_avals)

    def lowering(ctx, *args, name, attributes, version, jaxpr):
        const_args_and_avals = _jax_core.jaxpr_const_args(jaxpr.jaxpr)
        const_args, const_avals = util.unzip2(const_args_and_avals)
        const_values = tuple(mlir.ir_constants(c, const_lowering=ctx.const_lowering, aval=aval)
                             for c, aval in const_args_and_avals)
        func_op, _, _ = mlir.lower_called_computation(
            name, jaxpr, ctx.module_context, len(const_args), (*const_avals, *ctx.avals_in), ctx.avals_out,
            ctx.tokens_in)
        attrs = {k: mlir.ir_attribute(tree.unflatten(leaves)) for k, leaves, tree in attributes
                 if tree.unflatten(leaves) is not None}
        flat_args, _ = mlir.ir_tree_registry.flatten(const_values + args)
        return hlo.CompositeOp(
            func_op.type.results, [*ctx.dim_var_values, *flat_args], name=ir.StringAttr.get(name),
            decomposition=ir.FlatSymbolRefAttr.get(func_op.name.value),
            composite_attributes=ir.DictAttr.get(attrs), version=mlir.i32_attr(version)).results

    mlir.register_lowering(prim, lowering)
    return prim


def drop_derived_ranges(ep) -> int:
    """A program read back by torch.export.load has derived-dim expressions (`2*s77`) among its
    shape environment's ranges, which torch's run_decompositions then fails on ("expected
    sympy.Symbol", torch 2.13); the same program decomposes before saving. Their ranges follow from
    their roots', so drop them. Returns how many were dropped."""
    import sympy
    from torch._export.utils import _get_shape_env_from_gm

    env = _get_shape_env_from_gm(ep.graph_module)
    if env is None:
        return 0
    derived = [k for k in env.var_to_range if not isinstance(k, sympy.Symbol)]
    for k in derived:
        del env.var_to_range[k]
    return len(derived)
