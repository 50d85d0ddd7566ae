"""A GGUF model's metadata checked against itself and its tensors, before anything is built from it.

    meta = Metadata(header.fields, "model.gguf")
    meta.integer("llama.block_count", lo=1)      # a typed read: a missing key, another type or a value
    meta.number("llama.rope.freq_base", 1e4)     # out of range is a one-line SourceError naming the key
    head_dim = attention_geometry(meta, "llama", hidden, heads, kv_heads)
    check_layers(config, header.tensors, arch, where)   # block_count vs the blk.N.* present, each layer's set
    check_shapes(config, header.tensors, where)         # every tensor's shape vs what the config implies
    check_vocab(vocab, config, where)                   # token list, token types, scores, special ids

Each error names the field, the bad value and what to do; what the file claims is compared with what
it holds (the tensors present, the token list), so a count it misstates never sizes an allocation or
a loop: `llama.block_count = 1000000` over 30 layers of tensors is refused here, not by building a
million-layer model.
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..errors import SourceError
from .header import ARRAY, STRING, Field, TensorInfo, show

if TYPE_CHECKING:
    from .tokenizer import GGUFVocab

MISLABELLED = "the file is damaged or mislabelled: re-convert it"
MAX_CONTEXT = 1 << 24           # context lengths beyond 16M tokens are taken as damage (Llama 4 Scout: 10M)
INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)
FLOATS = (6, 12)
BOOL = 7
REQUIRED = object()
# per-layer tensors every llama / qwen2 layer has; biases by architecture (HF Llama: q, k, v, o when
# attention_bias; HF Qwen2: q, k, v always, o never)
LAYER_WEIGHTS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
# a mixture-of-experts layer (config num_experts, not in mlp_only_layers) has EXPERT_FFN in place of DENSE_FFN
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
EXPERT_FFN = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# architectures with per-head q / k RMS norms (Qwen3), with a shared expert beside the routed ones (Qwen2-MoE)
QK_NORMS = {"qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight")}
SHARED_FFN = {"qwen2moe": ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                           "ffn_down_shexp.weight")}
# architectures whose q, k, v projections always have biases (HF Qwen2, Qwen2-MoE)
QKV_BIASED = ("qwen2", "qwen2moe")
# GGUF token types (gguf.TokenType): NORMAL .. BYTE
TOKEN_TYPES = range(1, 7)


class Metadata:
    """The file's key-values read by type: a getter refuses a missing required key, a value of another
    type or one out of its range with a one-line SourceError naming the key, the value and the fix."""

    def __init__(self, fields: Mapping[str, Field], where: str):
        self.fields, self.where = fields, where

    def _get(self, key: str, default: Any, types: Iterable[int], kind: str) -> Field | None:
        f = self.fields.get(key)
        if f is None:
            if default is REQUIRED:
                raise SourceError(f"{self.where}: metadata {key} is missing; the file is incomplete or not a llama.cpp "
                                  f"model: re-convert it")
            return None
        if f.type not in types:
            shown = show(str(f.value)) if f.type != ARRAY else f"[{len(f.value)} values]"
            raise SourceError(f"{self.where}: {key} is a {f.describe()} ({shown}), not {kind}; {MISLABELLED}")
        return f

    def integer(self, key: str, default: Any = REQUIRED, *, lo: int = 0, hi: int | None = None,
                why: str = "") -> Any:
        """An integer-typed value in [lo, hi] (default when absent and not required)."""
        f = self._get(key, default, INTEGERS, "an integer")
        if f is None:
            return default
        return self._in_range(key, f.value, lo, hi, why)

    def number(self, key: str, default: Any = REQUIRED, *, lo: float = 0.0, hi: float = math.inf,
               why: str = "") -> Any:
        """A finite float- or integer-typed value with lo < value < hi."""
        f = self._get(key, default, FLOATS + INTEGERS, "a number")
        if f is None:
            return default
        value = float(f.value)
        if not (math.isfinite(value) and lo < value < hi):
            bound = f"between {lo:g} and {hi:g}" if math.isfinite(hi) else f"finite and above {lo:g}"
            raise SourceError(f"{self.where}: {key} = {value!r}; it must be {bound}{why}; {MISLABELLED}")
        return value

    def text(self, key: str, default: Any = None) -> Any:
        f = self._get(key, default, (STRING,), "a string")
        return default if f is None else f.value

    def flag(self, key: str, default: bool) -> bool:
        f = self._get(key, default, (BOOL,), "a bool")
        return default if f is None else bool(f.value)

    def array(self, key: str, item_types: Iterable[int], kind: str) -> list | None:
        """An array's values (None when absent) if its elements are of `item_types`."""
        f = self._get(key, None, (ARRAY,), f"an array of {kind}")
        if f is not None and f.item_type not in item_types and f.value:
            raise SourceError(f"{self.where}: {key} is an {f.describe()}, not an array of {kind}; {MISLABELLED}")
        return None if f is None else f.value

    def integers(self, key: str) -> list[int] | None:
        return self.array(key, INTEGERS, "integers")

    def _in_range(self, key: str, value: int, lo: int, hi: int | None, why: str) -> int:
        if value < lo or (hi is not None and value > hi):
            bound = f"at least {lo}" if hi is None else f"{lo}..{hi}"
            raise SourceError(f"{self.where}: {key} = {value}; it must be {bound}{why}; {MISLABELLED}")
        return int(value)


def kv_head_count(meta: Metadata, arch: str, heads: int) -> int:
    """{arch}.attention.head_count_kv (default: head_count): one count, or per-layer counts all equal;
    at least 1 and dividing head_count."""
    key = f"{arch}.attention.head_count_kv"
    f = meta.fields.get(key)
    if f is not None and f.type == ARRAY:
        counts = meta.integers(key) or []
        if len(set(counts)) != 1:
            raise SourceError(f"{meta.where}: {key} differs between layers ({show(str(counts))}); only uniform "
                              f"attention is supported")
        kv = meta._in_range(key, counts[0], 1, None, "")
    else:
        kv = meta.integer(key, heads, lo=1)
    if heads % kv:
        raise SourceError(f"{meta.where}: {key} = {kv} does not divide {arch}.attention.head_count = {heads} "
                          f"(each key/value head serves a whole group of query heads); {MISLABELLED}")
    return kv


def head_dim(meta: Metadata, arch: str, hidden: int, heads: int) -> int:
    """attention.key_length when given (equal to value_length when that is given), else
    embedding_length / head_count, which must then divide; even (RoPE rotates pairs)."""
    key = f"{arch}.attention.key_length"
    dim = meta.integer(key, None, lo=1)
    if dim is None:
        if hidden % heads:
            raise SourceError(f"{meta.where}: {arch}.attention.head_count = {heads} does not divide "
                              f"{arch}.embedding_length = {hidden}, and {key} is not given; {MISLABELLED}")
        dim, key = hidden // heads, f"{arch}.embedding_length / head_count"
    value = meta.integer(f"{arch}.attention.value_length", dim, lo=1)
    if value != dim:
        raise SourceError(f"{meta.where}: {arch}.attention.value_length = {value} differs from the key length {dim}; "
                          f"only equal key and value head sizes are supported")
    if dim % 2:
        raise SourceError(f"{meta.where}: head size {key} = {dim} is odd; rotary embeddings need an even one; "
                          f"{MISLABELLED}")
    return dim


def layer_of(name: str) -> tuple[int, str] | None:
    """"blk.12.attn_q.weight" -> (12, "attn_q.weight"); None for global tensors (and for "blk.012.*":
    a layer number is written one way only)."""
    m = re.fullmatch(r"blk\.(0|[1-9][0-9]*)\.(.+)", name)
    return (int(m.group(1)), m.group(2)) if m else None


def check_layers(config: Mapping[str, Any], tensors: Iterable[TensorInfo], arch: str, where: str) -> None:
    """block_count against the layers that have tensors (exactly blk.0 .. blk.{block_count-1}), and every
    layer with the same, complete set of tensors for the architecture."""
    n = config["num_hidden_layers"]
    kinds: dict[int, set[str]] = {}
    for t in tensors:
        at = layer_of(t.name)
        if at is not None:
            kinds.setdefault(at[0], set()).add(at[1])
    present = sorted(kinds)
    if not present:
        raise SourceError(f"{where}: {arch}.block_count = {n} but the file has no layer tensors (blk.N.*); "
                          f"{MISLABELLED}")
    if present[-1] >= n:
        raise SourceError(f"{where}: {arch}.block_count = {n} but the file has tensors for layer blk.{present[-1]} "
                          f"({len(present)} layers present); {MISLABELLED}")
    if len(present) < n:
        missing = next(i for i in range(n) if i not in kinds)
        raise SourceError(f"{where}: {arch}.block_count = {n} but the file has tensors for {len(present)} layers "
                          f"(blk.{present[0]}..blk.{present[-1]}; blk.{missing} has none); {MISLABELLED}")
    dense = set(LAYER_WEIGHTS) | set(QK_NORMS.get(arch, ()))
    if arch in QKV_BIASED:
        dense |= set(QKV_BIASES)
    elif config["attention_bias"]:
        dense |= {*QKV_BIASES, "attn_output.bias"}
    sparse = (dense - set(DENSE_FFN)) | set(EXPERT_FFN) | set(SHARED_FFN.get(arch, ()))
    for i in present:
        want = sparse if config.get("num_experts") and i not in config["mlp_only_layers"] else dense
        lacking, extra = sorted(want - kinds[i]), sorted(kinds[i] - want)
        if lacking or extra:
            what = f"lacks blk.{i}.{lacking[0]}" if lacking else f"has blk.{i}.{extra[0]}, which the other layers lack"
            raise SourceError(f"{where}: layer {i} {what} ({arch} layers have {', '.join(sorted(want))}); the file is "
                              f"incomplete or mislabelled: re-convert it")


def expected_shape(name: str, c: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The torch-order shape (reversed GGUF dims) the config implies for tensor `name`; None if unknown."""
    hidden, ff, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "rope_freqs.weight": (c["head_dim"] // 2,), "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
              "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
              "attn_output.weight": (hidden, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
              "attn_output.bias": (hidden,), "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden),
              "ffn_down.weight": (hidden, ff), "attn_q_norm.weight": (c["head_dim"],),
              "attn_k_norm.weight": (c["head_dim"],)}
    if c.get("num_experts"):
        n, moe_ff = c["num_experts"], c["moe_intermediate_size"]
        shapes.update({"ffn_gate_inp.weight": (n, hidden), "ffn_gate_exps.weight": (n, moe_ff, hidden),
                       "ffn_up_exps.weight": (n, moe_ff, hidden), "ffn_down_exps.weight": (n, hidden, moe_ff)})
    if c.get("shared_expert_intermediate_size"):
        shared = c["shared_expert_intermediate_size"]
        shapes.update({"ffn_gate_inp_shexp.weight": (hidden,), "ffn_gate_shexp.weight": (shared, hidden),
                       "ffn_up_shexp.weight": (shared, hidden), "ffn_down_shexp.weight": (hidden, shared)})
    at = layer_of(name)
    return shapes.get(at[1] if at else name)


def check_shapes(config: Mapping[str, Any], tensors: Iterable[TensorInfo], arch: str, where: str) -> None:
    """Every tensor's shape equals what the config implies (token_embd's rows are the vocabulary)."""
    for t in tensors:
        want = expected_shape(t.name, config)
        got = tuple(reversed(t.dims))
        if want is not None and got != want:
            raise SourceError(
                f"{where}: tensor {t.name} is {list(got)} but {arch}.* imply {list(want)} (embedding_length "
                f"{config['hidden_size']}, {config['num_attention_heads']} heads x {config['head_dim']}, "
                f"{config['num_key_value_heads']} kv heads, feed_forward_length {config['intermediate_size']}"
                f"{experts_of(config)}, "
                f"vocabulary {config['vocab_size']}); {MISLABELLED}")


def experts_of(c: Mapping[str, Any]) -> str:
    """", 8 experts of expert_feed_forward_length 32" for a mixture-of-experts config, else ""."""
    return f", {c['num_experts']} experts of expert_feed_forward_length {c['moe_intermediate_size']}" \
        if c.get("num_experts") else ""


def check_weight_types(tensors: Iterable[TensorInfo], dequantizable: Iterable[str], where: str) -> None:
    """Every weight's ggml type is one the gguf package dequantizes."""
    known = set(dequantizable)
    for t in tensors:
        if t.type_name not in known:
            raise SourceError(f"{where}: tensor {t.name} is {t.type_name}, which cannot be dequantized (the gguf package "
                              f"reads {', '.join(sorted(known))}); re-convert the model to one of those")


def check_vocab(vocab: "GGUFVocab", config: Mapping[str, Any], where: str, scores: list | None) -> None:
    """The token list matches the vocabulary size; token types and scores give one value per token;
    special ids name tokens."""
    n = len(vocab.tokens)
    if n != config["vocab_size"]:
        raise SourceError(f"{where}: tokenizer.ggml.tokens has {n} tokens but the vocabulary (token_embd.weight's rows)"
                          f" is {config['vocab_size']}; {MISLABELLED}")
    for key, values in (("tokenizer.ggml.token_type", vocab.token_types), ("tokenizer.ggml.scores", scores)):
        if values is not None and len(values) != n:
            raise SourceError(f"{where}: {key} has {len(values)} entries for {n} tokens; {MISLABELLED}")
    bad = next((i for i, ty in enumerate(vocab.token_types) if ty not in TOKEN_TYPES), None)
    if bad is not None:
        raise SourceError(f"{where}: tokenizer.ggml.token_type[{bad}] = {vocab.token_types[bad]}; GGUF token types "
                          f"are 1..6; {MISLABELLED}")
    for key, value in (("bos_token_id", vocab.bos_token_id), ("eos_token_id", vocab.eos_token_id),
                       ("unknown_token_id", vocab.unk_token_id), ("padding_token_id", vocab.pad_token_id)):
        if value is not None and not 0 <= value < n:
            raise SourceError(f"{where}: tokenizer.ggml.{key} = {value}, outside the {n} tokens; {MISLABELLED}")

