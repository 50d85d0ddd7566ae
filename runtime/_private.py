"""Every private jax API the runtime uses, in one place (checked on jax 0.10.x)."""
from __future__ import annotations

import os


def reset_compilation_cache() -> None:
    """Forget jax's persistent-cache object so the next compile reads the configured directory
    (the only way to switch cache directories within a process)."""
    from jax._src import compilation_cache
    compilation_cache.reset_cache()


def unreadable_compile_cache_entries(cache_dir: str, since: float) -> list[str]:
    """The entries of jax's persistent cache in `cache_dir` written at `since` (time.time()) or later
    that do not decompress: jax writes an entry in place, so a write that found the disk full left
    it cut short, and jax would neither use nor ever rewrite it."""
    from jax._src import compilation_cache, lru_cache
    out = []
    for entry in os.scandir(cache_dir) if os.path.isdir(cache_dir) else ():
        if not entry.name.endswith(lru_cache._CACHE_SUFFIX) or not entry.is_file():
            continue
        try:
            if entry.stat().st_mtime < since:
                continue
            with open(entry.path, "rb") as f:
                compilation_cache.decompress_executable(f.read())
        except FileNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - whatever the decompressor raises for an entry cut short
            out.append(entry.path)
    return out


def rewrite_composites(module_bytes: bytes, replace, kinds: tuple[str, ...] = ("stablehlo.composite",)
                       ) -> tuple[bytes, int]:
    """Deserialize an exported StableHLO module, call `replace(op, mlir_api)` for every
    stablehlo.composite (and every op of the other `kinds` named; it returns True when it replaced
    the op with its own ops), and serialize the result at the current StableHLO version (for this
    process's compile only). `mlir_api` has ir, hlo, func (dialects), mlir (jax's helpers) and module
    (the module being rewritten). Returns (bytes, number replaced)."""
    import types

    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo

    with mlir.make_ir_context(), ir.Location.unknown():
        module = _jax.mlir.deserialize_portable_artifact(module_bytes)
        api = types.SimpleNamespace(ir=ir, hlo=hlo, func=func, mlir=mlir, module=module)
        found = []

        def visit(op):
            if op.name in kinds:
                found.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        done = sum(bool(replace(op, api)) for op in found)
        if not done:
            return module_bytes, 0
        text = mlir.module_to_bytecode(module)
        return _jax.mlir.serialize_portable_artifact(text, hlo.get_current_version(), False), done


def read_module(module_bytes: bytes, read):
    """`read(mlir_api)` on an exported StableHLO module (portable artifact bytes), changing nothing;
    returns what it returns. `mlir_api` as rewrite_composites gives it."""
    import types

    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo

    with mlir.make_ir_context(), ir.Location.unknown():
        module = _jax.mlir.deserialize_portable_artifact(module_bytes)
        return read(types.SimpleNamespace(ir=ir, hlo=hlo, func=func, mlir=mlir, module=module))


def link_kernels(module_bytes: bytes, targets: set[str], build) -> tuple[bytes, int]:
    """Refine the shapes of an exported module whose main has static argument shapes (jax's own
    shape refinement), then replace every custom call whose target is in `targets` by a call of a
    kernel module: `build(target, backend_config, operand_types)` returns that module's serialized
    bytes (a jax export at the now static operand shapes, whose main takes the call's leading
    operands). The kernel's functions are merged into the module, once for all the calls of one target
    with the same attributes and operand types. Returns (bytes, number replaced)."""
    import types

    from jax._src import config
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo

    with mlir.make_ir_context(), ir.Location.unknown():
        module = _jax.mlir.deserialize_portable_artifact(module_bytes)
        refined = _jax.mlir.refine_polymorphic_shapes(
            mlir_module=mlir.module_to_bytecode(module), enable_shape_assertions=True, validate_static_shapes=True,
            enable_shardy=config.use_shardy_partitioner.value)
        module = ir.Module.parse(refined)
        found = []

        def visit(op):
            if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value in targets:
                found.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        api = types.SimpleNamespace(ir=ir, hlo=hlo, func=func, mlir=mlir)
        built: dict[tuple[str, ...], tuple[str, int]] = {}   # one kernel function per distinct call
        for i, op in enumerate(found):
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            config_attr = ir.DictAttr(op.attributes["mhlo.backend_config"])
            key = (target, str(config_attr), *(str(v.type) for v in op.operands))
            if key not in built:
                backend_config = {a.name: a.attr for a in config_attr}
                kernel = _jax.mlir.deserialize_portable_artifact(build(target, backend_config,
                                                                       [v.type for v in op.operands], api))
                main = next(f for f in kernel.body.operations
                            if ir.StringAttr(f.attributes["sym_name"]).value == "main")
                n_args = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
                built[key] = (mlir.merge_mlir_modules(module, f"{target}_{i}", kernel), n_args)
            name, n_args = built[key]
            with ir.InsertionPoint(op):
                call = func.CallOp([r.type for r in op.results], ir.FlatSymbolRefAttr.get(name),
                                   list(op.operands)[:n_args])
            for old, res in zip(op.results, call.results):
                old.replace_all_uses_with(res)
            op.erase()
        if not found:
            return module_bytes, 0
        return _jax.mlir.serialize_portable_artifact(mlir.module_to_bytecode(module), hlo.get_current_version(),
                                                     False), len(found)


def calls_by_function(module_bytes: bytes) -> dict[str, tuple[list[str], list[str]]]:
    """Per function of an exported module (portable artifact bytes): the custom-call targets in its
    body and the functions it calls, in order."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    out = {}
    with mlir.make_ir_context():
        module = _jax.mlir.deserialize_portable_artifact(module_bytes)
        for f in module.body.operations:
            targets, callees = [], []

            def visit(op):
                if op.name == "stablehlo.custom_call":
                    targets.append(ir.StringAttr(op.attributes["call_target_name"]).value)
                elif op.name == "func.call":
                    callees.append(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
                return ir.WalkResult.ADVANCE

            f.operation.walk(visit)
            out[ir.StringAttr(f.attributes["sym_name"]).value] = (targets, callees)
    return out
