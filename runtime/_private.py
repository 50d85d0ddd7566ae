"""Every private jax API the runtime uses, in one place (checked on jax 0.10.x)."""
from __future__ import annotations


def reset_compilation_cache() -> None:
    """Forget jax's persistent-cache object so the next compile reads the configured directory
    (the only way to switch cache directories within a process)."""
    from jax._src import compilation_cache
    compilation_cache.reset_cache()


def rewrite_composites(module_bytes: bytes, replace) -> tuple[bytes, int]:
    """Deserialize an exported StableHLO module, call `replace(op, mlir_api)` for every
    stablehlo.composite (it returns True when it replaced the op with its own ops), and
    serialize the result at the current StableHLO version (for this process's compile only).
    `mlir_api` has ir, hlo, func (dialects) and mlir (jax's helpers). Returns (bytes, number replaced)."""
    import types

    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo
    api = types.SimpleNamespace(ir=ir, hlo=hlo, func=func, mlir=mlir)

    with mlir.make_ir_context(), ir.Location.unknown():
        module = _jax.mlir.deserialize_portable_artifact(module_bytes)
        found = []

        def visit(op):
            if op.name == "stablehlo.composite":
                found.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        done = sum(bool(replace(op, api)) for op in found)
        if not done:
            return module_bytes, 0
        text = mlir.module_to_bytecode(module)
        return _jax.mlir.serialize_portable_artifact(text, hlo.get_current_version(), False), done
