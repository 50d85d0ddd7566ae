"""Llama-family checkpoints -> the paged-cache step entry points (exporter.entry.Source).

    from_hf_directory(path, tdtype) -> Source   config.json + *.safetensors (HF names)
    from_gguf(path, tdtype) -> Source           a llama.cpp GGUF file, dequantized

Both build a `LlamaWeights` (stacked per-layer tensors, see llama.py) and export
two functions of one artifact sharing every weight: `prefill` and `decode`
(the step contract in llama.py and docs/architecture.md).

What this module relies on from the GGUF reader (exporter/models/gguf.py):

    ckpt = hloserve.exporter.models.gguf.load_gguf(path)
    ckpt.config          dict in transformers config.json form (model_type "llama" | "qwen2",
                         num_hidden_layers, ..., rope_scaling, tie_word_embeddings,
                         attention_bias, bos_token_id, eos_token_id; optional
                         "rope_freq_factors" [head_dim/2] from a rope_freqs tensor)
    ckpt.state_dict()    Mapping HF name -> float32 torch tensor (dequantized on access; we read
                         each name once), q/k rows already in HF (rotate_half) order
    ckpt.tokenizer_json  str: a `tokenizers` tokenizer.json
    ckpt.chat_template   str | None
    ckpt.special_tokens  .bos_token_id, .eos_token_id, .pad_token_id, .add_bos_token (ids may be None)

Manifest `model` metadata (both sources): task "causal-lm", architecture,
config (LlamaConfig.to_json()), llm (llama.llm_spec, the typed contract: layers, heads,
kv_heads, head_dim, vocab, block_size, max_context, eos/bos ids, cache layout),
tokenizer (file name in the artifact), chat_template, add_bos_token, and generation_defaults
(from an HF directory's generation_config.json, when it samples).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Mapping

import torch

from .. import dtypes
from ..entry import Source
from ..errors import SourceError
from .llama import LlamaConfig, LlamaWeights, llm_spec, step_entries
from .step import StepExportOptions

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja")


def default_options(cfg: LlamaConfig, **overrides) -> StepExportOptions:
    """Block size 16, context up to the model's max positions (capped at 32768)."""
    opts = dict(max_context=min(cfg.max_position_embeddings, 32768))
    opts.update(overrides)
    return StepExportOptions(**opts)


def source_from_weights(weights: LlamaWeights, description: str, *, opts: StepExportOptions | None = None,
                        architecture: str = "", tokenizer_file: str | None = None,
                        chat_template: str | None = None, add_bos_token: bool | None = None,
                        files: Mapping[str, str] | None = None,
                        generation_defaults: Mapping[str, float] | None = None) -> Source:
    """A Source exporting `weights` as the prefill/decode step functions."""
    cfg = weights.cfg
    opts = opts or default_options(cfg)
    dtype = weights.dtype
    model = {
        "task": "causal-lm", "architecture": architecture or f"{cfg.model_type}ForCausalLM",
        "config": cfg.to_json(), "llm": llm_spec(cfg, opts, dtype, weights).to_json(),
        "tokenizer": tokenizer_file, "chat_template": chat_template,
    }
    if add_bos_token is not None:
        model["add_bos_token"] = add_bos_token
    if generation_defaults:
        model["generation_defaults"] = dict(generation_defaults)
    if getattr(weights, "weight_dtype", dtype) != dtype:
        model["weight_dtype"] = dtypes.artifact_name_of_torch(weights.weight_dtype)
    return Source(description, step_entries(weights, opts), model, dict(files or {}),
                  weight_quant=weights.weight_quant if getattr(weights, "bits_dtype", None) else None)


# -- Hugging Face directory -------------------------------------------------------
def _safetensors_getter(path: str) -> tuple[Callable[[str], torch.Tensor], list[str]]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise SourceError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first")
    where: dict[str, str] = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as h:
            for k in h.keys():
                where[k] = f
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(os.path.join(path, f), framework="pt")
        return handles[f].get_tensor(name)

    return get, list(where)


def _chat_template(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(tc):
        with open(tc) as f:
            tmpl = json.load(f).get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), tmpl[0]["template"] if tmpl else None)
        return tmpl
    return None


def from_hf_directory(path: str, tdtype: torch.dtype = torch.float32, *,
                      opts: StepExportOptions | None = None, weight_dtype: torch.dtype | None = None,
                      kv_dtype: torch.dtype | None = None) -> Source:
    """A HF LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM directory -> Source."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{cfg_path} cannot be read: {e}") from e
    cfg = LlamaConfig.from_hf(raw)
    get, names = _safetensors_getter(path)
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        raise SourceError(f"{path}: config says tie_word_embeddings=false but there is no lm_head.weight")
    weights = LlamaWeights.from_hf_tensors(cfg, get, names, tdtype, weight_dtype)
    files = {f: os.path.join(path, f) for f in _TOKENIZER_FILES if os.path.exists(os.path.join(path, f))}
    archs = raw.get("architectures") or []
    add_bos = None
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            add_bos = json.load(f).get("add_bos_token")
    return source_from_weights(
        weights, f"Hugging Face {archs[0] if archs else cfg.model_type} from {path} (paged-cache step)",
        opts=opts or default_options(cfg, kv_dtype=kv_dtype), architecture=archs[0] if archs else "",
        tokenizer_file="tokenizer.json" if "tokenizer.json" in files else None,
        chat_template=_chat_template(path), add_bos_token=add_bos, files=files,
        generation_defaults=_generation_defaults(path))


# sampling fields of generation_config.json a server applies when a request leaves them out (vLLM does the same)
_GENERATION_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


def _generation_defaults(path: str) -> dict[str, float]:
    """The checkpoint's recommended sampling (generation_config.json), only when it samples (do_sample)."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            gen = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    if not gen.get("do_sample", False):
        return {}
    return {k: gen[k] for k in _GENERATION_FIELDS if isinstance(gen.get(k), (int, float))}


# -- GGUF ---------------------------------------------------------------------------
def _gguf_config(ckpt) -> dict:
    """The GGUF's config in transformers config.json form, its BOS/EOS ids filled from the
    tokenizer's special tokens where the config has none."""
    raw = dict(ckpt.config)
    st = ckpt.special_tokens
    for key, value in (("eos_token_id", st.eos_token_id), ("bos_token_id", st.bos_token_id)):
        if value is not None and raw.get(key) is None:
            raw[key] = value
    return raw


def gguf_as_hf_directory(ckpt, out: str) -> str:
    """A GGUF checkpoint (gguf.load_gguf) as a Hugging Face directory `out` (what transformers'
    `gguf_file=` load makes of it, through our reader): config.json, model.safetensors of the
    dequantized f32 tensors in HF names, tokenizer.json and a tokenizer_config.json with the chat
    template and add_bos_token. The generic step exports it. A rope_freqs tensor has no config.json
    form: the caller divides the loaded model's rotary frequencies by ckpt.config["rope_freq_factors"]."""
    from safetensors.torch import save_file

    raw = _gguf_config(ckpt)
    raw.pop("rope_freq_factors", None)
    st = ckpt.special_tokens
    raw["torch_dtype"] = "float32"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    sd = ckpt.state_dict()
    save_file({name: sd[name].contiguous() for name in list(sd)}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write(ckpt.tokenizer_json)
    tok_cfg: dict = {"chat_template": ckpt.chat_template} if ckpt.chat_template else {}
    if st.add_bos_token is not None:
        tok_cfg["add_bos_token"] = st.add_bos_token
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    return out


def from_gguf(path: str, tdtype: torch.dtype = torch.float32, *, opts: StepExportOptions | None = None,
              build_weights: Callable | None = None, weight_dtype: torch.dtype | None = None,
              kv_dtype: torch.dtype | None = None) -> Source:
    """A llama.cpp GGUF file (llama / qwen2 architectures) -> Source, weights dequantized to `tdtype`.

    build_weights(cfg, ckpt) -> weights replaces the dequantization (e.g.
    models/gguf_quant.llama_from_gguf keeps the file's quantized blocks).
    """
    from .gguf import load_gguf

    ckpt = load_gguf(path)
    raw = _gguf_config(ckpt)
    st = ckpt.special_tokens
    cfg = LlamaConfig.from_hf(raw)
    if build_weights is not None:
        weights = build_weights(cfg, ckpt)
    else:
        sd = ckpt.state_dict()
        weights = LlamaWeights.from_hf_tensors(cfg, sd.__getitem__, list(sd), tdtype, weight_dtype)
    # Source.files copies from paths: write the GGUF's tokenizer to a private temp dir
    tmp = tempfile.mkdtemp(prefix="hloserve-gguf-tok-")
    tok_path = os.path.join(tmp, "tokenizer.json")
    with open(tok_path, "w") as f:
        f.write(ckpt.tokenizer_json)
    archs = raw.get("architectures") or []
    return source_from_weights(
        weights, f"GGUF {ckpt.architecture} from {os.path.basename(path)} (dequantized, paged-cache step)",
        opts=opts or default_options(cfg, kv_dtype=kv_dtype), architecture=archs[0] if archs else "",
        tokenizer_file="tokenizer.json",
        chat_template=ckpt.chat_template, add_bos_token=st.add_bos_token, files={"tokenizer.json": tok_path})
