"""A compressed-tensors `quantization_config` (config.json) as the schemes hloserve keeps as they are.

    plan = read_plan(config["quantization_config"], where)    # refuses, in one line, what cannot be kept
    args = plan.args_of("model.layers.0.mlp.down_proj", ("Linear", "Module"))   # WeightArgs or None

compressed-tensors is the format llm-compressor writes (quant_method "compressed-tensors"). Its
`config_groups` each name `targets` (module class names, exact module names, or "re:" regexes
matched from the start of a name) and how their weights (and activations) are quantized; `ignore`
lists modules left in float; `format` says how the integers are stored. A module matched by several
groups takes the most specific target: exact name, then regex, then class (compressed-tensors'
order). Accepted here (everything else is refused, naming the field, the value and what is
supported):

  weights        type int, 4 or 8 bits, strategy group (group_size), channel or tensor, static
                 (dynamic false), actorder none / weight / static (they change how GPTQ calibrated,
                 not the format); 4 bits symmetric or asymmetric (zero points), 8 bits symmetric
  format         pack-quantized (integers packed into int32 words), int-quantized and
                 naive-quantized (int8 tensors)
  activations    none (W4A16, W8A16), or int8 dynamic (W8A8, W4A8): the scales are computed at run
                 time, and hloserve's quantized linear quantizes its input to int8 per block of 32
                 elements of a row anyway (the `hloserve.quant_linear` contract), finer than the
                 checkpoint's per token
  status         quantization_status "compressed" (the integers are what the files hold)

Refused: float weights (fp8, nvfp4, mxfp4), 2/3/5/6/7-bit integers, 8-bit asymmetric weights,
block / token / tensor_group strategies, actorder group (a g_idx permutation), static activation
scales, output activations, a quantized KV cache (kv_cache_scheme), 2:4 or bitmask sparsity,
transforms (SpinQuant / QuIP rotations), and formats other than the three above.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from hloserve.quantization.schemes import QuantizationError

from ..errors import SourceError

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("group", "channel", "tensor")
SUPPORTED = ("supported: int4 weights (symmetric or asymmetric) and int8 weights (symmetric), group / channel / "
             "tensor scales, format pack-quantized, int-quantized or naive-quantized, activations none or "
             "dynamic int8 (W4A16, W8A16, W8A8)")


@dataclasses.dataclass(frozen=True)
class WeightArgs:
    """How one config group's weights are stored.

    Attributes:
      group_name: the config group's key, for messages.
      bits: 4 or 8.
      symmetric: W = q * s (True) or W = (q - z) * s with a zero point z per scale (False).
      strategy: "group" (a scale per `group_size` elements of a row), "channel" (one per row) or
        "tensor" (one for the matrix).
      group_size: for strategy "group".
      format: "pack-quantized" (int32 words), "int-quantized" / "naive-quantized" (int8 tensors).
      activations: None (weight-only) or a description of the dynamic int8 activations.
    """
    group_name: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    format: str
    activations: str | None = None

    def describe(self) -> str:
        scale = f"group {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        sym = "symmetric" if self.symmetric else "asymmetric"
        acts = f", activations {self.activations}" if self.activations else ""
        return f"int{self.bits} {sym} {scale} ({self.format}{acts})"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The config's groups in order, and the modules it leaves in float."""
    groups: tuple[tuple[tuple[str, ...], WeightArgs], ...]     # (targets, args)
    ignore: tuple[str, ...]

    def args_of(self, name: str, classes: tuple[str, ...]) -> WeightArgs | None:
        """The weights of module `name` (whose class and base classes are named `classes`): its
        group's, by compressed-tensors' precedence (exact name, regex, class name; a target listed
        by several groups belongs to the last), or None where no group targets it or it is ignored."""
        if any(_matches(name, classes, t) for t in self.ignore):
            return None
        by_target: dict[str, WeightArgs] = {}
        for targets, args in self.groups:
            by_target.update({t: args for t in targets})
        exact = [t for t in by_target if not t.startswith("re:") and t == name]
        regex = sorted(t for t in by_target if t.startswith("re:") and _matches(name, (), t))
        cls = sorted(t for t in by_target if not t.startswith("re:") and t in classes)
        found = exact + regex + cls
        return by_target[found[0]] if found else None

    def describe(self) -> list[str]:
        return [f"{args.group_name}: {args.describe()}" for _, args in self.groups]


def _matches(name: str, classes: tuple[str, ...], target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in classes


def is_compressed_tensors(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (parsed) describes a compressed-tensors checkpoint."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def read_plan(qc: Mapping[str, Any], where: str) -> Plan:
    """config.json's quantization_config -> Plan; raises QuantizationError in one line for anything
    hloserve cannot keep as it is (see the module docstring)."""
    field = "quantization_config"
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(f"{where}: {field}.quantization_status is {status!r}: the weights are stored as floats, "
                                f"not compressed; save the checkpoint compressed (llm-compressor: "
                                f"save_compressed=True) or export it as a float checkpoint without quantization_config")
    _refuse_extras(qc, field, where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise SourceError(f"{where}: {field}.config_groups is missing or empty; the checkpoint is not a quantized "
                          f"compressed-tensors model (remove quantization_config to export it as float)")
    top_format = qc.get("format")
    out = []
    for key, group in groups.items():
        at = f"{field}.config_groups.{key}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where}: {at} is a preset name list ({group!r}), not a written-out scheme; "
                                    f"save the checkpoint with compressed-tensors >= 0.4, which writes schemes out")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise SourceError(f"{where}: {at}.targets is {targets!r}, not a list of module names or classes")
        out.append((tuple(targets), _weight_args(key, group, top_format, at, where)))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise SourceError(f"{where}: {field}.ignore is {ignore!r}, not a list of module names")
    return Plan(tuple(out), tuple(ignore))


def _refuse_extras(qc: Mapping[str, Any], field: str, where: str) -> None:
    """The parts of a compressed-tensors config beside the weights that hloserve does not implement."""
    if qc.get("kv_cache_scheme") is not None:
        raise QuantizationError(f"{where}: {field}.kv_cache_scheme is set (a quantized KV cache with stored scales); "
                                f"not supported yet: quantize the checkpoint without kv_cache_scheme; {SUPPORTED}")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise QuantizationError(f"{where}: {field}.sparsity_config.format is {sparsity.get('format')!r} "
                                f"(structure {sparsity.get('sparsity_structure')!r}): sparse weights are not supported; "
                                f"hloserve stores dense matrices; {SUPPORTED}")
    if qc.get("transform_config"):
        raise QuantizationError(f"{where}: {field}.transform_config is set (SpinQuant / QuIP rotations applied at "
                                f"run time): not supported; {SUPPORTED}")


def _weight_args(key: str, group: Mapping[str, Any], top_format: Any, at: str, where: str) -> WeightArgs:
    """One config group's weights (and activations) -> WeightArgs, or a one-line refusal."""
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantizationError(f"{where}: {at}.weights is {w!r}: a group without quantized weights is not "
                                f"supported; {SUPPORTED}")
    fmt = group.get("format") or top_format

    def refuse(name: str, value: Any, why: str = "") -> QuantizationError:
        return QuantizationError(f"{where}: {at}.{name} is {value!r}{why}; {SUPPORTED}")

    if w.get("type", "int") != "int":
        raise refuse("weights.type", w.get("type"), " (floating-point weights, e.g. fp8 or nvfp4)")
    bits = w.get("num_bits", 8)
    if bits not in (4, 8):
        raise refuse("weights.num_bits", bits)
    symmetric = w.get("symmetric", True)
    if bits == 8 and not symmetric:
        raise refuse("weights.symmetric", symmetric, " with num_bits 8 (asymmetric int8 weights)")
    strategy = w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else
                                     "channel" if w.get("group_size") == -1 else "tensor")
    if strategy not in STRATEGIES:
        raise refuse("weights.strategy", strategy)
    group_size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size < 2 or group_size % 2):
        raise refuse("weights.group_size", group_size, " (an even group of 2 or more elements is needed)")
    if w.get("dynamic", False) is not False:
        raise refuse("weights.dynamic", w.get("dynamic"), " (weights quantized at run time)")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise refuse("weights.actorder", w.get("actorder"), " (activation order with a g_idx permutation)")
    if fmt not in FORMATS:
        raise refuse("format", fmt)
    if group.get("output_activations") is not None:
        raise refuse("output_activations", group.get("output_activations"), " (quantized layer outputs)")
    return WeightArgs(key, bits, bool(symmetric), strategy, group_size, fmt, _activations(group, refuse))


def _activations(group: Mapping[str, Any], refuse) -> str | None:
    """None for weight-only groups; a description of accepted dynamic int8 activations; else a refusal."""
    a = group.get("input_activations")
    if a is None:
        return None
    if not isinstance(a, dict):
        raise refuse("input_activations", a)
    if a.get("type", "int") != "int" or a.get("num_bits", 8) != 8:
        raise refuse("input_activations", f"{a.get('type', 'int')}{a.get('num_bits', 8)}",
                     " (activations other than int8)")
    if a.get("dynamic") is not True:
        raise refuse("input_activations.dynamic", a.get("dynamic"),
                      " (static activation scales; hloserve computes them at run time, per block of 32)")
    return f"int8 dynamic per {a.get('strategy') or 'token'}"
