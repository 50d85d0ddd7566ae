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
                           Mixtures of experts (qwen3moe, qwen2moe, a llama file with routers:
                           Mixtral): transformers' experts fields too (experts.py moe_config).
    ckpt.tensors           Mapping HF name -> GGUFTensor, in file order. Names follow HF
                           LlamaForCausalLM: model.embed_tokens.weight,
                           model.layers.N.{input_layernorm,post_attention_layernorm}.weight,
                           model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias where the file has one),
                           model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight,
                           lm_head.weight (only when the file has output.weight, i.e. untied).
                           A mixture of experts' layer: model.layers.N.mlp.gate.weight (the router)
                           and the 3-D stacks model.layers.N.mlp.experts.{gate,up,down}_proj [E, out, in]
                           (Qwen2-MoE: mlp.shared_expert.*, mlp.shared_expert_gate.weight).
    ckpt.state_dict(reporter=None)
                           LazyStateDict: Mapping HF name -> torch.float32 tensor, dequantized on
                           each access (nothing is cached; read each name once); prints a progress
                           line per quarter of the bytes (stderr; pass progress.QUIET to silence).
    ckpt.materialize(reporter=None, dtype=torch.float32)
                           dict HF name -> tensor, all dequantized, with a progress bar (stderr;
                           pass progress.QUIET to silence); a layer's experts gate and up stacks
                           joined as transformers' mlp.experts.gate_up_proj (state_dict keeps them apart).
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

import gguf
import numpy as np
from hloserve.runtime.progress import Reporter

from ..errors import SourceError
from . import experts, validate
from .header import ARRAY, STRING, TensorInfo, read_header, show
from .tensor import GGUFTensor
from .tokenizer import GGUFVocab, gguf_tokenizer_json

if TYPE_CHECKING:
    import torch

# llama.cpp architecture -> (HF model_type, HF architecture class, q/k rows permuted for NORM RoPE)
ARCHITECTURES: Mapping[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    **experts.MOE_ARCHITECTURES,
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
    **experts.EXPERT_NAMES,
    **experts.SHARED_NAMES,
    **experts.QK_NORM_NAMES,
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
        """All weights dequantized (float32, or cast to `dtype`), with a progress bar; a layer's
        experts gate and up stacks joined into transformers' gate_up_proj (experts.merge_gate_up)."""
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
        return experts.merge_gate_up(out)


def load_gguf(path: str) -> GGUFCheckpoint:
    """Read a GGUF file's metadata, tensor table and tokenizer; tensors stay memory-mapped.

    The header is read with its counts checked against the file (header.py), and the config, the
    tensors and the vocabulary are checked against each other (validate.py) before anything is built
    from them: a damaged or mislabelled file is a one-line SourceError naming the field."""
    if not os.path.isfile(path):
        raise SourceError(f"{path}: no such GGUF file")
    header = read_header(path)
    where = os.path.basename(path)
    meta = validate.Metadata(header.fields, where)
    arch = meta.text("general.architecture", validate.REQUIRED)
    if arch not in ARCHITECTURES:
        raise SourceError(f"{where}: general.architecture is {show(arch)}; supported GGUF architectures are "
                          f"{sorted(ARCHITECTURES)} (Mistral and Mixtral files use 'llama'). Add the mapping in "
                          f"exporter/gguf/checkpoint.py ARCHITECTURES")
    infos = {t.name: t for t in header.tensors}
    model_type, hf_arch, permuted = experts.MIXTRAL if experts.is_mixtral(arch, infos) else ARCHITECTURES[arch]
    _check_names(infos, hf_arch, where)
    config = _config(meta, arch, model_type, hf_arch, infos, where)
    if arch in experts.MOE_ARCHITECTURES or model_type == experts.MIXTRAL[0]:
        config.update(experts.moe_config(meta, arch, infos))
    validate.check_layers(config, header.tensors, arch, where)
    validate.check_shapes(config, header.tensors, arch, where)
    validate.check_weight_types([t for t in header.tensors if t.name not in _CONFIG_TENSORS], _dequantizable(), where)
    vocab = _vocab(meta)
    validate.check_vocab(vocab, config, where, meta.array("tokenizer.ggml.scores", validate.FLOATS, "numbers"))
    config.update(bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
                  unk_token_id=vocab.unk_token_id)

    data = np.memmap(path, mode="r")
    if "rope_freqs.weight" in infos:
        config["rope_freq_factors"] = _rope_freq_factors(infos["rope_freqs.weight"], data, where)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, GGUFTensor] = {}
    for t in header.tensors:
        hf_name = _hf_name(t.name)
        if hf_name is None:   # a config tensor (rope_freqs)
            continue
        shape = experts.hf_shape(t.name, tuple(reversed(t.dims)))  # GGUF lists ne0 (the contiguous dim) first
        perm = None
        if permuted and re.search(r"\.attn_[qk]\.(weight|bias)$", t.name):
            perm = _unpermute_rows(shape[0], heads if ".attn_q." in t.name else kv_heads, where, t.name)
        tensors[hf_name] = GGUFTensor(hf_name, t.name, t.type_name, t.ggml_type, shape, t.block_size, t.type_size,
                                      _raw(data, t, shape), perm, t.start)
    special = SpecialTokens(
        vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id,
        *(None if i is None else vocab.tokens[i]
          for i in (vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id)),
        vocab.add_bos_token, vocab.add_eos_token)
    metadata = {key: f.value for key, f in header.fields.items()
                if not key.startswith("tokenizer.") and f.type != ARRAY}
    metadata["tensor_types"] = dict(collections.Counter(t.ggml_type for t in tensors.values()))
    return GGUFCheckpoint(
        path=os.path.abspath(path), architecture=arch, config=config,
        tensors=types.MappingProxyType(tensors), tokenizer_json=gguf_tokenizer_json(vocab, where=where),
        chat_template=meta.text("tokenizer.chat_template"), special_tokens=special, metadata=metadata)


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


def _check_names(infos: Mapping[str, TensorInfo], hf_arch: str, where: str) -> None:
    """Every tensor has an HF name (or is a config tensor); the embedding and final norm are there."""
    unknown = [show(n) for n in infos if n not in _CONFIG_TENSORS and _hf_name(n) is None]
    if unknown:
        raise SourceError(f"{where}: {len(unknown)} tensor(s) have no Hugging Face {hf_arch} name: "
                          f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}. Variants beyond "
                          f"{sorted(ARCHITECTURES)} (shared experts, ...) are not supported; extend _LAYER_NAMES in "
                          f"exporter/gguf/checkpoint.py")
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in infos:
            raise SourceError(f"{where}: tensor {required} ({_GLOBAL_NAMES[required]}) is missing; the file is "
                              f"incomplete or not a {hf_arch} checkpoint: download or convert it again")


def _config(meta: validate.Metadata, arch: str, model_type: str, hf_arch: str, infos: Mapping[str, TensorInfo],
            where: str) -> dict:
    """The transformers config from the file's {arch}.* metadata, each value typed and in range
    (validate.py); the vocabulary is token_embd's rows ({arch}.vocab_size, when given, must agree)."""
    hidden = meta.integer(f"{arch}.embedding_length", lo=1)
    heads = meta.integer(f"{arch}.attention.head_count", lo=1)
    kv_heads = validate.kv_head_count(meta, arch, heads)
    head_dim = validate.head_dim(meta, arch, hidden, heads)
    rope_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise SourceError(f"{where}: {arch}.rope.dimension_count = {rope_dim} but the head size is {head_dim}; "
                          f"partial rotary embeddings are not supported for {arch} (or the file is mislabelled: "
                          f"re-convert it)")
    vocab_size = infos["token_embd.weight"].dims[-1]
    stated = meta.integer(f"{arch}.vocab_size", None, lo=1)
    if stated is not None and stated != vocab_size:
        raise SourceError(f"{where}: {arch}.vocab_size = {stated} but token_embd.weight has {vocab_size} rows; "
                          f"{validate.MISLABELLED}")
    return {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": meta.integer(f"{arch}.block_count", lo=1),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": meta.integer(f"{arch}.feed_forward_length",   # an all-experts file may lack it
                                          meta.integer(f"{arch}.expert_feed_forward_length", validate.REQUIRED, lo=1)
                                          if arch in experts.MOE_ARCHITECTURES else validate.REQUIRED, lo=1),
        "rms_norm_eps": meta.number(f"{arch}.attention.layer_norm_rms_epsilon", hi=1.0),
        "rope_theta": meta.number(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "vocab_size": vocab_size,
        "max_position_embeddings": meta.integer(f"{arch}.context_length", 2048, lo=1, hi=validate.MAX_CONTEXT,
                                                why=" tokens"),
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "mlp_bias": False,
        "hidden_act": "silu",
    }


def _rope_scaling(meta: validate.Metadata, arch: str) -> dict | None:
    kind = meta.text(f"{arch}.rope.scaling.type")
    factor = meta.number(f"{arch}.rope.scaling.factor", None)
    if kind is None and meta.fields.get(f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", meta.number(f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise SourceError(f"{meta.where}: {arch}.rope.scaling.type = {show(kind)}; the supported GGUF RoPE scalings "
                          f"are none, linear and yarn")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor if factor is not None else 1.0}
    original = meta.integer(f"{arch}.rope.scaling.original_context_length", None, lo=1, hi=validate.MAX_CONTEXT)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    attn = meta.number(f"{arch}.rope.scaling.attn_factor", None)
    if attn is not None:
        scaling["attention_factor"] = attn
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.number(f"{arch}.rope.scaling.{key}", None)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _vocab(meta: validate.Metadata) -> GGUFVocab:
    """tokenizer.ggml.*, typed (the lengths and ids are checked against each other in validate.check_vocab)."""
    tokens = meta.array("tokenizer.ggml.tokens", (STRING,), "strings") or []
    types = meta.integers("tokenizer.ggml.token_type")
    return GGUFVocab(
        model=meta.text("tokenizer.ggml.model", "none"),
        pre=meta.text("tokenizer.ggml.pre"),
        tokens=tuple(tokens),
        token_types=tuple([1] * len(tokens) if types is None else types),
        merges=tuple(meta.array("tokenizer.ggml.merges", (STRING,), "strings") or ()),
        add_bos_token=meta.flag("tokenizer.ggml.add_bos_token", False),
        add_eos_token=meta.flag("tokenizer.ggml.add_eos_token", False),
        bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.integer("tokenizer.ggml.eos_token_id", None),
        unk_token_id=meta.integer("tokenizer.ggml.unknown_token_id", None),
        pad_token_id=meta.integer("tokenizer.ggml.padding_token_id", None),
    )


# element types the tensor data is read as (as gguf.GGUFReader does); other types are uint8 blocks
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


def _raw(data: np.memmap, t: TensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's data in the mapped file: elements of `shape`, or uint8 [..., row bytes] for block types."""
    view = data[t.start:t.start + t.nbytes]
    if t.type_name in _ELEMENT_DTYPES:
        return view.view(_ELEMENT_DTYPES[t.type_name]).reshape(shape)
    return view.reshape(*shape[:-1], shape[-1] // t.block_size * t.type_size)


def _dequantizable() -> list[str]:
    """ggml types gguf.quants.dequantize reads: F32, F16 and those with a block type registered."""
    return ["F32", "F16", *(q.name for q in getattr(gguf.quants, "_type_traits", {}))]


def _rope_freq_factors(t: TensorInfo, data: np.memmap, where: str) -> list[float]:
    """rope_freqs.weight (F32, head_dim / 2 positive divisors of the RoPE inverse frequencies)."""
    if t.type_name != "F32":
        raise SourceError(f"{where}: rope_freqs.weight is {t.type_name}; llama.cpp stores it as F32; "
                          f"{validate.MISLABELLED}")
    values = _raw(data, t, tuple(reversed(t.dims))).reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise SourceError(f"{where}: rope_freqs.weight holds values that are not finite and positive; "
                          f"{validate.MISLABELLED}")
    return [float(x) for x in values]


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    at = validate.layer_of(gguf_name)
    if at is not None and at[1] in _LAYER_NAMES:
        return f"model.layers.{at[0]}.{_LAYER_NAMES[at[1]]}"
    return None


def _unpermute_rows(rows: int, n_head: int, where: str, name: str) -> np.ndarray:
    """Row order undoing llama.cpp's `permute(w, n_head)`: HF row i is file row perm[i].

    llama.cpp writes w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); reading the file rows
    as (n_head, half, 2) and swapping back gives the HF order.
    """
    if rows % (2 * n_head):
        raise SourceError(f"{where}: {name} has {rows} rows, not a multiple of 2 * {n_head} heads")
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows)  # (n_head, 2, half) -> rows
