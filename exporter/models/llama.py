"""Llama-family decoder written for export, with a paged KV cache as explicit state.

One module covers Llama 1-3, Mistral, Qwen2 and SmolLM: GQA, RoPE (default,
'linear', 'llama3', 'dynamic'), RMSNorm, SwiGLU, tied or untied embeddings,
optional q/k/v (Qwen2) or q/k/v/o (Llama `attention_bias`) biases, optional
uniform sliding window (Mistral). It holds no Python-side state: the config is
parsed once into a frozen `LlamaConfig`, and the KV cache is an input that the
step returns updated.

Weights are stored STACKED over layers (`layers.qkv_proj` is [L, q+2kv, hidden])
so the decoder layers export as ONE scanned body (torch scan -> stablehlo.while);
`scan=False` unrolls the same body L times over static slices of the same
tensors, so both forms share one weight layout. The fused matrices' rows are
ordered so that any split of their output rows into N equal parts is a
Megatron tensor-parallel split (FUSED_ROWS): `qkv_proj` groups each KV head's
query heads with its K and V rows, `gate_up_proj` interleaves gate and up rows.

The step (docs/architecture.md, "LLM step contract"):

    tokens        int32[T]            tokens of this step, all sequences flattened
    positions     int32[T]            position of each token in its sequence
    seq_ids       int32[T]            row of block_tables each token belongs to
    slot_mapping  int32[T]            block * block_size + offset where the token's K/V is written
    block_tables  int32[S, B]         block ids per sequence, padded with the null block 0
    context_lens  int32[S]            tokens in each sequence's context, this step's included
    last_token    int32[S]            index into T of each sequence's last token
    kv_cache      dtype[L, 2, kv_heads, N, block_size, head_dim]   (donated)
    -> logits f32[S, vocab] (of each sequence's last token), kv_cache (updated)

A step first writes this step's K/V through slot_mapping, then each token
attends to the cache positions c of its sequence with c <= its position and
c < context_len. Block 0 is the null block: padding tokens write there and
padding rows of block_tables point there; it is never read unmasked. Masked
scores use a finite minimum, so padded rows give finite garbage, never NaN.

Three attention layouts share that contract (all exact for any mix of
sequences; they differ in cost, see ATTENTION_COST):
  * "gather" (entry point `decode`): every token attends over its own sequence's
    context, [T, B*block_size]; best when T ~ S (one token per sequence). It is the
    `hloserve.paged_attention` composite (runtime/artifact/kernels.py): its portable
    decomposition gathers each token's padded context; the CPU runtime runs a kernel
    that reads only the blocks in use, in place.
  * "flat" (entry point `prefill`): every token scores against all S contexts
    at once, [T, S*B*block_size], masked to its own; best when S is small and
    T large (prompts, chunked prefill).
  * "paged" (not exported by default): gather one block at a time in a loop
    with an online softmax; bounded memory for long contexts and many sequences.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from hloserve.runtime.artifact.llm import Layout, LLMSpec, ModelFacts, TensorParallelSpec

from .. import custom_ops  # noqa: F401 - registers torch.ops.hloserve.* (the composites)
from .. import dtypes
from ..errors import SourceError
from .step import _MASKED, ATTENTION, HOLDS, OWN, StepExportOptions, contract_entries, contract_spec, paged_attention, write_kv


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).

    Attributes:
      kind: "default", "linear" (positions / factor), "llama3" (Llama 3.1 band
        scaling) or "dynamic" (NTK base growth past original_max_position_embeddings,
        per sequence from its context length).
      factor / low_freq_factor / high_freq_factor / original_max_position_embeddings:
        the Hugging Face parameters of that kind.
    """
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    KINDS = ("default", "linear", "llama3", "dynamic")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder's shape and numerics, parsed once from a HF config dict.

    Attributes (HF name in parentheses where it differs):
      num_layers (num_hidden_layers), num_heads (num_attention_heads),
      num_kv_heads (num_key_value_heads), head_dim (default hidden/heads).
      qkv_bias: q/k/v projections have biases (Qwen2, Llama attention_bias).
      o_bias: the output projection has a bias (Llama attention_bias only).
      sliding_window: attend to at most this many previous positions (None: all).
      rope_freq_factors: per-frequency divisors of the RoPE inverse frequencies (GGUF
        `rope_freqs`, llama.cpp's form of Llama 3 scaling), [head_dim/2] or None.
      eos_token_ids: every id that ends a generation (HF eos_token_id may be a list).
    """
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Parse a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""

        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise SourceError(f"model_type {model_type!r} is not a Llama-family decoder; "
                              f"the LLM path supports llama, mistral and qwen2")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise SourceError(f"hidden_act {act!r} is not supported by the Llama path (SwiGLU with silu only)")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        rope_params = dict(d.get("rope_parameters") or {})
        rope_legacy = dict(d.get("rope_scaling") or {})
        rope = {**rope_params, **rope_legacy}
        theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in RopeScaling.KINDS:
            raise SourceError(f"rope type {kind!r} is not supported; supported: {', '.join(RopeScaling.KINDS)}")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise SourceError("partial_rotary_factor != 1 is not supported by the Llama path")
        max_pos = int(d.get("max_position_embeddings", 2048))
        scaling = RopeScaling(kind, float(rope.get("factor", 1.0)), float(rope.get("low_freq_factor", 1.0)),
                              float(rope.get("high_freq_factor", 4.0)),
                              rope.get("original_max_position_embeddings") or (max_pos if kind != "default" else None))
        attn_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        if model_type == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        if model_type == "qwen2" and window is not None and d.get("max_window_layers", 0) < int(d["num_hidden_layers"]):
            raise SourceError("Qwen2 with sliding window on only some layers is not supported; "
                              "set use_sliding_window=false")
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
        return cls(
            model_type=model_type, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=max_pos, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases and never an o bias, whatever attention_bias says
            qkv_bias=attn_bias or model_type == "qwen2", o_bias=attn_bias and model_type != "qwen2", mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            rope_freq_factors=tuple(float(f) for f in d["rope_freq_factors"]) if d.get("rope_freq_factors") else None,
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]), eos_token_ids=eos_ids)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_freq_factors is not None:
            out["rope_freq_factors"] = list(self.rope_freq_factors)
        return out


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies f32[head_dim/2], as transformers computes them at init."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    rs = cfg.rope_scaling
    if rs.kind == "linear":
        inv = inv / rs.factor
    elif rs.kind == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    if cfg.rope_freq_factors is not None:
        factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_freq_factors has {factors.numel()} values; head_dim {dim} needs {inv.numel()}")
        inv = inv / factors
    return inv


# -- weights -----------------------------------------------------------------
# Stacked parameter name -> (HF per-layer names concatenated along dim 0, present?)
def _layer_layout(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    p = "model.layers.{i}."
    out = {
        "qkv_proj": (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
        "o_proj": (p + "self_attn.o_proj.weight",),
        "gate_up_proj": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        "down_proj": (p + "mlp.down_proj.weight",),
        "input_layernorm": (p + "input_layernorm.weight",),
        "post_attention_layernorm": (p + "post_attention_layernorm.weight",),
    }
    if cfg.qkv_bias:
        out["qkv_bias"] = (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias")
    if cfg.o_bias:
        out["o_bias"] = (p + "self_attn.o_proj.bias",)
    if cfg.mlp_bias:
        out["gate_up_bias"] = (p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
        out["down_bias"] = (p + "mlp.down_proj.bias",)
    return out


# the stacked layer weights that are matrices (the rest are norms and biases)
MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Fused rows (FUSED_ROWS), so that splitting a fused matrix's output rows into N equal parts
# gives every device whole KV heads (N dividing kv_heads) or whole MLP units (N dividing the
# intermediate size): the layout tensor parallelism needs, at no cost on one device.
#   qkv_proj rows: [kv head 0: its G query heads, its K, its V | kv head 1: ... ], i.e. the
#     output reshapes to [T, KV, G+2, D] (HF's head order h = kv * G + g is kept for q);
#   gate_up_proj rows: [gate 0, up 0, gate 1, up 1, ...], i.e. the output reshapes to [T, I, 2].
FUSED_ROWS = {"qkv_proj", "qkv_bias", "gate_up_proj", "gate_up_bias"}
# How each stacked weight splits under tensor parallelism: the dim its stored tensors divide
# (column: output rows, dim 1 of [L, out, ...]; row: input columns or their groups, dim 2).
TENSOR_PARALLEL = {"qkv_proj": 1, "qkv_bias": 1, "gate_up_proj": 1, "gate_up_bias": 1, "o_proj": 2, "down_proj": 2}


def fused_row_order(cfg: "LlamaConfig", stacked: str) -> torch.Tensor | None:
    """The row permutation taking the plain concatenation of `stacked`'s parts (q;k;v or gate;up)
    to its FUSED_ROWS order, or None for a weight that is not fused."""
    if stacked not in FUSED_ROWS:
        return None
    if stacked.startswith("gate_up"):
        i = torch.arange(cfg.intermediate_size)
        return torch.stack([i, i + cfg.intermediate_size], 1).reshape(-1)          # [2I]: g0 u0 g1 u1 ...
    D, KV, G = cfg.head_dim, cfg.num_kv_heads, cfg.group
    d = torch.arange(D)
    q = torch.arange(KV * G)[:, None] * D + d                                     # [H, D]: rows of each q head
    k = cfg.q_size + torch.arange(KV)[:, None] * D + d                            # [KV, D]
    v = k + cfg.kv_size                                                           # [KV, D]
    return torch.cat([q.reshape(KV, G, D), k[:, None], v[:, None]], 1).reshape(-1)   # [KV*(G+2)*D]


def tensor_parallel_dims(weights: torch.nn.Module) -> dict[str, int]:
    """Artifact weight name -> the dim a tensor-parallel split divides, for every stored tensor of
    a stacked matrix or bias (quantized companions `_scale`/`_min` included; a row-split weight's
    per-row scale has no dim 2 and stays whole) and of the embedding and LM head (by vocabulary
    rows). Weights not listed (norms, o/down biases) are replicated."""
    from hloserve.quantization.schemes import MIN_SUFFIX, SCALE_SUFFIX

    # the vocabulary splits too: each device keeps 1/N of the table and of the head (the logits are
    # gathered once; measured as fast as replicated, 2026-11-24, and the table is a third of a
    # small model's weights)
    dims = {**{f"layers.{m}": d for m, d in TENSOR_PARALLEL.items()}, "embed_tokens": 0, "lm_head": 0}
    out = {}
    for name, t in weights.state_dict().items():
        stem = next((name[:-len(s)] for s in (SCALE_SUFFIX, MIN_SUFFIX) if name.endswith(s)), name)
        dim = dims.get(stem)
        if dim is not None and dim < t.dim():
            out[f"model.{name}"] = dim
    return out
# Why stacked 16-bit matrices under wider activations are stored as int16 bits: XLA:CPU has no
# 16-bit float data movement, so a dynamic-slice of a bf16 stack inside the layer loop makes it
# widen the whole stack to f32 before the loop, and a bitcast of a bf16 parameter to integers
# is a full copy (together ~25 ms of a 60 ms decode step). An int16 parameter is sliced as it
# is; each layer's slice is viewed as bf16 right before its dot (a free bitcast).
BITS_STORAGE = "int16 holding the bits of bf16/f16 values (viewed back before each dot)"
# A 16-bit KV cache under f32 activations is int16 for the same reason: each step's K/V are
# scattered and the contexts gathered as bits, then widened to f32 inside the gather (half
# the bytes read; attention itself stays f32: XLA:CPU widens batched bf16 dots anyway).


class LlamaWeights(torch.nn.Module):
    """Every weight of the decoder, per-layer tensors stacked on a leading [L] dim.

    Names (the artifact's weight names get a `model.` prefix):
      embed_tokens [V, hidden]; norm [hidden]; lm_head [V, hidden] (absent when tied);
      layers.qkv_proj [L, q+2kv, hidden]; layers.o_proj [L, hidden, q];
      layers.gate_up_proj [L, 2*inter, hidden]; layers.down_proj [L, hidden, inter];
      layers.input_layernorm / layers.post_attention_layernorm [L, hidden];
      optional layers.qkv_bias [L, q+2kv], o_bias, gate_up_bias, down_bias;
      rope_inv_freq f32[head_dim/2] (a buffer).

    `weight_dtype` (e.g. bf16 under f32 activations) stores the matrices narrower: their
    products then go through hloserve::mixed_linear (exporter/custom_ops.py), activations
    rounded to the weight dtype, sums in f32; the KV cache, norms and residuals keep `dtype`.
    The stacked ones are then int16 tensors holding the bf16/f16 bits (BITS_STORAGE).
    """

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        L, h, inter, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        shapes = {
            "qkv_proj": (L, cfg.q_size + 2 * cfg.kv_size, h), "o_proj": (L, h, cfg.q_size),
            "gate_up_proj": (L, 2 * inter, h), "down_proj": (L, h, inter),
            "input_layernorm": (L, h), "post_attention_layernorm": (L, h),
            "qkv_bias": (L, cfg.q_size + 2 * cfg.kv_size), "o_bias": (L, h),
            "gate_up_bias": (L, 2 * inter), "down_bias": (L, h),
        }
        # matrices (projections, embedding table, LM head) may be stored narrower than the
        # activations; norms and biases stay in `dtype`
        wdtype = weight_dtype or dtype
        # narrower stacked matrices are stored as int16 holding their bits (BITS_STORAGE)
        self.bits_dtype = wdtype if wdtype.is_floating_point and wdtype.itemsize == 2 else None

        def param(shape, matrix: bool, stacked: bool = False):
            dt = (torch.int16 if stacked and self.bits_dtype else wdtype) if matrix else dtype
            return torch.nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False)

        self.layer_names = tuple(_layer_layout(cfg))
        self.layers = torch.nn.ParameterDict({n: param(shapes[n], n in MATRICES, True) for n in self.layer_names})
        self.embed_tokens = param((V, h), True)
        self.norm = param((h,), False)
        self.lm_head = None if cfg.tie_word_embeddings else param((V, h), True)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg))

    # The step reads weights only through these (models/llama_quant.QuantizedLlamaWeights
    # implements the same four over quantized storage).
    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: activations and the KV cache."""
        return self.norm.dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of the matrices' values (the compute dtype unless stored narrower)."""
        return self.embed_tokens.dtype

    def weight_quant(self, name: str, tensor: torch.Tensor) -> dict | None:
        """The manifest's WeightSpec.quant of an artifact weight: says which int16 weights are bits."""
        if self.bits_dtype is None or tensor.dtype != torch.int16:
            return None
        return {"scheme": dtypes.artifact_name_of_torch(self.bits_dtype), "role": "bits", "stored": BITS_STORAGE,
                "shape": list(tensor.shape)}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens).to(self.dtype)      # [T, hidden]

    def in_place(self, name: str) -> bool:
        """Whether the step reads stacked weight `name` where it lies (hloserve::layer_linear)
        instead of taking one layer's slice of it: the 16-bit matrices. A slice is a copy, and
        a runtime with a layer_linear kernel (CPU) reads no copy at all."""
        return self.bits_dtype is not None and name in MATRICES

    def linear(self, x: torch.Tensor, lw: Mapping[str, torch.Tensor], name: str,
               bias: torch.Tensor | None, layer: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + bias, W being layer `layer` of stacked weight `name`: lw[name] (one layer's
        slice of the stacked weights) or, where `in_place(name)`, the stack itself."""
        if self.in_place(name):
            y = torch.ops.hloserve.layer_linear(x, self.layers[name], layer, HOLDS[self.bits_dtype])
            return y if bias is None else y + bias
        w = lw[name]
        return _linear(x, w.view(self.bits_dtype) if self.bits_dtype else w, bias)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.lm_head is None else self.lm_head
        if table.dtype in HOLDS:                                         # one matrix read in place
            zero = torch.zeros((), dtype=torch.int32, device=h.device)
            return torch.ops.hloserve.layer_linear(h, table[None], zero, HOLDS[table.dtype])   # [S, V]
        return _linear(h, table, None)                                    # [S, V]

    @classmethod
    def from_hf_tensors(cls, cfg: LlamaConfig, get: Callable[[str], torch.Tensor], names: Iterable[str],
                        dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype | None = None) -> "LlamaWeights":
        """Build stacked weights from HF-named tensors; `get(name)` returns one tensor (any dtype)."""

        names = set(names)
        w = cls(cfg, dtype, weight_dtype)

        def fetch(name):
            if name not in names:
                raise SourceError(f"checkpoint has no tensor {name!r} (expected for {cfg.model_type} "
                                  f"with {cfg.num_layers} layers); is it a {cfg.model_type} CausalLM checkpoint?")
            return get(name)

        with torch.no_grad():
            for stacked, parts in _layer_layout(cfg).items():
                dst = w.layers[stacked]
                for i in range(cfg.num_layers):
                    tensors = [fetch(p.format(i=i)) for p in parts]
                    src = torch.cat(tensors, 0) if len(tensors) > 1 else tensors[0]
                    order = fused_row_order(cfg, stacked)
                    if order is not None and src.shape[0] == order.numel():
                        src = src[order]                                  # FUSED_ROWS
                    if tuple(src.shape) != tuple(dst.shape[1:]):
                        raise SourceError(f"{parts[0].format(i=i)}...: shape {tuple(src.shape)} does not match the "
                                          f"config's {tuple(dst.shape[1:])}")
                    src = src.to(w.bits_dtype).view(torch.int16) if dst.dtype == torch.int16 else src.to(dst.dtype)
                    dst[i].copy_(src)
            w.embed_tokens.copy_(fetch("model.embed_tokens.weight").to(w.embed_tokens.dtype))
            w.norm.copy_(fetch("model.norm.weight").to(dtype))
            if w.lm_head is not None:
                w.lm_head.copy_(fetch("lm_head.weight").to(w.lm_head.dtype))
        return w


# -- the step ----------------------------------------------------------------
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or mixed_linear for 16-bit weights (narrower than x, or not: its lowering keeps
    XLA:CPU's bf16 kernels, which a bf16 F.linear's transposed operand loses)."""
    if weight.dtype.itemsize != 2 or not weight.dtype.is_floating_point:
        return F.linear(x, weight, bias)
    return torch.ops.hloserve.mixed_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in f32, scale in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclasses.dataclass(frozen=True)
class StepReads:
    """The step inputs a layout's attention reads, and what it derives from them once per step."""
    block_tables: torch.Tensor      # [S, B]
    seq_ids: torch.Tensor           # [T]
    positions: torch.Tensor         # [T]
    context_lens: torch.Tensor      # [S]
    blocks: torch.Tensor | None     # the blocks read: [B, T] (paged), [S, B] (flat), None (gather)
    seen: torch.Tensor | None       # what each token may see: [T] lengths (paged), [T, S*C] (flat), None


class GatherLayout:
    """Decode rows: the hloserve.paged_attention composite reads the step inputs itself (a CPU
    kernel reads only the blocks in use; elsewhere its decomposition gathers them)."""

    @staticmethod
    def reads(cfg, block_tables, seq_ids, positions, context_lens, C) -> StepReads:
        return StepReads(block_tables, seq_ids, positions, context_lens, None, None)

    @staticmethod
    def attend(qg, cache, l, r: StepReads, cfg, kvd, dtype) -> torch.Tensor:
        D = qg.shape[-1]
        return torch.ops.hloserve.paged_attention(
            qg.float(), cache, l, r.block_tables, r.seq_ids, r.positions, r.context_lens,
            cfg.sliding_window or 0, HOLDS.get(kvd or dtype, OWN), D ** -0.5, 0.0).to(dtype)   # [T, KV, G, D]


class PagedLayout:
    """A loop over each token's blocks, masked block by block (an f32/16-bit model cache only)."""

    @staticmethod
    def reads(cfg, block_tables, seq_ids, positions, context_lens, C) -> StepReads:
        blocks = block_tables[seq_ids].transpose(0, 1)                    # [B, T]: scanned over B
        seen = context_lens[seq_ids].to(torch.int64)                      # [T]: each token's context length
        return StepReads(block_tables, seq_ids, positions, context_lens, blocks, seen)

    @staticmethod
    def attend(qg, cache, l, r: StepReads, cfg, kvd, dtype) -> torch.Tensor:
        return paged_attention(qg, cache, l, r.blocks, r.positions.to(torch.int64), r.seen,
                               cfg.sliding_window)                        # [T, KV, G, D]


class FlatLayout:
    """Prompt chunks: every sequence's whole blocks gathered, one masked attention over them."""

    @staticmethod
    def reads(cfg, block_tables, seq_ids, positions, context_lens, C) -> StepReads:
        T, S = seq_ids.shape[0], block_tables.shape[0]
        ctx_pos = torch.arange(C, device=seq_ids.device)                  # [C]
        pos = positions.to(torch.int64)
        own = seq_ids.to(torch.int64)[:, None] == torch.arange(S, device=seq_ids.device)[None, :]   # [T, S]
        causal = ctx_pos[None, :] <= pos[:, None]                         # [T, C]
        if cfg.sliding_window:
            causal = causal & (ctx_pos[None, :] > pos[:, None] - cfg.sliding_window)
        filled = ctx_pos[None, :] < context_lens.to(torch.int64)[:, None]   # [S, C]
        seen = (own[:, :, None] & causal[:, None, :] & filled[None, :, :]).reshape(T, S * C)   # [T, S*C]
        return StepReads(block_tables, seq_ids, positions, context_lens, block_tables, seen)

    @staticmethod
    def attend(qg, cache, l, r: StepReads, cfg, kvd, dtype) -> torch.Tensor:
        # Whole blocks gathered, K and V by separate gathers: each lands in the layout its dot
        # reads ([KV, R*C, D], batch dims first), so XLA adds no slice copy or transpose of the
        # gathered context (which cost more than the gather itself; docs/performance.md), and a
        # cache split by heads is read where it lies.
        D = qg.shape[-1]
        k_ctx = torch.ops.hloserve.gather_blocks(cache, l, 0, r.blocks)   # [KV, S*C, D]
        v_ctx = torch.ops.hloserve.gather_blocks(cache, l, 1, r.blocks)   # [KV, S*C, D]
        if kvd is not None:   # widened inside the gather: half the bytes read, same dots
            k_ctx, v_ctx = k_ctx.view(kvd).to(dtype), v_ctx.view(kvd).to(dtype)
        qk = qg.transpose(0, 1)                                           # [KV, T, G, D]
        scores = torch.einsum("ktgd,kcd->ktgc", qk, k_ctx)                # [KV, T, G, S*C]
        scores = scores.float() * (D ** -0.5)
        scores = torch.where(r.seen[None, :, None, :], scores, _MASKED)
        probs = torch.softmax(scores, dim=-1).to(dtype)
        out = torch.einsum("ktgc,kcd->ktgd", probs, v_ctx)                # [KV, T, G, D]
        return out.transpose(0, 1)                                        # [T, KV, G, D]


# one attention layout per step kind, chosen once when the step is built
LAYOUTS = {Layout.GATHER: GatherLayout, Layout.PAGED: PagedLayout, Layout.FLAT: FlatLayout}


class LlamaStep(torch.nn.Module):
    """One paged-cache step of a LlamaWeights decoder (see the module docstring).

    attention: "gather" (decode layout) or "flat" (prefill layout).
    scan: decoder layers as one scanned body (True) or unrolled (False).
    kv_dtype: a 16-bit float K and V are stored in under wider activations (None: the model
      dtype); the cache is then int16 holding their bits (runtime.artifact.llm.KV_BITS).
    """

    def __init__(self, model: LlamaWeights, *, attention: str = "gather", scan: bool = True,
                 kv_dtype: torch.dtype | None = None):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if kv_dtype is not None and (kv_dtype.itemsize != 2 or not kv_dtype.is_floating_point):
            raise ValueError(f"kv_dtype must be a 16-bit float (bfloat16, float16), got {kv_dtype}")
        if kv_dtype is not None and attention == "paged":
            raise ValueError("a 16-bit KV cache is implemented for the flat and gather layouts, not paged")
        self.model = model
        self.cfg = model.cfg
        self.attention = attention
        self.layout = LAYOUTS[attention]
        self.scan = scan
        self.kv_dtype = kv_dtype

    def forward(self, tokens, positions, seq_ids, slot_mapping, block_tables, context_lens, last_token, kv_cache):
        cfg, w = self.cfg, self.model
        S, B = block_tables.shape
        L, _, KV, N, BS, D = kv_cache.shape
        C = B * BS                                   # context capacity of one sequence
        dtype = w.dtype

        h = w.embed(tokens)                          # [T, hidden]
        cos, sin = self._rope(positions, seq_ids, context_lens, dtype)   # [T, 1, D] each

        # which cache rows each token reads and may see, as this layout wants them (once per step)
        reads = self.layout.reads(cfg, block_tables, seq_ids, positions, context_lens, C)
        slots = slot_mapping.to(torch.int64)
        layer_ids = torch.arange(L, device=tokens.device)
        kvd = self.kv_dtype
        names = w.layer_names

        def layer(h, cache, lw: dict, l):
            """One decoder layer; cache is the full [L, 2, KV, N, BS, D], l a 0-dim layer index.

            Sizes are read from the arguments, never closed over: the scan body is traced
            by dynamo, which cannot take outer symbolic sizes (SymInts) as free variables.
            """
            T = h.shape[0]
            L, _, KV, N, BS, D = cache.shape
            x = rms_norm(h, lw["input_layernorm"], cfg.rms_norm_eps)
            G = cfg.group
            qkv = w.linear(x, lw, "qkv_proj", lw.get("qkv_bias"), l)        # [T, KV*(G+2)*D] (FUSED_ROWS)
            qkv = qkv.reshape(T, cfg.num_kv_heads, G + 2, cfg.head_dim)  # [T, KV, G+2, D]
            qg, k, v = qkv[:, :, :G], qkv[:, :, G], qkv[:, :, G + 1]      # [T, KV, G, D], [T, KV, D] x2
            qg = qg * cos[:, :, None] + rotate_half(qg) * sin[:, :, None]
            k = k * cos + rotate_half(k) * sin

            cache = write_kv(cache, l, k, v, slots, kvd)                 # then read the contexts
            out = self.layout.attend(qg, cache, l, reads, cfg, kvd, dtype)   # [T, KV, G, D]
            out = out.reshape(T, cfg.q_size)                              # [T, H*D]
            h = h + w.linear(out, lw, "o_proj", lw.get("o_bias"), l)

            x = rms_norm(h, lw["post_attention_layernorm"], cfg.rms_norm_eps)
            gu = w.linear(x, lw, "gate_up_proj", lw.get("gate_up_bias"), l)  # [T, 2I] (FUSED_ROWS)
            gu = gu.reshape(T, -1, 2)                                     # [T, I, 2]
            gate, up = gu[..., 0], gu[..., 1]                             # [T, I] each
            h = h + w.linear(F.silu(gate) * up, lw, "down_proj", lw.get("down_bias"), l)
            return h, cache

        names = tuple(n for n in names if not w.in_place(n))              # the others: sliced per layer
        stacked = [w.layers[n] for n in names]
        if self.scan:
            from .._private import torch_scan
            scan = torch_scan()

            def body(carry, xs):
                h, cache = carry
                *ws, l = xs
                h, cache = layer(h, cache, dict(zip(names, ws)), l)
                return (h, cache), h.new_zeros(())

            (h, kv_cache), _ = scan(body, (h, kv_cache), (*stacked, layer_ids))
        else:
            for i in range(L):
                h, kv_cache = layer(h, kv_cache, {n: t[i] for n, t in zip(names, stacked)}, layer_ids[i])

        h_last = rms_norm(h[last_token], w.norm, cfg.rms_norm_eps)        # [S, hidden]
        logits = w.head(h_last).float()                                   # [S, V]
        return logits, kv_cache

    def _rope(self, positions, seq_ids, context_lens, dtype):
        """cos, sin [T, 1, D] in the model dtype (computed in f32, as transformers does)."""
        cfg = self.cfg
        inv = self.model.rope_inv_freq                                    # [D/2]
        pos = positions.float()
        rs = cfg.rope_scaling
        if rs.kind == "dynamic":
            # NTK base growth from each sequence's context length, as transformers does for a
            # single sequence (it uses the batch's longest; per sequence is the servable form).
            D = cfg.head_dim
            seq_len = context_lens[seq_ids].float()                       # [T]
            orig = float(cfg.max_position_embeddings)
            grown = cfg.rope_theta * ((rs.factor * seq_len / orig) - (rs.factor - 1)) ** (D / (D - 2))
            base = torch.where(seq_len > orig, grown, torch.full_like(seq_len, cfg.rope_theta))   # [T]
            expo = torch.arange(0, D, 2, device=pos.device).float() / D   # [D/2]
            freqs = pos[:, None] / base[:, None] ** expo[None, :]         # [T, D/2]
        else:
            freqs = pos[:, None] * inv[None, :]                           # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]   # [T, 1, D]


# -- export --------------------------------------------------------------------
def step_entries(weights: LlamaWeights, opts: StepExportOptions = StepExportOptions()) -> list:
    """The artifact's entry points: by default `prefill` (flat attention) and `decode` (gather).

    All take and return the same step contract; they share every weight and dim.
    """
    cfg = weights.cfg
    return contract_entries(lambda att: LlamaStep(weights, attention=att, scan=opts.scan, kv_dtype=opts.kv_dtype),
                            opts, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, weights.dtype)


def llm_spec(cfg: LlamaConfig, opts: StepExportOptions, dtype: torch.dtype,
             weights: torch.nn.Module | None = None) -> LLMSpec:
    """The manifest's model["llm"]: what a server needs to drive the step functions (and, given
    the weights, how they split over devices)."""
    tp = None if weights is None else TensorParallelSpec(weights=tensor_parallel_dims(weights),
                                                         kv_heads=cfg.num_kv_heads, kv_cache_dim=2)
    return contract_spec(opts, dtype, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, bos_token_id=cfg.bos_token_id,
                         eos_token_ids=cfg.eos_token_ids,
                         model=ModelFacts(num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                          hidden_size=cfg.hidden_size, sliding_window=cfg.sliding_window,
                                          layers="scan" if opts.scan else "unrolled"), tensor_parallel=tp)
