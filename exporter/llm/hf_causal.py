"""Any Hugging Face decoder-only causal LM as the paged-cache LLM step, through transformers'
attention interface (the way vLLM's Transformers backend serves models it has no code for).

    source = from_hf_directory(path, tdtype)        # -> Source with `prefill` and `decode`

The model's own code runs under torch.export; only its attention is ours. `hloserve_paged` is
registered in transformers' `AttentionInterface` and set as the config's attention
implementation, so every attention layer calls `paged_attention_forward` with its rotated q/k/v
(after q/k norms, partial rotary, ... whatever the model does) and its own `scaling`,
`sliding_window` and `softcap`. transformers builds no mask for an attention name it has no mask
function for. The whole step runs as one row [1, T] with `position_ids`; the paging inputs reach
the attention function as a keyword argument (`hloserve_step`) that transformers passes through
the model's `**kwargs` unchanged. Each layer writes this step's K/V into the explicit cache (one
tensor, docs/architecture.md "LLM step contract") and reads its sequence's context:

  * `decode`: the `hloserve.paged_attention` composite (runtime/artifact/kernels.py): a CPU kernel
    reading only the blocks in use, or its portable decomposition;
  * `prefill`: the flat layout (every token scores all of the step's contexts, masked to its own);
  * a `paged` layout (StepExportOptions.functions), the online-softmax loop over blocks of
    models/step.py: bounded memory for long contexts (f32 cache).

Logits are computed for each sequence's last token only (`logits_to_keep=last_token`), so final
logit soft-capping, logit scales and tied heads are the model's own code too.

The gate is transformers' own (`_supports_attention_backend`, what vLLM requires): a model that
does not route attention through the interface, an encoder-decoder, or a model with recurrent
(state-space, linear-attention) layers is refused at export with one line saying why.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

import torch
from hloserve.quantization.convert import QuantRecord, QuantRequest
from hloserve.quantization.schemes import MIN_SUFFIX, SCALE_SUFFIX
from hloserve.runtime.artifact.llm import LLMSpec, ModelFacts, TensorParallelSpec

from .. import dtypes
from ..composites import layer_linear  # noqa: F401 - registers torch.ops.hloserve.layer_linear
from ..entry import Source
from ..errors import SourceError
from . import hf_experts, hf_layers, kv_smooth
from . import lora as lora_hooks
from .attention import ATTN_NAME, STEP_KWARG, StepState, register_attention
from .hf_files import TOKENIZER_FILES, text_spec
from .layer_plan import describe
from .lora import LoraRequest
from .step import SMOOTHED, StepExportOptions, contract_entries, contract_spec

log = logging.getLogger("hloserve.export")

# layer kinds (config.layer_types) whose attention is full or windowed softmax attention
_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
# a transformers attention's sliding window (None on its global layers), the one static attribute in
# which Gemma's sliding and global layers differ: per-layer data of one scanned body, which reaches
# `StepState.attend` (attention.py) as the layer's window (the other names say the same and are not read by the step)
WINDOW = hf_layers.PerLayer("sliding_window", "window", labels=("is_sliding", "layer_type", "attention_type"))


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """What the paged cache looks like for a model: [layers, 2, kv_heads, N, block, head_dim]."""
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def geometry(config) -> CacheGeometry:
    """The cache geometry from a transformers config (the text model's)."""
    c = _text_config(config)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return CacheGeometry(int(c.num_hidden_layers), int(kv), int(head_dim))


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: its embedding's output (weights may be stored narrower or
    quantized: a quantized embedding says its output dtype)."""
    emb = model.get_input_embeddings()
    dtype = getattr(emb, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else emb.weight.dtype


def check_supported(cls, config) -> None:
    """Raise SourceError (one line: why, and what would be needed) unless the generic path can serve it."""
    name = getattr(cls, "__name__", str(cls))
    if getattr(config, "is_encoder_decoder", False):
        raise SourceError(f"{name} is an encoder-decoder model; hloserve's LLM step serves decoder-only causal LMs "
                          f"(an encoder-decoder needs a second, cross-attention cache)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), ())
    causal = (causal,) if isinstance(causal, str) else tuple(causal)
    if not (name.endswith("ForCausalLM") or name in causal):
        raise SourceError(f"{name} is not a causal LM class (transformers' causal-LM mapping); export the model's "
                          f"causal-LM head class instead")
    if not getattr(cls, "_supports_attention_backend", False):
        raise SourceError(f"{name} does not route its attention through transformers' attention interface "
                          f"(_supports_attention_backend is False), so its attention cannot be replaced by a "
                          f"paged one; it needs a hand-written step in exporter/llm/")
    c = _text_config(config)
    kinds = set(getattr(c, "layer_types", None) or ())
    other = sorted(kinds - set(_ATTENTION_LAYERS))
    if other:
        raise SourceError(f"{name} has {', '.join(other)} layers (recurrent state, not a KV cache); the paged step "
                          f"serves attention layers only and would need a per-sequence state cache for these")
    if getattr(c, "kv_lora_rank", None):
        raise SourceError(f"{name} uses multi-head latent attention (kv_lora_rank={c.kv_lora_rank}): its keys and "
                          f"values have different head sizes, which the paged KV cache ([L, 2, KV, N, 16, D]) does "
                          f"not hold")
    g = geometry(config)
    if g.num_kv_heads <= 0 or c.num_attention_heads % g.num_kv_heads:
        raise SourceError(f"{name}: {c.num_attention_heads} query heads are not a multiple of {g.num_kv_heads} "
                          f"KV heads")


# config fields that count a mixture-of-experts model's routed experts (transformers' families)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def route_experts(model: torch.nn.Module) -> None:
    """A mixture-of-experts model's experts through hloserve's implementation (models/hf_experts.py);
    SourceError for one whose experts it cannot compute."""
    name = type(model).__name__
    if hf_experts.use_ours(model):
        for path, m in model.named_modules():
            if hf_experts.is_experts(m):
                hf_experts.check_experts(m, f"{name} {path}")
        return
    c = _text_config(model.config)
    experts = getattr(c, "is_moe", True) and next(
        (f"{k}={getattr(c, k)}" for k in _EXPERT_COUNTS if (getattr(c, k, None) or 0) > 1), None)
    if experts:
        raise SourceError(f"{name} is a mixture-of-experts model ({experts}) whose experts are not a transformers "
                          f"experts module (use_experts_implementation), which the generic step computes")


class HFStep(torch.nn.Module):
    """One paged-cache step of a transformers causal LM (the LLM step contract)."""

    def __init__(self, model: torch.nn.Module, *, layout: str, opts: StepExportOptions):
        super().__init__()
        self.model = model
        self.layout = layout
        self.opts = opts

    def forward(self, tokens, positions, seq_ids, slot_mapping, block_tables, context_lens, last_token, kv_cache):
        return self.run(tokens, positions, seq_ids, slot_mapping, block_tables, context_lens, last_token, kv_cache)

    def run(self, tokens, positions, seq_ids, slot_mapping, block_tables, context_lens, last_token, kv_cache,
            lora: tuple = (), observe=None):
        """The step; `observe` (eager only): kv_smooth.calibrate's look at each layer's queries and keys."""
        inputs = dict(positions=positions, seq_ids=seq_ids, slot_mapping=slot_mapping, block_tables=block_tables,
                      context_lens=context_lens, kv_cache=kv_cache)
        if self.opts.lora is not None:    # lora_slots, then each target's A and B (LoraSpec.inputs)
            inputs.update(zip(self.opts.lora.inputs(), lora, strict=True))
        smooth = getattr(self.model, kv_smooth.KV_SMOOTH, None)
        if smooth is not None and self.opts.kv_dtype in SMOOTHED:   # a weight the scanned body receives
            inputs[kv_smooth.KV_SMOOTH] = smooth
        dtype = activation_dtype(self.model)
        step = StepState(self.layout, inputs, self.opts.kv_dtype, dtype)
        step.observe = observe
        out = self.model(input_ids=tokens[None].to(torch.int64), position_ids=positions[None].to(torch.int64),
                         use_cache=False, logits_to_keep=last_token.to(torch.int64), **{STEP_KWARG: step})
        logits = out.logits[0].float()                                  # [S, V]
        return logits, step.cache


class HFLoraStep(HFStep):
    """The step with adapter slots: the contract's inputs, then the adapters' (LoraSpec.inputs), taken
    as one argument list (torch.export names them by the entry point's input names)."""

    def forward(self, *args):
        return self.run(*args[:8], lora=args[8:])


def step_entries(model: torch.nn.Module, opts: StepExportOptions) -> list:
    """`prefill` (flat) and `decode` (gather) over the same model (models/step.py's contract)."""
    g = geometry(model.config)
    cls = HFStep if opts.lora is None else HFLoraStep
    return contract_entries(lambda att: cls(model, layout=att, opts=opts), opts, g.num_layers,
                            g.num_kv_heads, g.head_dim, activation_dtype(model))


def calibrate_kv_smoothing(model: torch.nn.Module, opts: StepExportOptions, path: str) -> None:
    """The int8 cache's key smoothing (exporter/llm/kv_smooth.py), calibrated on the model as it will be
    exported and registered as its buffer `kv_smooth` (a weight of the artifact)."""
    g = geometry(model.config)
    plain = dataclasses.replace(opts, kv_dtype=None, lora=None)
    ids = kv_smooth.calibration_ids(path, int(_text_config(model.config).vocab_size))
    smooth = kv_smooth.calibrate(HFStep(model, layout="flat", opts=plain).run, ids,
                                 num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                 block_size=opts.block_size, dtype=activation_dtype(model))
    model.register_buffer(kv_smooth.KV_SMOOTH, smooth)


def scan_layers(model: torch.nn.Module, opts: StepExportOptions) -> str:
    """Scan the model's decoder layers (hf_layers.ScannedLayers), checked by one eager step on the
    contract's example; where the model's layer loop cannot be taken over, the layers stay
    unrolled. Layers that differ only in their sliding window are one body, the window per layer
    as data (WINDOW), where that step gives the unrolled layers' logits and cache; otherwise they
    are scanned by period (or by segments of their own periods, layer_plan). Returns how the layers
    run: "scan", "scan (a period of P layers...)", "scan (N segments: ...)" or "unrolled: why"."""
    scanned = hf_layers.scan(model, STEP_KWARG, (WINDOW,))
    if scanned is None:
        return "unrolled: no list of decoder layers found"
    entry = step_entries(model, opts)[0]
    try:
        with torch.no_grad():
            got = entry.module(*entry.args)
            if scanned.carried and not _same_as_unrolled(model, entry, got):
                log.info("the layers' sliding windows cannot be per-layer data (the model reads them otherwise): "
                         "scanned by period")
                hf_layers.unscan(model)
                scanned = hf_layers.scan(model, STEP_KWARG)
                entry.module(*entry.args)
    except hf_layers.ScanError as e:
        hf_layers.unscan(model)
        log.info("decoder layers exported unrolled: %s", e)
        return f"unrolled: {e}"
    return describe(scanned.segments, scanned.num_layers)


def _same_as_unrolled(model: torch.nn.Module, entry, got) -> bool:
    """Whether the unrolled layers give the scanned step's logits and cache on the entry's example
    (summation order aside)."""
    with hf_layers.unrolled(model):
        want = entry.module(*entry.args)
    return all(torch.allclose(g.float(), w.float(), rtol=1e-4, atol=1e-4 * max(1.0, float(w.float().abs().max())))
               for g, w in zip(got, want))


def record_stacks(model: torch.nn.Module, record: QuantRecord) -> None:
    """The stacks the scan made of quantized layers keep their manifest entries (WeightSpec.quant)."""
    for m in model.modules():
        if isinstance(m, hf_layers.ScannedLayers):
            for parts, stacked in m.stacked_from:
                record.add_stack(parts, stacked)


def divide_rope_frequencies(model: torch.nn.Module, factors, where: str) -> None:
    """A GGUF's rope_freqs tensor (llama.cpp's form of Llama 3 RoPE scaling: each rotary inverse
    frequency divided by its factor) applied to the model's rotary embedding buffers."""
    f = torch.tensor(factors, dtype=torch.float32)                     # [head_dim / 2]
    rotary = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not rotary:
        raise SourceError(f"{where}: has a rope_freqs tensor, but {type(model).__name__} has no rotary inv_freq")
    for m in rotary:
        if m.inv_freq.shape != f.shape:
            raise SourceError(f"{where}: rope_freqs has {f.numel()} factors; {type(model).__name__}'s rotary "
                              f"embedding has {m.inv_freq.numel()} frequencies")
        m.inv_freq = m.inv_freq / f.to(m.inv_freq.dtype)
        if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
            m.original_inv_freq = m.inv_freq


# Tensor parallelism (Megatron-style, as the Llama step's): the projections a layer's heads or its
# MLP's hidden units come out of are split by output rows, the two that fold them back by input
# columns, so each device holds whole heads and each layer needs one all-reduce after o_proj and
# one after down_proj. A checkpoint's own fused projections (Phi-3's qkv_proj, gate_up_proj) stay
# whole: an even split of their rows would not hand each device whole heads or matching gate and up
# rows. Ours (hf_layers.FusedLinear) interleave their rows by KV head and by row, so they split.
COLUMN_SPLIT = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", *hf_layers.FUSED.values()})
ROW_SPLIT = frozenset({"o_proj", "down_proj"})


def tensor_parallel_dims(model: torch.nn.Module) -> dict[str, int]:
    """Artifact weight name -> the dim a tensor-parallel split divides: the COLUMN_SPLIT matrices'
    output rows (their biases and quantized companions too), the ROW_SPLIT matrices' input columns
    (a per-row scale, with no such dim, stays whole), the embedding table and the LM head by
    vocabulary rows. A scanned layer's stacks carry the layers as dim 0. Others are replicated.
    A tied table is listed under both its names (embedding and head): which one the artifact stores
    is decided when it is written, and export_artifact drops the other from the spec."""

    out = {}
    for name, t in model.state_dict().items():
        stem = next((name[:-len(s)] for s in (SCALE_SUFFIX, MIN_SUFFIX) if name.endswith(s)), name)
        path = stem.replace("__", ".").split(".")        # a stack's "mlp__up_proj__weight" as a path
        stacked = ".stack." in name
        owner, leaf = (path[-2], path[-1]) if len(path) >= 2 else ("", path[-1])
        if owner in COLUMN_SPLIT and leaf in ("weight", "bias"):
            dim = int(stacked)
        elif owner in ROW_SPLIT and leaf == "weight":
            dim = 1 + int(stacked)
        elif owner in ("embed_tokens", "lm_head", "embedding") and leaf == "weight" and t.dim() == 2:
            dim = 0
        else:
            continue
        if dim < t.dim():
            out[f"model.{name}"] = dim
    return out


def llm_spec(model: torch.nn.Module, opts: StepExportOptions, eos_ids, bos_id, layers: str = "unrolled") -> LLMSpec:
    g = geometry(model.config)
    c = _text_config(model.config)
    tp = TensorParallelSpec(weights=tensor_parallel_dims(model), kv_heads=g.num_kv_heads, kv_cache_dim=2)
    return contract_spec(opts, activation_dtype(model), num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                         head_dim=g.head_dim, vocab_size=int(c.vocab_size), bos_token_id=bos_id, eos_token_ids=eos_ids,
                         model=ModelFacts(num_layers=g.num_layers, num_heads=int(c.num_attention_heads),
                                          num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                          hidden_size=int(c.hidden_size),
                                          sliding_window=getattr(c, "sliding_window", None), layers=layers,
                                          attention="transformers attention interface (hloserve_paged)"),
                         tensor_parallel=tp)


def load_model(cls, path: str, tdtype: torch.dtype, sixteen: torch.dtype | None,
               state_dict: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """`cls` from `path` in `tdtype`, its attention ours, in eval mode; with `state_dict`, its weights
    are those tensors (float32) and `path` gives only the config. Where its matrices are to be
    stored in `sixteen` (hf_layers.sixteen_bit) and every tensor of the checkpoint is stored in
    `sixteen`, it is loaded in `sixteen` (no widening of 1B parameters to `tdtype` and narrowing back,
    seconds each) and made what a `tdtype` load holds: the other tensors widened (exact), the
    non-persistent buffers (rotary tables, embedding scales) computed by a `tdtype` model, config.dtype."""
    if state_dict is not None:
        config = cls.config_class.from_pretrained(path)
        if getattr(config, "quantization_config", None) is not None:   # it describes the files, not `state_dict`
            del config.quantization_config
        model = cls.from_pretrained(None, config=config, state_dict=dict(state_dict), dtype=tdtype,
                                    attn_implementation=ATTN_NAME)
        return model.eval().requires_grad_(False)
    stored = sixteen is not None and tdtype != sixteen and _checkpoint_dtypes(path) == {sixteen}
    model, info = cls.from_pretrained(path, dtype=sixteen if stored else tdtype, attn_implementation=ATTN_NAME,
                                      output_loading_info=True)
    if stored and info.get("missing_keys"):      # initialized, not loaded: as a `tdtype` load initializes them
        model = cls.from_pretrained(path, dtype=tdtype, attn_implementation=ATTN_NAME)
    elif stored:
        hf_layers.widen_all_but_matrices(model, tdtype)
        for key, buf in _initialized_buffers(cls, model.config, tdtype).items():
            owner, _, name = key.rpartition(".")
            model.get_submodule(owner).register_buffer(name, buf, persistent=False)
        for c in {id(model.config): model.config, id(_text_config(model.config)): _text_config(model.config)}.values():
            c.dtype = tdtype
    return model.eval().requires_grad_(False)


def _checkpoint_dtypes(path: str) -> set[torch.dtype | str]:
    """The dtypes of every tensor in the directory's *.safetensors files (read from their headers)."""
    found: set[torch.dtype | str] = set()
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    for name in files:
        with open(os.path.join(path, name), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        found |= {_SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}
    return found if files else {"none"}


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _initialized_buffers(cls, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The non-persistent buffers of `cls(config)` in `dtype` as from_pretrained computes them (its
    weights on the meta device: nothing is allocated for them)."""
    with torch.device("meta"):
        skeleton = cls._from_config(config, dtype=dtype, attn_implementation=ATTN_NAME)
    for key, buf in skeleton.named_non_persistent_buffers():
        owner, _, name = key.rpartition(".")
        skeleton.get_submodule(owner).register_buffer(name, torch.empty_like(buf, device="cpu"), persistent=False)
    skeleton.initialize_weights()
    return dict(skeleton.named_non_persistent_buffers())


def from_hf_directory(path: str, tdtype: torch.dtype = torch.float32, *, opts: StepExportOptions | None = None,
                      kv_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None,
                      state_dict: Mapping[str, torch.Tensor] | None = None,
                      quantize: QuantRequest | None = None, lora: LoraRequest | None = None) -> Source:
    """Any supported HF causal-LM directory -> Source with the prefill/decode step functions
    (`state_dict`: its float32 weights, in place of the directory's *.safetensors: a GGUF's).

    In one pass: load -> quantize (`quantize`: --quantize's module swap on the real layers) -> adapter
    slots (`lora`: hooks on the targeted projections, exporter/llm/lora.py) -> scan the layers (checked
    against the unrolled ones) -> the step's LLMSpec, built once from the final weights (its
    tensor-parallel split names the quantized tensors)."""
    import transformers


    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise SourceError(f"{path}/config.json cannot be read by transformers: {e}") from e
    archs = config.architectures or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if cls is None:
        raise SourceError(f"{path}: transformers {transformers.__version__} has no class for {archs or config.model_type}")
    check_supported(cls, config)
    register_attention()
    sixteen = weight_dtype if weight_dtype is not None else tdtype if tdtype.itemsize == 2 else None
    model = load_model(cls, path, tdtype, sixteen, state_dict)
    route_experts(model)
    lora_spec = lora.resolve(model) if lora is not None else None     # the targets while they are nn.Linear
    stored_first = quantize is not None and quantize.only_stored   # the checkpoint's own; the rest in `sixteen`
    if stored_first:
        quantize.apply(model)
    if sixteen is not None:
        hf_layers.sixteen_bit(model, sixteen, tdtype)
    if quantize is not None and not stored_first:
        quantize.apply(model)
        given = quantize.experts(model) if quantize.experts is not None else None   # a GGUF's own experts
        if given is not None or not quantize.config.native:
            hf_experts.quantize_experts(model, quantize.config, quantize.record, given)
    c = _text_config(model.config)
    g = geometry(model.config)
    if sixteen is not None:   # the 16-bit siblings that read one input: one composite call each (hf_layers.FUSED)
        hf_layers.fuse_projections(model, g.num_kv_heads)
    max_pos = int(getattr(c, "max_position_embeddings", 4096) or 4096)
    opts = opts or StepExportOptions(max_context=min(max_pos, 32768), kv_dtype=kv_dtype)
    if opts.kv_dtype in SMOOTHED:   # before the scan: the calibration step runs the layers unrolled, without adapters
        calibrate_kv_smoothing(model, opts, path)
    if lora_spec is not None:
        opts = dataclasses.replace(opts, lora=lora_spec)
        lora_hooks.attach(model, lora_spec)
    layers = scan_layers(model, opts) if opts.scan else "unrolled"
    if quantize is not None:
        record_stacks(model, quantize.record)
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(c, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    bos = getattr(c, "bos_token_id", None)
    files = {f: os.path.join(path, f) for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))}
    meta: dict[str, Any] = {   # the typed specs become JSON when the artifact is written (export._model_json)
        "task": "causal-lm", "architecture": cls.__name__,
        "config": {"model_type": c.model_type, "num_hidden_layers": g.num_layers, "num_key_value_heads": g.num_kv_heads,
                   "head_dim": g.head_dim, "vocab_size": int(c.vocab_size)},
        "llm": llm_spec(model, opts, eos_ids, None if bos is None else int(bos), layers),
        "text": text_spec(path),
    }
    if weight_dtype is not None and weight_dtype != tdtype:
        meta["weight_dtype"] = dtypes.artifact_name_of_torch(weight_dtype)
    if quantize is not None:
        meta["quantization"] = quantize.config.to_json()
    return Source(f"Hugging Face {cls.__name__} from {path} (paged-cache step through transformers' attention "
                  f"interface)", step_entries(model, opts), meta, files,
                  weight_quant=quantize.record if quantize is not None else None)
