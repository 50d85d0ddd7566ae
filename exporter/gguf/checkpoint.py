"""GGUF checkpoints (llama.cpp's format) as Hugging Face-style config, weights and tokenizer.

Interface
---------
    ckpt = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")        # reads metadata only (memory-mapped)

    ckpt.config            dict, transformers-style for LlamaForCausalLM / Qwen2ForCausalLM:
                           model_type, architectures, hidden_size, num_hidden_layers,
                           num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
                           rms_norm_eps, rope_theta, rope_scaling (None or {"rope_type", "factor",
                           "original_max_position_embeddings", ...}), vocab_size,
                           max_position_embeddings, tie_word_embeddings, attention_bias (q_proj has a
                           bias), mlp_bias,
                           hidden_act, bos_token_id, eos_token_id, pad_token_id, unk_token_id;
                           plus "rope_freq_factors": [float] * (head_dim // 2) when the file has a
                           rope_freqs tensor (Llama 3.x: per-frequency divisors of the RoPE inverse
                           frequencies, in place of HF's rope_scaling "llama3" parameters).
    ckpt.tensors           Mapping HF name -> GGUFTensor, in file order. Names follow HF
                           LlamaForCausalLM: model.embed_tokens.weight,
                           model.layers.N.{input_layernorm,post_attention_layernorm}.weight,
                           model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias where the file has one),
                           model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight,
                           lm_head.weight (only when the file has output.weight, i.e. untied).
    ckpt.state_dict(reporter=None)
                           LazyStateDict: Mapping HF name -> torch.float32 tensor, dequantized on
                           each access (nothing is cached; read each name once); prints a progress
                           line per quarter of the bytes (stderr; pass progress.QUIET to silence).
    ckpt.materialize(reporter=None, dtype=torch.float32)
                           dict HF name -> tensor, all dequantized, with a progress bar (stderr;
                           pass progress.QUIET to silence).
    ckpt.tokenizer_json    str, a `tokenizers` tokenizer.json (byte-level BPE; see tokenizer.py).
    ckpt.chat_template     str | None (tokenizer.chat_template).
    ckpt.special_tokens    SpecialTokens: bos/eos/unk/pad ids and strings, add_bos_token, add_eos_token.
    ckpt.metadata          dict of the file's scalar metadata (general.*, {arch}.*), for the manifest.
    hf_config(ckpt)        ckpt.config with BOS/EOS ids filled from the tokenizer's special tokens
    write_hf_directory(ckpt, out)   the checkpoint as a Hugging Face directory (config, tokenizer,
                           chat template; weights from ckpt.materialize()): what the generic step exports

    t = ckpt.tensors[name]  a GGUFTensor (exporter/gguf/tensor.py): its stored blocks, fields, dequantize()
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import types
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from ..errors import SourceError
from .tensor import GGUFTensor
from .tokenizer import GGUFVocab, gguf_tokenizer_json

from hloserve.runtime.progress import Reporter

if TYPE_CHECKING:
    import torch

# llama.cpp architecture -> (HF model_type, HF architecture class, q/k rows permuted for NORM RoPE)
ARCHITECTURES: Mapping[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors that are not weights of the HF model; their contents go into the config instead.
_CONFIG_TENSORS = ("rope_freqs.weight",)


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Special token ids (None when the file has none) and their strings."""
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool
    add_eos_token: bool


class LazyStateDict(Mapping[str, "torch.Tensor"]):
    """HF name -> float32 torch tensor, dequantized from the file on each access.

    Progress: the reporter gets a stage line each time another quarter of the file's bytes has
    been dequantized (first access of each name counts).
    """

    def __init__(self, tensors: Mapping[str, GGUFTensor], reporter: "Reporter"):
        self._tensors = tensors
        self._reporter = reporter
        self._seen: set[str] = set()
        self._done = 0
        self._total = sum(t.nbytes for t in tensors.values()) or 1

    def __getitem__(self, name: str) -> "torch.Tensor":
        import torch
        value = torch.from_numpy(self._tensors[name].dequantize())
        if name not in self._seen:
            self._seen.add(name)
            before = 4 * self._done // self._total
            self._done += self._tensors[name].nbytes
            if 4 * self._done // self._total > before:
                self._reporter.stage(f"dequantized {len(self._seen)}/{len(self._tensors)} GGUF tensors "
                                     f"({100 * self._done // self._total}% of {self._total / 2**20:.0f} MiB)")
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file read as a Hugging Face-style checkpoint. See the module docstring."""
    path: str
    architecture: str
    config: dict
    tensors: Mapping[str, GGUFTensor]
    tokenizer_json: str
    chat_template: str | None
    special_tokens: SpecialTokens
    metadata: dict

    def state_dict(self, reporter: "Reporter | None" = None) -> LazyStateDict:
        """Lazily dequantized weights; progress lines go to `reporter` (default: stderr; progress.QUIET: none)."""
        return LazyStateDict(self.tensors, Reporter() if reporter is None else reporter)

    def materialize(self, reporter: "Reporter | None" = None, dtype: "torch.dtype | None" = None
                    ) -> dict[str, "torch.Tensor"]:
        """All weights dequantized (float32, or cast to `dtype`), with a progress bar."""
        import torch
        reporter = Reporter() if reporter is None else reporter
        counts = collections.Counter(t.ggml_type for t in self.tensors.values())
        kinds = ", ".join(f"{n} {k}" for k, n in counts.most_common())
        out: dict[str, torch.Tensor] = {}
        total = sum(t.nbytes for t in self.tensors.values())
        with reporter.bar(total, f"dequantizing {len(self.tensors)} GGUF tensors ({kinds})") as advance:
            for name, t in self.tensors.items():
                value = torch.from_numpy(t.dequantize())
                out[name] = value.to(dtype) if dtype is not None and dtype != torch.float32 else value
                advance(t.nbytes)
        return out


def load_gguf(path: str) -> GGUFCheckpoint:
    """Read a GGUF file's metadata, tensor table and tokenizer; tensors stay memory-mapped."""
    import gguf

    if not os.path.isfile(path):
        raise SourceError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader raises bare ValueError/struct errors
        raise SourceError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    where = os.path.basename(path)
    fields = reader.fields

    def field(key: str, default: Any = None) -> Any:
        f = fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise SourceError(f"{where}: general.architecture is {arch!r}; supported GGUF architectures are "
                          f"{sorted(ARCHITECTURES)} (Mistral files use 'llama'). Add the mapping in "
                          f"exporter/gguf/checkpoint.py ARCHITECTURES")
    model_type, hf_arch, permuted = ARCHITECTURES[arch]

    raw_tensors = {t.name: t for t in reader.tensors}
    config = _config(field, arch, model_type, hf_arch, raw_tensors, where)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, GGUFTensor] = {}
    unknown = []
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        hf_name = _hf_name(t.name)
        if hf_name is None:
            unknown.append(t.name)
            continue
        qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 (the contiguous dim) first
        perm = None
        if permuted and re.search(r"\.attn_[qk]\.(weight|bias)$", t.name):
            n = heads if ".attn_q." in t.name else kv_heads
            perm = _unpermute_rows(shape[0], n, where, t.name)
        tensors[hf_name] = GGUFTensor(hf_name, t.name, qtype.name, int(qtype), shape, block_size, type_size,
                                      t.data, perm, int(t.data_offset))
    if unknown:
        raise SourceError(f"{where}: {len(unknown)} tensor(s) have no Hugging Face {hf_arch} name: "
                          f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}. Mixture-of-experts and "
                          f"other variants are not supported; extend _LAYER_NAMES in exporter/gguf/checkpoint.py")
    for required in ("model.embed_tokens.weight", "model.norm.weight"):
        if required not in tensors:
            raise SourceError(f"{where}: tensor {required} ({_gguf_name_of(required)}) is missing; the file is "
                              f"incomplete or not a {hf_arch} checkpoint")

    vocab = _vocab(field)
    special = SpecialTokens(
        vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id,
        *(vocab.tokens[i] if i is not None and 0 <= i < len(vocab.tokens) else None
          for i in (vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id)),
        vocab.add_bos_token, vocab.add_eos_token)
    if config["vocab_size"] != len(vocab.tokens):
        raise SourceError(f"{where}: {len(vocab.tokens)} tokenizer tokens but vocab_size {config['vocab_size']}")
    metadata = {}
    for key, f in fields.items():
        if key.startswith("GGUF.") or key.startswith("tokenizer."):
            continue
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            metadata[key] = f.contents()
    metadata["tensor_types"] = dict(collections.Counter(t.ggml_type for t in tensors.values()))
    return GGUFCheckpoint(
        path=os.path.abspath(path), architecture=arch, config=config,
        tensors=types.MappingProxyType(tensors), tokenizer_json=gguf_tokenizer_json(vocab, where=where),
        chat_template=field("tokenizer.chat_template"), special_tokens=special, metadata=metadata)


def hf_config(ckpt: "GGUFCheckpoint") -> dict:
    """The GGUF's config in transformers config.json form, its BOS/EOS ids filled from the
    tokenizer's special tokens where the config has none."""
    raw = dict(ckpt.config)
    st = ckpt.special_tokens
    for key, value in (("eos_token_id", st.eos_token_id), ("bos_token_id", st.bos_token_id)):
        if value is not None and raw.get(key) is None:
            raw[key] = value
    return raw


def write_hf_directory(ckpt: "GGUFCheckpoint", out: str) -> str:
    """A GGUF checkpoint (load_gguf) as a Hugging Face directory `out`, its weights aside (what
    transformers' `gguf_file=` load makes of it, through our reader): config.json, tokenizer.json and
    a tokenizer_config.json with the chat template and add_bos_token. The weights stay in the file:
    `ckpt.materialize()` gives them in HF names, float32 (the generic step loads them from memory).
    A rope_freqs tensor has no config.json form: the caller divides the loaded model's rotary
    frequencies by ckpt.config["rope_freq_factors"]."""
    raw = hf_config(ckpt)
    raw.pop("rope_freq_factors", None)
    st = ckpt.special_tokens
    raw["torch_dtype"] = "float32"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write(ckpt.tokenizer_json)
    tok_cfg: dict = {"chat_template": ckpt.chat_template} if ckpt.chat_template else {}
    if st.add_bos_token is not None:
        tok_cfg["add_bos_token"] = st.add_bos_token
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    return out


def _config(field, arch: str, model_type: str, hf_arch: str, raw_tensors: dict, where: str) -> dict:
    def need(key: str):
        value = field(f"{arch}.{key}")
        if value is None:
            raise SourceError(f"{where}: metadata {arch}.{key} is missing; the file is not a complete {arch} GGUF")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = field(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts
        if len(set(kv_heads)) != 1:
            raise SourceError(f"{where}: {arch}.attention.head_count_kv differs between layers ({kv_heads}); "
                              f"only uniform attention is supported")
        kv_heads = kv_heads[0]
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(field(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise SourceError(f"{where}: rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary "
                          f"embeddings) is not supported for {arch}")
    embed = raw_tensors.get("token_embd.weight")
    vocab_size = field(f"{arch}.vocab_size") or (int(embed.shape[-1]) if embed is not None else 0)
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "intermediate_size": int(need("feed_forward_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(field, arch),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in raw_tensors,
        "attention_bias": "blk.0.attn_q.bias" in raw_tensors,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "unk_token_id": field("tokenizer.ggml.unknown_token_id"),
    }
    freqs = raw_tensors.get("rope_freqs.weight")
    if freqs is not None:
        config["rope_freq_factors"] = [float(x) for x in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]
    return config


def _rope_scaling(field, arch: str) -> dict | None:
    kind = field(f"{arch}.rope.scaling.type")
    factor = field(f"{arch}.rope.scaling.factor")
    if kind is None and field(f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", field(f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor if factor is not None else 1.0)}
    original = field(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn = field(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = field(f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def _vocab(field) -> GGUFVocab:
    def opt_int(key):
        v = field(key)
        return None if v is None else int(v)
    tokens = field("tokenizer.ggml.tokens") or []
    return GGUFVocab(
        model=field("tokenizer.ggml.model", "none"),
        pre=field("tokenizer.ggml.pre"),
        tokens=tuple(tokens),
        token_types=tuple(int(x) for x in (field("tokenizer.ggml.token_type") or [1] * len(tokens))),
        merges=tuple(field("tokenizer.ggml.merges") or ()),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(field("tokenizer.ggml.add_eos_token", False)),
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        unk_token_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _gguf_name_of(hf_name: str) -> str:
    return next((g for g, h in _GLOBAL_NAMES.items() if h == hf_name), hf_name)


def _unpermute_rows(rows: int, n_head: int, where: str, name: str) -> np.ndarray:
    """Row order undoing llama.cpp's `permute(w, n_head)`: HF row i is file row perm[i].

    llama.cpp writes w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); reading the file rows
    as (n_head, half, 2) and swapping back gives the HF order.
    """
    if rows % (2 * n_head):
        raise SourceError(f"{where}: {name} has {rows} rows, not a multiple of 2 * {n_head} heads")
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows)  # (n_head, 2, half) -> rows
