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
import re
import sys
from typing import Any, Sequence

import torch
from hloserve.quantization.convert import QuantRequest
from hloserve.quantization.schemes import INT8, QuantConfig
from hloserve.runtime.artifact.generation import GENERATION_CONFIG
from hloserve.runtime.artifact.text import TOKENIZER
from hloserve.runtime.artifact.llm import kv_cache_dtype_name

from . import presets
from ._private import drop_derived_ranges
from .capture import decompose
from .dynamic_spec import parse_dynamic_spec
from .entry import Source  # noqa: F401  (re-exported: sources return it)
from .errors import SourceError
from .export import EntryPoint
from .compressed_tensors.checkpoint import open_checkpoint
from .compressed_tensors.config import is_compressed_tensors
from .gguf.checkpoint import load_gguf, write_hf_directory
from .gguf.quant import stored_by_module, stored_experts
from .llm import hf_causal
from .llm.hf_files import text_spec, with_recommended
from .quantize import quantize_source
from .shapes import AUTO_NAME

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --llm-step: how a causal LM is exported ("none": its plain forward, served with the predict API)
LLM_STEPS = ("auto", "generic", "none")
LOW_DTYPES = ("bfloat16", "float16")
# --kv-cache-dtype: a 16-bit float, or int8 / fp8_e4m3 (K/V quantized per token and KV head,
# docs/quantization.md; "fp8", vLLM's alias, is fp8_e4m3: runtime.artifact.llm.KV_CACHE_DTYPE_ALIASES)
KV_CACHE_DTYPES = {**{d: DTYPES[d] for d in LOW_DTYPES}, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def auto_dtypes(spec: str, dtype: str, weight_dtype: str | None,
                kv_cache_dtype: str | None, quantize: str | None = None) -> tuple[str, str | None, str | None]:
    """--dtype auto (the default), resolved the way `vllm serve --dtype auto` follows a checkpoint: a
    Hugging Face causal-LM directory stored in a 16-bit float exports as the serving artifact, its
    weight matrices (unless --quantize stores them) and KV cache in that float under float32
    activations (what the default model serves with); everything else in float32. Returns
    (dtype, weight_dtype, kv_cache_dtype)."""
    if dtype != "auto":
        return dtype, weight_dtype, kv_cache_dtype
    stored = _checkpoint_dtype(spec)
    if stored in LOW_DTYPES and weight_dtype is None and kv_cache_dtype is None:
        return "float32", None if quantize else stored, stored
    return "float32", weight_dtype, kv_cache_dtype


def _checkpoint_dtype(spec: str) -> str | None:
    """The `dtype` (`torch_dtype`) a causal-LM directory's config.json says its weights are stored in."""
    path = os.path.join(spec, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return None
    return config.get("dtype") or config.get("torch_dtype")


def load_source(spec: str, *, dtype: str = "float32", quantize: str | None = None,
                quantize_skip: Sequence[str] = (), weight_dtype: str | None = None,
                kv_cache_dtype: str | None = None, llm_step: str = "auto", lora=None,
                keep_16bit_embedding: bool = False) -> Source:
    """Load SOURCE; with `quantize` (--quantize, see quantization.schemes.QuantConfig.parse) its
    Linear/Embedding weights are swapped for quantized ones (a GGUF with `gguf` keeps its blocks).
    `weight_dtype` / `kv_cache_dtype` (--weight-dtype, --kv-cache-dtype) store an LLM's weight
    matrices / K and V in a 16-bit float under float32 activations. `llm_step` (--llm-step): "auto"
    or "generic" export a Hugging Face causal LM or a GGUF as the paged-cache step
    (models/hf_causal.py), "none" a causal LM as its plain forward (for the predict API). `lora`
    (--lora-slots, a llm.lora.LoraRequest): the step takes adapters in that many slots.
    `keep_16bit_embedding` (--keep-16bit-embedding): a compressed-tensors checkpoint's tied embedding
    table and LM head stay in 16 bits (by default: int8, a scale per row, stored once)."""
    llm = {}
    for flag, value, key, table in (("--weight-dtype", weight_dtype, "weight_dtype", DTYPES),
                                    ("--kv-cache-dtype", kv_cache_dtype, "kv_dtype", KV_CACHE_DTYPES)):
        if value is None:
            continue
        if table is KV_CACHE_DTYPES:
            value = kv_cache_dtype_name(value)
        _check_stored_dtype(flag, value, dtype, table)
        llm[key] = table[value]
    if llm_step not in LLM_STEPS:
        raise SourceError(f"--llm-step {llm_step!r}: use {', '.join(LLM_STEPS)}")
    if llm_step != "auto":
        llm["step"] = llm_step
    if lora is not None:
        if llm_step == "none":
            raise SourceError("--lora-slots applies to the LLM step; leave out --llm-step none")
        llm["lora"] = lora
    if keep_16bit_embedding:
        if quantize:
            raise SourceError("--keep-16bit-embedding applies without --quantize; with --quantize, leave the table "
                              "float with --quantize-skip (e.g. 'model.embed_tokens,lm_head')")
        if not (os.path.isdir(spec) and is_compressed_tensors(_read_json(os.path.join(spec, "config.json")) or {})):
            raise SourceError(f"--keep-16bit-embedding applies to compressed-tensors checkpoints (whose tied table "
                              f"would be stored in int8); {spec} is not one, and keeps its float table already")
        llm["keep_table"] = True
    if quantize and "weight_dtype" in llm:
        raise SourceError("--weight-dtype and --quantize both choose how weights are stored; use one of them")
    if quantize:

        request = QuantRequest(QuantConfig.parse(quantize, tuple(quantize_skip)))
        return quantize_source(_load_source(spec, dtype, request, llm), request)
    return _load_source(spec, dtype, None, llm)


def _check_stored_dtype(flag: str, value: str, dtype: str, table: dict) -> None:
    """--weight-dtype / --kv-cache-dtype VALUE under --dtype DTYPE, or one line saying what is supported."""
    allowed = [d for d in table if d in LOW_DTYPES or table is KV_CACHE_DTYPES]
    if value not in allowed or dtype != "float32":
        raise SourceError(f"{flag} {value!r} is not supported with --dtype {dtype}; use {' or '.join(allowed)} "
                          f"under --dtype float32 (or --dtype alone for one dtype throughout)")


def _load_source(spec: str, dtype: str, quant, llm: dict) -> Source:
    if dtype not in DTYPES:
        raise SourceError(f"--dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    if quant is not None and quant.config.native and not spec.endswith(".gguf") and \
            not (spec in presets.PRESETS and presets.resolve(spec).endswith(".gguf")):
        raise SourceError(f"--quantize gguf keeps a GGUF file's blocks, but {spec} is not a .gguf; "
                          f"use --quantize int8 or int4[:GROUP[:sym]]")
    if spec in presets.PRESETS:
        path = presets.resolve(spec)
        src = _load_path(path, tdtype, quant, llm)
        src.model["preset"] = spec
        if presets.PRESETS[spec].generation:   # its model card's sampling, for the server's defaults
            src.files = {**src.files, GENERATION_CONFIG: with_recommended(src.files, presets.PRESETS[spec].generation)}
        return src
    if os.path.exists(spec):
        return _load_path(spec, tdtype, quant, llm)
    if ":" in spec and not spec.startswith(("/", ".")):
        _llm_only(spec, llm)
        return _load_factory(spec, tdtype)
    raise SourceError(f"source {spec!r} is not a file, a directory, module:factory or a preset "
                      f"({', '.join(sorted(presets.PRESETS))})")


def _llm_only(spec: str, llm: dict) -> None:
    """--weight-dtype / --kv-cache-dtype / --llm-step are options of the LLM step export only."""
    if llm and llm != {"step": "none"}:
        raise SourceError(f"--weight-dtype, --kv-cache-dtype, --llm-step and --lora-slots apply to LLMs exported as step functions "
                          f"(a GGUF, or a Hugging Face causal-LM directory); {spec} is not one: use --dtype instead")


def _load_path(path: str, tdtype, quant=None, llm: dict | None = None) -> Source:
    llm = llm or {}
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SourceError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
        if is_compressed_tensors(_read_json(os.path.join(path, "config.json")) or {}):
            return _compressed(path, tdtype, quant, llm)
        src = hf_directory(path, tdtype, llm, quant)
        if src.model.get("task") != "causal-lm":
            _llm_only(path, llm)
        return src
    if path.endswith(".pt2"):
        _llm_only(path, llm)
        return _load_pt2(path, tdtype)
    if path.endswith(".gguf"):
        step = llm.pop("step", "auto")
        if step not in ("auto", "generic"):
            raise SourceError(f"--llm-step {step}: {path} is a GGUF, which exports as an LLM step (auto or generic)")
        return _gguf(path, tdtype, quant, llm)
    raise SourceError(f"{path}: unknown checkpoint type; expected a HF directory, a .pt2 or a .gguf file")


def _gguf(path: str, tdtype, quant: QuantRequest | None, llm: dict) -> Source:
    """A GGUF through the generic step: its config and tokenizer as a Hugging Face directory (a private
    temp dir, removed once loaded; the source holds its tokenizer files' bytes), its weights
    dequantized in memory, exported like a directory; with `--quantize gguf` the module swap at load
    takes the file's own blocks (QuantRequest.stored; a mixture of experts' stacks: QuantRequest.experts)."""
    import pathlib
    import shutil
    import tempfile

    ckpt = load_gguf(path)
    native = quant is not None and quant.config.native
    if native:
        quant = dataclasses.replace(quant, stored=lambda model: stored_by_module(model, ckpt, quant.config),
                                    experts=lambda model: stored_experts(model, ckpt, quant.config))
    out = tempfile.mkdtemp(prefix="hloserve-gguf-hf-")
    try:
        src = hf_causal.from_hf_directory(write_hf_directory(ckpt, out), tdtype, state_dict=ckpt.materialize(),
                                          quantize=quant, **llm)
        src.files = {name: pathlib.Path(p).read_bytes() for name, p in src.files.items()}   # the directory goes now
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if ckpt.config.get("rope_freq_factors"):   # llama.cpp's form of Llama 3 RoPE scaling
        for model in {id(e.module.model): e.module.model for e in src.entries}.values():
            hf_causal.divide_rope_frequencies(model, ckpt.config["rope_freq_factors"], path)
    if native:
        src.description = f"GGUF {os.path.basename(path)} ({quant.config.spec}: its own blocks), {src.description}"
        return src
    src.description = f"GGUF {os.path.basename(path)} dequantized, {src.description}"
    return src


def _compressed(path: str, tdtype, quant: QuantRequest | None, llm: dict) -> Source:
    """A compressed-tensors directory (llm-compressor's W4A16, W8A16, W8A8, ...) through the generic
    step: its quantized modules keep their integers and scales (exporter/compressed_tensors), its other
    weights load as floats, except an input embedding table tied to the LM head (llm-compressor leaves
    both 16-bit): stored once in int8 with a scale per row, read by the lookups and the head, unless
    --keep-16bit-embedding (llm["keep_table"]). `--quantize SPEC` quantizes all the others (the
    embedding, the head) in SPEC instead."""
    ckpt = open_checkpoint(path)
    if llm.get("step", "auto") not in ("auto", "generic"):
        raise SourceError(f"--llm-step {llm['step']}: {path} is a compressed-tensors checkpoint, which exports as an "
                          f"LLM step (auto or generic)")
    keep_table = llm.get("keep_table", False)
    llm = {k: v for k, v in llm.items() if k not in ("step", "keep_table")}
    if quant is None:
        quant = QuantRequest(QuantConfig(INT8, spec="compressed-tensors", native=True), only_stored=True,
                             table=not keep_table)
    quant = dataclasses.replace(quant, stored=lambda model: ckpt.stored_by_module(model, quant.config))
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    cls = next((getattr(transformers, a) for a in config.architectures or [] if hasattr(transformers, a)), None)
    if cls is None or not _is_causal_lm(cls, config):
        raise SourceError(f"{path}: a compressed-tensors checkpoint of {config.architectures or config.model_type}; "
                          f"hloserve imports compressed-tensors causal LMs (the LLM step) only")
    src = hf_causal.from_hf_directory(path, tdtype, state_dict=ckpt.float_state_dict(tdtype), quantize=quant, **llm)
    kept = {"format": "compressed-tensors", "groups": ckpt.plan.describe(), "modules": len(ckpt.quantized)}
    rest = {"spec": "compressed-tensors", "native": True, "tied_table": "int8 per row" if quant.table else "16-bit"} \
        if quant.only_stored else src.model["quantization"]
    src.model["quantization"] = {**rest, "checkpoint": kept}
    src.description = (f"compressed-tensors {os.path.basename(os.path.normpath(path))} ({'; '.join(ckpt.plan.describe())}: "
                       f"its own integers and scales), {src.description}")
    return src


def _load_pt2(path: str, tdtype) -> Source:
    try:
        ep = torch.export.load(path)
    except Exception as e:  # noqa: BLE001
        raise SourceError(f"{path} is not a readable torch.export .pt2 file: {type(e).__name__}: {e}") from e
    if tdtype != torch.float32:
        raise SourceError(f"{path}: --dtype applies before capture; re-save the .pt2 in {tdtype}")
    drop_derived_ranges(ep)
    # A .pt2 keeps no Dim names (torch names its symbols s0, s77, ...): each root dim is named after
    # the first input and axis it appears in (x_0); `--dynamic x:0=batch` names it otherwise.
    user = [n for n, spec in zip([n for n in ep.graph.nodes if n.op == "placeholder"], ep.graph_signature.input_specs)
            if spec.kind.name == "USER_INPUT"]
    names = [n.name for n in user]
    dims: dict[str, torch.export.Dim] = {}
    dynamic = []
    for node in user:
        val = node.meta.get("val")
        spec = {}
        for d, size in enumerate(getattr(val, "shape", ())):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and len(expr.free_symbols) == 1 and expr == next(iter(expr.free_symbols)):
                sym = str(expr)
                if sym not in dims:
                    dims[sym] = torch.export.Dim(f"{node.name}_{d}")
                    setattr(dims[sym], AUTO_NAME, True)     # --dynamic names win over these
                spec[d] = dims[sym]
        dynamic.append(spec or None)
    entry = EntryPoint("forward", program=decompose(ep), input_names=names, dynamic_shapes=tuple(dynamic))
    return Source(f"torch.export program {os.path.basename(path)}", [entry], {"task": "generic"})


def _load_factory(spec: str, tdtype) -> Source:
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:   # the console script leaves the current dir out
        sys.path.insert(0, os.getcwd())
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
    import inspect
    names = list(inspect.signature(module.forward).parameters)[:len(args)]
    if isinstance(dynamic, dict):
        dynamic = tuple(dynamic.get(n) for n in names)
    return Source(f"{spec}()", [EntryPoint("forward", module, args, dynamic, input_names=names)], {"task": "generic"})


# -- Hugging Face ----------------------------------------------------------
class _Positional(torch.nn.Module):
    """Calls a HF model with named inputs given positionally; returns chosen outputs as a tuple.

    torch.export sees `forward(*args)`, so the artifact's inputs keep the order
    of `input_names`. `fixed` are keyword arguments passed on every call
    (use_cache=False: a serving export never returns a KV cache it cannot name).
    """

    def __init__(self, model: torch.nn.Module, input_names: Sequence[str], output_names: Sequence[str],
                 fixed: dict[str, Any] | None = None):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.fixed = dict(fixed or {})

    def forward(self, *args):
        out = self.model(**dict(zip(self.input_names, args)), **self.fixed, return_dict=True)
        missing = [k for k in self.output_names if k not in out]
        if missing:
            raise SourceError(f"{type(self.model).__name__} returned {list(out.keys())}, without {missing}; "
                              f"pick output names from those")
        return tuple(out[k] for k in self.output_names)


def _conv_hop(config) -> tuple[int, int]:
    """(receptive field, hop) in samples of a wav2vec2-style conv feature encoder."""
    field, hop = 1, 1
    for k, s in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        field, hop = (field - 1) * s + k, hop * s
    return field, hop


# architecture suffix -> (task, outputs) for heads whose outputs are not `logits`
_HEADS = {
    "ForCausalLM": ("causal-lm", ["logits"]),
    "LMHeadModel": ("causal-lm", ["logits"]),
    "ForQuestionAnswering": ("question-answering", ["start_logits", "end_logits"]),
}


def _head(arch: str, base_task: str) -> tuple[str, list[str]]:
    """(task, output names) of a HF class: base models give last_hidden_state, heads (`...ForX`) logits."""
    for suffix, found in _HEADS.items():
        if arch.endswith(suffix):
            return found[0], list(found[1])
    if "For" in arch:
        head = arch[arch.index("For") + 3:]  # ImageClassification -> image-classification
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", head).lower(), ["logits"]
    return base_task, ["last_hidden_state"]


def hf_entry(model: torch.nn.Module, config, *, batch=(1, 64), seq=(1, 512),
             samples=(1, 16000 * 30)) -> tuple[EntryPoint, dict]:
    """An entry point for a HF model by its main input (text, vision, audio); returns (entry, model metadata).

    Dynamic dims: `batch` always; `seq` (capped at the config's max positions) for
    text; for raw waveforms `frames`, the encoder's output length, with `samples`
    = hop * (frames - 1) + receptive field. Images and spectrograms keep the
    config's size (the models fix it). Outputs: `last_hidden_state` for base
    models, `logits` for heads (start/end logits for question answering).
    """
    import inspect
    Dim = torch.export.Dim
    model = model.eval()
    b = Dim("batch", min=batch[0], max=batch[1])
    main = getattr(model, "main_input_name", "input_ids")
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    accepts = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(0)
    if main == "input_ids":
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or seq[1]
        s = Dim("seq", min=seq[0], max=min(seq[1], max_pos))
        ids = torch.randint(3, config.vocab_size, (2, 16), generator=g)
        names, args, dyn = ["input_ids", "attention_mask"], [ids, torch.ones_like(ids)], [{0: b, 1: s}, {0: b, 1: s}]
        if "token_type_ids" in accepts and getattr(config, "type_vocab_size", 0):
            names.append("token_type_ids"), args.append(torch.zeros_like(ids)), dyn.append({0: b, 1: s})
        base = "text-encoder"
    elif main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        chans = getattr(config, "num_channels", 3)
        names, args, dyn = ["pixel_values"], [torch.randn(2, chans, size, size, generator=g)], [{0: b}]
        base = "image"
    elif main == "input_features":
        mel = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        names, args, dyn = ["input_features"], [torch.randn(2, mel, frames, generator=g)], [{0: b}]
        base = "audio-encoder"
    elif main == "input_values" and hasattr(config, "conv_kernel"):
        # samples = hop * (frames - 1) + field: exactly `frames` encoder frames, so the
        # graph's dims are `frames`, not floor divisions of a free length (torch.export
        # cannot prove the encoder's `frames > 1` stride guards over those, and jax
        # cannot prove `batch*(frames-1) >= 0` reshapes). At least two frames (the guard).
        field, hop = _conv_hop(config)
        low = max(2, -(-(samples[0] - field) // hop) + 1)
        frames = Dim("frames", min=low, max=max(low, (samples[1] - field) // hop + 1))
        example = hop * (2 * low - 1) + field
        names, args, dyn = ["input_values"], [torch.randn(2, example, generator=g)], [{0: b, 1: hop * frames + (field - hop)}]
        base = "audio-encoder"
    elif main == "input_values" and hasattr(config, "max_length") and hasattr(config, "num_mel_bins"):
        # Audio Spectrogram Transformer: (batch, max_length frames, mel bins), fixed by its position table
        spec = torch.randn(2, config.max_length, config.num_mel_bins, generator=g)
        names, args, dyn = ["input_values"], [spec], [{0: b}]
        base = "audio-encoder"
    else:
        raise SourceError(f"{archs[0]}: main input {main!r} is not supported yet (token ids, pixel values, "
                          f"mel features, wav2vec2-style waveforms and AST spectrograms are)")
    task, outputs = _head(archs[0], base)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    args = [a.to(dtype) if a.is_floating_point() else a for a in args]
    fixed = {"use_cache": False} if "use_cache" in accepts else {}
    wrapped = _Positional(model, names, outputs, fixed)
    entry = EntryPoint("forward", wrapped, tuple(args), tuple(dyn), input_names=names, output_names=outputs,
                       paddable=("batch",))
    return entry, {"task": task, "architecture": archs[0], "config": config.to_dict()}


def hf_directory(path: str, tdtype, llm: dict | None = None, quant: QuantRequest | None = None) -> Source:
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
    llm = dict(llm or {})
    step = llm.pop("step", "auto")
    causal = _is_causal_lm(cls, config) and step != "none"
    why_not = None
    if causal or step == "generic":
        try:
            hf_causal.check_supported(cls, config)
        except SourceError as e:
            if step == "generic":
                raise
            why_not = str(e)
        else:
            return hf_causal.from_hf_directory(path, tdtype, quantize=quant, **llm)
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise SourceError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first")
    model = cls.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa")
    entry, meta = hf_entry(model, config)
    if why_not:
        meta["llm_note"] = (f"exported as a plain forward (TF Serving predict API), not an LLM step with a paged "
                            f"KV cache: {why_not}")
    files = {f: os.path.join(path, f) for f in (TOKENIZER, "tokenizer_config.json", "special_tokens_map.json",
                                               "vocab.txt") if os.path.exists(os.path.join(path, f))}
    meta["text"] = text_spec(path)
    pooling = os.path.join(path, "1_Pooling", "config.json")
    if os.path.exists(pooling):   # a sentence-transformers checkpoint: how its embeddings are made
        with open(pooling) as f:
            meta["pooling"] = json.load(f)
        modules = _read_json(os.path.join(path, "modules.json")) or []
        meta["pooling"]["normalize"] = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        st_config = _read_json(os.path.join(path, "sentence_bert_config.json")) or {}
        if isinstance(st_config.get("max_seq_length"), int):
            meta["pooling"]["max_seq_length"] = st_config["max_seq_length"]
    return Source(f"Hugging Face {meta['architecture']} from {path}", [entry], meta, files)


def _is_causal_lm(cls, config) -> bool:
    """Whether transformers lists `cls` as a causal LM (its auto mapping), e.g. GPT2LMHeadModel."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ())
    names = (names,) if isinstance(names, str) else tuple(names)
    return getattr(cls, "__name__", "") in names or getattr(cls, "__name__", "").endswith("ForCausalLM")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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
