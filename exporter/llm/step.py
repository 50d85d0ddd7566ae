"""The LLM step contract's plumbing (models/hf_causal.py builds the step of any transformers causal
LM on it): the export options, the entry points over the contract's inputs and dims, the
manifest's LLMSpec, the K/V write and the online-softmax "paged" attention layout.

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

A step first writes this step's K/V through slot_mapping, then each token attends to the cache
positions c of its sequence with c <= its position and c < context_len. Block 0 is the null block:
padding tokens write there and padding rows of block_tables point there; it is never read
unmasked. Masked scores use a finite minimum, so padded rows give finite garbage, never NaN.

Three attention layouts share that contract (all exact for any mix of sequences; they differ in
cost, see runtime/artifact/llm.py's Layout.cost):
  * "gather" (entry point `decode`): every token attends over its own sequence's context,
    [T, B*block_size]; best when T ~ S (one token per sequence). It is the
    `hloserve.paged_attention` composite (runtime/artifact/kernels.py): its portable decomposition
    gathers each token's padded context; the CPU runtime runs a kernel that reads only the blocks
    in use, in place.
  * "flat" (entry point `prefill`): every token scores against all S contexts at once,
    [T, S*B*block_size], masked to its own; best when S is small and T large (prompts, chunked
    prefill).
  * "paged" (not exported by default): gather one block at a time in a loop with an online
    softmax; bounded memory for long contexts and many sequences.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from hloserve.runtime.artifact.kernels import Holds
from hloserve.runtime.artifact.llm import (DONATED, EXAMPLE_CACHE_BLOCKS, LORA_SLOTS, MAX_BLOCKS, NUM_BLOCKS, NUM_SEQS, NUM_TOKENS,
                                           PADDABLE, STEP_INPUTS, STEP_OUTPUTS, KVCacheSpec, Layout, LLMSpec, LoraSpec,
                                           ModelFacts, TensorParallelSpec, example_step, step_dims)

from .. import dtypes
from .._private import torch_scan
from ..composites.paged_attention import quantize_fp8_e4m3_rows, quantize_int8_zp_rows, within_window
from ..export import EntryPoint

# Finite "minus infinity" for masked attention scores (f32): fully masked rows
# (padding) softmax to uniform instead of NaN.
_MASKED = -1e30



# --kv-cache-dtype's quantized caches: the torch dtype its flag maps to -> (the composites' `holds`, the
# manifest's kv_cache.quant, the writer of its rows)
QUANT_KV = {torch.int8: (Holds.INT8_ZP_ROWS, "int8_zp", quantize_int8_zp_rows),
            torch.float8_e4m3fn: (Holds.FP8_E4M3_ROWS, "fp8_e4m3", quantize_fp8_e4m3_rows)}


# The quantized caches whose K and V are stored rotated (kv_rotation), and those whose keys are also
# smoothed (exporter/llm/kv_smooth.py, in the rotated basis). Each kept where it measurably helps
# (served, mean |log-prob difference| against the bf16 cache on two 1,500-token windows of
# tests/data/web_genesis.txt, docs/quantization.md): int8 both; fp8 the rotation (none 0.0919 / 0.0867,
# rotated 0.0821 / 0.0733) but not the smoothing (rotated and smoothed 0.0913 / 0.0791).
ROTATED = frozenset(QUANT_KV)
SMOOTHED = frozenset({torch.int8})


def cache_holds(kv_dtype: torch.dtype | None, cache_dtype: torch.dtype) -> int:
    """The paged-attention composites' `holds` of the step's cache: int8 rows with a zero point
    (Holds.INT8_ZP_ROWS) for an int8 `kv_dtype` (--kv-cache-dtype int8), fp8 rows (FP8_E4M3_ROWS) for
    float8_e4m3fn, else what a cache of that float dtype holds."""
    return int(QUANT_KV[kv_dtype][0]) if kv_dtype in QUANT_KV else holds_of(kv_dtype or cache_dtype)


def cache_storage(kv_dtype: torch.dtype | None, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(storage dtype, bytes past head_dim per row) of the step's cache: int8 rows with their scale
    (and zero point) (--kv-cache-dtype int8, fp8_e4m3: both int8 storage), int16 bits of a 16-bit
    float, or the model dtype itself."""
    if kv_dtype in QUANT_KV:
        return torch.int8, QUANT_KV[kv_dtype][0].row_extra
    return (torch.int16 if kv_dtype is not None else dtype), 0


def kv_rotation(kv_dtype: torch.dtype | None, head_dim: int) -> torch.Tensor | None:
    """The orthonormal Hadamard rotation an int8 or fp8 cache's K and V are stored in, f32 [D, D], or
    None (other caches). Rotating each head's q, k and v by the same orthonormal H keeps q.k and the
    softmax (q H . k H = q . k) and out = (sum p v H) H^T; it spreads an outlier channel over the
    row, so the row's scale (its range / 255) no longer crushes the other channels (SmolLM2, symmetric
    rows: mean |log-prob difference| against a bf16 cache 0.039 -> 0.025, docs/quantization.md). Blocks of the
    largest power of two dividing D (Sylvester's construction): symmetric, so H^T = H."""
    if kv_dtype not in ROTATED:
        return None
    n = head_dim & -head_dim
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / n ** 0.5] * (head_dim // n))


def holds_of(dtype: torch.dtype) -> int:
    """What a cache or weight stack of `dtype` holds, as the hloserve.paged_attention and
    hloserve.layer_linear composites' `holds` says it (Holds.OWN for an f32 cache); a plain int:
    what torch.ops and the traced graph carry."""
    return int(Holds.of_dtype(str(dtype)))


@dataclasses.dataclass(frozen=True)
class StepExportOptions:
    """Cache geometry and dim ranges of the exported step functions.

    Attributes:
      block_size: tokens per KV block (fixed in the artifact).
      max_context: longest sequence (positions) the artifact serves; max_blocks = max_context / block_size.
      max_tokens / max_seqs: upper bounds of the T and S dims of one step.
      max_num_blocks: upper bound of the cache's block count (fixed at load time from memory).
      scan: decoder layers as one scanned body (default) or unrolled.
      functions: entry point name -> attention layout ("flat", "gather" or "paged"); every one
        takes the full step contract and is exact for any mix of sequences (see Layout.cost).
      kv_dtype: bfloat16/float16 K and V under float32 activations (LlamaStep); int8: K and V quantized
        per token and KV head (int8 rows with a bf16 scale and an int8 zero point, KVCacheSpec.quant
        "int8_zp"); float8_e4m3fn: the same as fp8 e4m3 values with a bf16 scale ("fp8_e4m3"); None:
        the model dtype.
      lora: adapter slots (the step takes their inputs after kv_cache; exporter/llm/lora.py), or None.
    """
    block_size: int = 16
    max_context: int = 4096
    max_tokens: int = 4096
    max_seqs: int = 256
    max_num_blocks: int = 1 << 20
    scan: bool = True
    functions: tuple[tuple[str, str], ...] = (("prefill", "flat"), ("decode", "gather"))
    kv_dtype: torch.dtype | None = None
    lora: LoraSpec | None = None

    @property
    def max_blocks(self) -> int:
        return -(-self.max_context // self.block_size)


def contract_entries(make_step: Callable[[str], torch.nn.Module], opts: StepExportOptions, num_layers: int,
                     num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list:
    """One EntryPoint per `opts.functions` (name, attention layout) over the LLM step contract's
    inputs and dims; `make_step(layout)` builds the module (models/llama.py, models/hf_causal.py)."""

    # the contract's dims (runtime/artifact/llm.py step_dims) with the ranges these options export
    ranges = {NUM_TOKENS: (1, opts.max_tokens), NUM_SEQS: (1, opts.max_seqs), MAX_BLOCKS: (1, opts.max_blocks),
              NUM_BLOCKS: (2, opts.max_num_blocks)}
    dim = {name: torch.export.Dim(name, min=lo, max=hi) for name, (lo, hi) in ranges.items()}
    dyn = tuple({axis: dim[name] for axis, name in step_dims()[n].items()} for n in STEP_INPUTS)
    ex = {name: torch.from_numpy(a) for name, a in example_step(opts.block_size).items()}
    stored, extra = cache_storage(opts.kv_dtype, dtype)
    ex["kv_cache"] = torch.zeros(num_layers, 2, num_kv_heads, EXAMPLE_CACHE_BLOCKS, opts.block_size, head_dim + extra,
                                 dtype=stored)
    names = STEP_INPUTS
    if opts.lora is not None:     # the adapters' inputs after the cache: per-token slots [T], static stacks
        adapters = lora_example(opts.lora, len(ex["tokens"]))
        ex.update(adapters)
        names = STEP_INPUTS + tuple(adapters)
        dyn = dyn + tuple({0: dim[NUM_TOKENS]} if n == LORA_SLOTS else {} for n in adapters)
    args = tuple(ex[n] for n in names)
    return [EntryPoint(name, make_step(att), args, dyn, input_names=names, output_names=STEP_OUTPUTS,
                       donated=DONATED, paddable=PADDABLE)
            for name, att in opts.functions]


def lora_example(spec: LoraSpec, num_tokens: int) -> dict[str, torch.Tensor]:
    """The adapter inputs of the contract's example step: every token in slot 1 but the first (none),
    small nonzero stacks (the eager scan check sees the adapters' path run)."""
    gen = torch.Generator().manual_seed(0)
    out = {LORA_SLOTS: torch.tensor([0] + [1] * (num_tokens - 1), dtype=torch.int32)}
    for name, (dims, _) in spec.inputs().items():
        if name != LORA_SLOTS:
            out[name] = torch.randn(*dims, generator=gen) * 0.01
    return out


def contract_spec(opts: StepExportOptions, dtype: torch.dtype, *, num_layers: int, num_kv_heads: int, head_dim: int,
                  vocab_size: int, bos_token_id: int | None, eos_token_ids, model: ModelFacts,
                  tensor_parallel: TensorParallelSpec | None = None) -> LLMSpec:
    """The step's contract (the manifest's model["llm"], written by export_artifact) built with `opts` (the cache holds int16 bits of
    opts.kv_dtype when set, int8 rows when it is int8 or float8_e4m3fn, else `dtype`); `model` adds the
    architecture facts."""
    stored, extra = cache_storage(opts.kv_dtype, dtype)
    bits = opts.kv_dtype is not None and opts.kv_dtype not in QUANT_KV
    kv = KVCacheSpec(dtype=dtypes.artifact_name_of_torch(stored),
                     holds=dtypes.artifact_name_of_torch(opts.kv_dtype) if bits else None,
                     quant=QUANT_KV[opts.kv_dtype][1] if opts.kv_dtype in QUANT_KV else None,
                     shape=(num_layers, 2, num_kv_heads, NUM_BLOCKS, opts.block_size, head_dim + extra))
    return LLMSpec(block_size=opts.block_size, max_blocks=opts.max_blocks, max_seqs=opts.max_seqs,
                   max_tokens=opts.max_tokens, vocab_size=vocab_size, bos_token_id=bos_token_id,
                   eos_token_ids=tuple(eos_token_ids), kv_cache=kv,
                   functions={name: Layout(att) for name, att in opts.functions},
                   model=model, tensor_parallel=tensor_parallel, lora=opts.lora)


def write_kv(cache: torch.Tensor, layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             kv_dtype: torch.dtype | None) -> torch.Tensor:
    """The cache [L, 2, KV, N, BS, D] with this step's K and V ([T, KV, D] each) of layer `layer`
    (0-dim) written at `slots` [T] (block * BS + offset), in one scatter. With `kv_dtype` the cache
    holds int16 bits of that 16-bit float, or int8 rows with their scale and zero point (int8: each
    token's K and V quantized per KV head here), or fp8 rows with their scale (float8_e4m3fn, the
    same way); otherwise values take the cache's dtype."""
    L, _, KV, N, BS, D = cache.shape                                      # D: the row (head_dim + 3 for int8, + 2 fp8)
    T = k.shape[0]
    flat = cache.reshape(L, 2, KV, N * BS, D)                             # [L, 2, KV, N*BS, D]
    idx_l = layer.expand(2, T)                                            # [2, T]
    idx_kv = torch.arange(2, device=k.device)[:, None].expand(2, T)      # [2, T]: K or V
    idx_slot = slots[None, :].expand(2, T)                                # [2, T]
    values = torch.stack([k, v])                                          # [2, T, KV, head_dim]
    if kv_dtype in QUANT_KV:
        values = QUANT_KV[kv_dtype][2](values)                            # [2, T, KV, head_dim + 3 / + 2]
    elif kv_dtype is not None:
        values = values.to(kv_dtype).view(torch.int16)                    # the cache holds bits
    elif values.dtype != cache.dtype:
        values = values.to(cache.dtype)
    # the kv-head dim is not indexed (a slice of every write), so a cache split by heads is
    # written where it lies: XLA's SPMD partitioner splits the scatter instead of gathering the cache
    flat = torch.ops.aten.index_put(flat, [idx_l, idx_kv, None, idx_slot], values)
    return flat.reshape(L, 2, KV, N, BS, D)                               # [L, 2, KV, N, BS, D]


def paged_attention(qg: torch.Tensor, cache: torch.Tensor, layer: torch.Tensor, blocks: torch.Tensor,
                    pos: torch.Tensor, ctx_len: torch.Tensor, window, *, scale: float | None = None,
                    softcap: float = 0.0) -> torch.Tensor:
    """Attention over each token's own paged context, one block at a time with an online softmax.

    qg [T, KV, G, D] (rotated queries); cache [L, 2, KV, N, BS, D] read at layer `layer` (0-dim);
    blocks [B, T] (block j of each token's sequence); pos, ctx_len [T]. Peak memory is O(T * block_size) per layer, whatever
    the number of sequences or the context length. Scores are `scale` (default 1/sqrt(D)) times
    q.k, soft-capped (softcap * tanh(s / softcap)) when softcap > 0. Returns [T, KV, G, D] in qg's dtype.
    """
    scan = torch_scan()

    T, KV, G, D = qg.shape
    BS = cache.shape[4]
    qk_scale = D ** -0.5 if scale is None else float(scale)
    m0 = torch.full((T, KV, G), _MASKED, dtype=torch.float32, device=qg.device)   # running max
    s0 = torch.zeros((T, KV, G), dtype=torch.float32, device=qg.device)          # running sum
    acc0 = torch.zeros((T, KV, G, D), dtype=torch.float32, device=qg.device)     # running numerator
    block_ids = torch.arange(blocks.shape[0], device=qg.device)

    def one_block(carry, xs):
        m, ssum, acc = carry
        bids, j = xs                                                      # [T], 0-dim
        kv = cache[layer.expand_as(bids), :, :, bids]                     # [T, 2, KV, BS, D]
        scores = torch.einsum("tkgd,tkbd->tkgb", qg, kv[:, 0]).float() * qk_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)                # [T, KV, G, BS]
        cpos = j * BS + torch.arange(BS, device=qg.device)                # [BS]
        seen = (cpos[None, :] <= pos[:, None]) & (cpos[None, :] < ctx_len[:, None])   # [T, BS]
        windowed = within_window(cpos[None, :], pos[:, None], window)
        if windowed is not None:
            seen = seen & windowed
        scores = torch.where(seen[:, None, None, :], scores, _MASKED)
        m_new = torch.maximum(m, scores.amax(dim=-1))                     # [T, KV, G]
        p = torch.exp(scores - m_new[..., None])                          # [T, KV, G, BS]
        scale = torch.exp(m - m_new)                                      # [T, KV, G]
        ssum = ssum * scale + p.sum(dim=-1)
        acc = acc * scale[..., None] + torch.einsum("tkgb,tkbd->tkgd", p.to(qg.dtype), kv[:, 1]).float()
        return (m_new, ssum, acc), m_new.new_zeros(())

    (m, ssum, acc), _ = scan(one_block, (m0, s0, acc0), (blocks, block_ids))
    return (acc / ssum[..., None]).to(qg.dtype)                           # [T, KV, G, D]
