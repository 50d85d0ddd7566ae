"""Checkpoint sources -> entry points (module, example inputs, dynamic dims).

SOURCE may be:
  * a Hugging Face model directory (config.json + *.safetensors);
  * a `.pt2` file written by torch.export.save;
  * `package.module:factory`, where factory() returns (module, args) or
    (module, args, dynamic_shapes);
  * a preset name (see presets.py), e.g. all-minilm-l6-v2.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable, Sequence

import torch

from . import presets
from .errors import SourceError
from .export import EntryPoint
from .shapes import parse_dynamic_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class Source:
    """What a checkpoint exports to.

    Attributes:
      entries: entry points, each with default dynamic dims (overridable by --dynamic).
      model: manifest "model" metadata (task, tokenizer files, config).
      files: extra files copied into the artifact (tokenizer.json, ...), name -> source path.
    """
    description: str
    entries: list[EntryPoint]
    model: dict = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)


def load_source(spec: str, *, dtype: str = "float32") -> Source:
    if dtype not in DTYPES:
        raise SourceError(f"--dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    if spec in presets.PRESETS:
        path = presets.resolve(spec)
        src = _load_path(path, tdtype)
        src.model["preset"] = spec
        return src
    if os.path.exists(spec):
        return _load_path(spec, tdtype)
    if ":" in spec and not spec.startswith(("/", ".")):
        return _load_factory(spec, tdtype)
    raise SourceError(f"source {spec!r} is not a file, a directory, module:factory or a preset "
                      f"({', '.join(sorted(presets.PRESETS))})")


def _load_path(path: str, tdtype) -> Source:
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SourceError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
        return hf_directory(path, tdtype)
    if path.endswith(".pt2"):
        return _load_pt2(path, tdtype)
    if path.endswith(".gguf"):
        from .models import llama_source  # the LLM export path (imported only when needed)
        return llama_source.from_gguf(path, tdtype)
    raise SourceError(f"{path}: unknown checkpoint type; expected a HF directory, a .pt2 or a .gguf file")


def _load_pt2(path: str, tdtype) -> Source:
    from .capture import decompose
    try:
        ep = torch.export.load(path)
    except Exception as e:  # noqa: BLE001
        raise SourceError(f"{path} is not a readable torch.export .pt2 file: {type(e).__name__}: {e}") from e
    if tdtype != torch.float32:
        raise SourceError(f"{path}: --dtype applies before capture; re-save the .pt2 in {tdtype}")
    return Source(f"torch.export program {os.path.basename(path)}", [EntryPoint("forward", program=decompose(ep))],
                  {"task": "generic"})


def _load_factory(spec: str, tdtype) -> Source:
    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise SourceError(f"cannot import {spec}: {e}") from e
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], torch.nn.Module):
        raise SourceError(f"{spec}() must return (module, args) or (module, args, dynamic_shapes)")
    module, args = made[0], tuple(made[1])
    dynamic = made[2] if len(made) == 3 else None
    module = module.to(tdtype) if tdtype != torch.float32 else module
    args = tuple(a.to(tdtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    if isinstance(dynamic, dict):
        import inspect
        names = list(inspect.signature(module.forward).parameters)
        dynamic = tuple(dynamic.get(n) for n in names[:len(args)])
    return Source(f"{spec}()", [EntryPoint("forward", module, args, dynamic)], {"task": "generic"})


# -- Hugging Face ----------------------------------------------------------
class _Positional(torch.nn.Module):
    """Calls a HF model with named inputs given positionally; returns chosen outputs as a tuple."""

    def __init__(self, model: torch.nn.Module, input_names: Sequence[str], output_names: Sequence[str]):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def forward(self, *args):
        out = self.model(**dict(zip(self.input_names, args)), return_dict=True)
        return tuple(out[k] for k in self.output_names)


def hf_entry(model: torch.nn.Module, config, *, batch=(1, 64), seq=(1, 512)) -> tuple[EntryPoint, dict]:
    """An entry point for a HF model by its input kind (text, vision, audio); returns (entry, model metadata)."""
    Dim = torch.export.Dim
    model = model.eval()
    b = Dim("batch", min=batch[0], max=batch[1])
    main = getattr(model, "main_input_name", "input_ids")
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    if main == "input_ids":
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or seq[1]
        s = Dim("seq", min=seq[0], max=min(seq[1], max_pos))
        vocab = config.vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (2, 16), generator=g)
        names, args, dyn = ["input_ids", "attention_mask"], [ids, torch.ones_like(ids)], [{0: b, 1: s}, {0: b, 1: s}]
        import inspect
        if "token_type_ids" in inspect.signature(model.forward).parameters and getattr(config, "type_vocab_size", 0):
            names.append("token_type_ids"), args.append(torch.zeros_like(ids)), dyn.append({0: b, 1: s})
        task = "causal-lm" if any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs) else "text-encoder"
        outputs = ["logits"] if task == "causal-lm" else ["last_hidden_state"]
    elif main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        chans = getattr(config, "num_channels", 3)
        names, args, dyn = ["pixel_values"], [torch.randn(2, chans, size, size)], [{0: b}]
        task = "image"
        outputs = ["logits"] if any("ForImageClassification" in a for a in archs) else ["last_hidden_state"]
    elif main == "input_features":
        mel = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        names, args, dyn = ["input_features"], [torch.randn(2, mel, frames)], [{0: b}]
        task, outputs = "audio-encoder", ["last_hidden_state"]
    else:
        raise SourceError(f"{archs[0]}: main input {main!r} is not supported yet (text, vision and audio models are)")
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    args = [a.to(dtype) if a.is_floating_point() else a for a in args]
    wrapped = _Positional(model, names, outputs)
    entry = EntryPoint("forward", wrapped, tuple(args), tuple(dyn), input_names=names, output_names=outputs,
                       paddable=("batch",))
    return entry, {"task": task, "architecture": archs[0], "config": config.to_dict()}


def hf_directory(path: str, tdtype) -> Source:
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise SourceError(f"{path}/config.json cannot be read by transformers: {e}") from e
    archs = config.architectures or []
    cls: Any = transformers.AutoModel
    for name in archs:
        if hasattr(transformers, name):
            cls = getattr(transformers, name)
            break
    if config.model_type in ("llama", "mistral", "qwen2") and any(a.endswith("ForCausalLM") for a in archs):
        try:
            from .models import llama_source
            return llama_source.from_hf_directory(path, tdtype)
        except ImportError:
            pass  # LLM export path not available; export as a plain HF model
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise SourceError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first")
    model = cls.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa")
    entry, meta = hf_entry(model, config)
    files = {f: os.path.join(path, f) for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                               "vocab.txt") if os.path.exists(os.path.join(path, f))}
    pooling = os.path.join(path, "1_Pooling", "config.json")
    if os.path.exists(pooling):
        with open(pooling) as f:
            meta["pooling"] = json.load(f)
    return Source(f"Hugging Face {meta['architecture']} from {path}", [entry], meta, files)


def apply_dynamic(entries: list[EntryPoint], spec: str | None, pad: Sequence[str] = ()) -> None:
    """Override entries' dynamic dims from a --dynamic SPEC and set --pad symbols."""
    if spec:
        names_all = {n for e in entries for n in (e.input_names or [])}
        parsed = parse_dynamic_spec(spec, sorted(names_all) if names_all else [])
        for e in entries:
            names = list(e.input_names or [])
            dyn = list(e.dynamic_shapes or [None] * len(names))
            for i, n in enumerate(names):
                if n in parsed:
                    dyn[i] = parsed[n]
            e.dynamic_shapes = tuple(dyn)
            declared = {getattr(getattr(d, "root", d), "__name__", None) for spec_ in dyn if spec_ for d in spec_.values()}
            e.paddable = tuple(p for p in e.paddable if p in declared)
    if pad:
        # --pad replaces the source's default ("none" clears it)
        for e in entries:
            e.paddable = () if list(pad) == ["none"] else tuple(dict.fromkeys(pad))
