"""The lowering registry: aten op (overload) -> one lowering function.

A lowering is a plain function `fn(ctx, *args, **kwargs)` over jax arrays and
Python values, marked with `@lower(target, ...)`. Family modules under
lowerings/ only define such functions; `Registry.from_modules` collects them,
so importing a module registers nothing and there is no global table.

Lookup falls back from an overload (aten.add.Tensor) to its packet (aten.add)
so a lowering can cover every overload at once. Registering a target twice
raises: a second lowering would silently shadow the first.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Iterable

LOWERS_ATTR = "__hloserve_lowers__"


def lower(*targets: Any) -> Callable[[Callable], Callable]:
    """Mark `fn` as the lowering of each target (OpOverload, OpOverloadPacket or Python callable)."""
    if not targets:
        raise TypeError("@lower needs at least one target")

    def mark(fn: Callable) -> Callable:
        setattr(fn, LOWERS_ATTR, tuple(getattr(fn, LOWERS_ATTR, ())) + targets)
        return fn

    return mark


def target_name(target: Any) -> str:
    """A readable op name: 'aten.add.Tensor', 'operator.mul', 'higher_order.scan'."""
    name = (getattr(target, "_name", None) or getattr(target, "_qualified_op_name", None)  # overload / packet
            or getattr(target, "__name__", None) or str(target))
    ns = getattr(target, "namespace", None)
    if isinstance(name, str) and "::" in name:
        ns, _, name = name.partition("::")
        overload = getattr(target, "_overloadname", None)
        if overload and not name.endswith(f".{overload}"):  # OpOverload._name has it, except `default`
            name = f"{name}.{overload}"
        return f"{ns}.{name}"
    if ns:
        return f"{ns}.{name}"
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins",) else str(name)


class DuplicateLoweringError(ValueError):
    pass


class Registry:
    def __init__(self) -> None:
        self._table: dict[Any, Callable] = {}

    def register(self, target: Any, fn: Callable) -> None:
        if target in self._table:
            other = self._table[target]
            raise DuplicateLoweringError(
                f"{target_name(target)} already lowered by {other.__module__}.{other.__qualname__}; "
                f"{fn.__module__}.{fn.__qualname__} registers it again. Keep one of them."
            )
        self._table[target] = fn

    def lookup(self, target: Any) -> Callable | None:
        fn = self._table.get(target)
        if fn is None:
            packet = getattr(target, "overloadpacket", None)
            if packet is not None:
                fn = self._table.get(packet)
        return fn

    def __contains__(self, target: Any) -> bool:
        return self.lookup(target) is not None

    def targets(self) -> list[Any]:
        return list(self._table)

    @classmethod
    def from_modules(cls, modules: Iterable[types.ModuleType]) -> "Registry":
        reg = cls()
        for module in modules:
            for value in vars(module).values():
                for target in getattr(value, LOWERS_ATTR, ()) if callable(value) else ():
                    if getattr(value, "__module__", None) != module.__name__:
                        continue  # imported from elsewhere; registered by its own module
                    reg.register(target, value)
        return reg


def row(*targets: Any, fn: Callable, module: str) -> Callable:
    """A one-line table entry: lower `targets` with an existing `fn(ctx, *args, **kw)`.

    `module` is the defining module's `__name__`, so the row is registered by
    that family module only (even if another module imports it).
    """
    def lowering(ctx, *args, **kwargs):
        return fn(ctx, *args, **kwargs)
    lowering.__name__ = lowering.__qualname__ = "_row_" + target_name(targets[0]).replace(".", "_")
    lowering.__module__ = module
    setattr(lowering, LOWERS_ATTR, targets)
    return lowering
