"""The LLM step contract: manifest.model["llm"], typed and versioned, and the one step packer.

An LLM step artifact exports functions (`prefill`, `decode`) that all take the same inputs

    tokens, positions, seq_ids, slot_mapping   int32[T]      T tokens of S sequences, flattened
    block_tables                               int32[S, B]   each sequence's KV blocks, padded with block 0
    context_lens, last_token                   int32[S]      tokens attended to after this step; row of its last token
    kv_cache                                   KVCacheSpec.shape, donated
    -> logits f32[S, vocab], kv_cache

Padding tokens write into the null block 0 and belong to a padding row whose context is empty; padding
rows are never sampled. `pack_step` is the only code that builds these arrays: the server's runner and
the tests both call it, so the model is tested with the same encoding it is served with.

Versions of the contract (a reader must understand every field of the versions it accepts):
  1  2025-11  prefill/decode step functions over a paged cache; kv_cache.shape lists ints and the string
              "num_blocks"; kv_cache.holds names the values' dtype when 16-bit K/V are stored as int16
              bits. Manifests written before the field existed have no "version" and are version 1.
  2  2026-11  adds `tensor_parallel` (TensorParallelSpec): the dim each weight's Megatron split divides
              and the KV heads a tensor-parallel size must divide. Optional: a step without it (every
              version 1 artifact) serves on one device only.
  3  2026-11  adds `lora` (LoraSpec): adapter slots. A step exported with them takes, after kv_cache, a
              per-token adapter slot (`lora_slots` int32[T], 0: none) and each targeted projection's
              A/B stacks of every slot; optional (a step without slots takes the version 2 inputs).
              Also `kv_cache.quant`: "int8" is a quantized cache, int8 rows of head_dim + 2 bytes (the
              values, then the row's bf16 scale: per token and KV head; kernels.INT8_ROW). Optional:
              a cache without it stores its values as version 2's did.
              2026-11-28: `kv_cache.quant` "int8_zp" (what --kv-cache-dtype int8 exports from then on):
              rows of head_dim + 3 bytes, the values, the row's bf16 scale and its int8 zero point
              (kernels.INT8_ZP_ROW). "int8" artifacts keep loading; a reader from before refuses
              "int8_zp" in one line (KVCacheSpec.from_json: upgrade or re-export).
              2026-11-29: `kv_cache.quant` "fp8_e4m3" (--kv-cache-dtype fp8_e4m3, or vLLM's alias fp8):
              rows of head_dim + 2 bytes, the values as float8 e4m3fn bits, then the row's bf16 scale
              (kernels.FP8_E4M3_ROW). A reader from before refuses it in one line, as "int8_zp".
  (next: add a dated line here and raise LLM_VERSIONS' upper bound in the same change)
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Mapping, Sequence

import numpy as np

from . import dtypes
from .errors import ArtifactError
from .kernels import FP8_E4M3_ROW, INT8_ROW, INT8_ZP_ROW, PAGED_ATTENTION, PAGED_ATTENTION_V2, Holds
from .manifest import Manifest, read_manifest
from .text import TextSpec

LLM_VERSIONS = range(1, 4)          # the contract versions this reader accepts
LLM_VERSION = LLM_VERSIONS.stop - 1  # the version writers produce
STEP_INPUTS = ("tokens", "positions", "seq_ids", "slot_mapping", "block_tables", "context_lens", "last_token",
               "kv_cache")
STEP_OUTPUTS = ("logits", "kv_cache")
NULL_BLOCK = 0                       # block 0 is never allocated: padding writes land there
MAX_I32 = 2**31 - 1                  # the step's inputs are int32: no count, id or position of the contract is larger
# the step functions' symbolic dims: T, S, B (padded to buckets by the server) and N (the cache's blocks,
# fixed at load from a memory budget)
NUM_TOKENS, NUM_SEQS, MAX_BLOCKS, NUM_BLOCKS = "num_tokens", "num_seqs", "max_blocks", "num_blocks"
PADDABLE = (NUM_TOKENS, NUM_SEQS, MAX_BLOCKS)   # padding rows/tokens write into the null block: safe to pad
DONATED = ("kv_cache",)                          # the cache is updated in place
# the step's int32 inputs and their dims (the cache's shape is KVCacheSpec.shape)
STEP_DIMS = {"tokens": (NUM_TOKENS,), "positions": (NUM_TOKENS,), "seq_ids": (NUM_TOKENS,),
             "slot_mapping": (NUM_TOKENS,), "block_tables": (NUM_SEQS, MAX_BLOCKS), "context_lens": (NUM_SEQS,),
             "last_token": (NUM_SEQS,)}
KV_BITS = "int16 holding the bits of the K/V values (zeros are zeros)"
# kv_cache.quant -> (storage dtype, the composites' holds code, what a row holds in words)
KV_QUANT = {"int8": ("i8", Holds.INT8_ROWS, INT8_ROW), "int8_zp": ("i8", Holds.INT8_ZP_ROWS, INT8_ZP_ROW),
            "fp8_e4m3": ("i8", Holds.FP8_E4M3_ROWS, FP8_E4M3_ROW)}
# --kv-cache-dtype names that mean another (vLLM's: "fp8" is e4m3 on the platforms it serves here)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def kv_cache_dtype_name(value: str | None) -> str | None:
    """--kv-cache-dtype VALUE under its one name (an alias resolved; None stays None)."""
    return KV_CACHE_DTYPE_ALIASES.get(value, value) if value is not None else None
DOC = "docs/artifact-format.md, 'LLM step contract'"


class Layout(str, enum.Enum):
    """How a step function attends (LLMSpec.functions names one per function; every layout is exact
    for any mix of sequences, they differ in cost)."""
    FLAT = "flat"        # scores T x S*C, K/V gathered once per sequence: few sequences, long chunks
    GATHER = "gather"    # each token's own context, through the hloserve.paged_attention composite
    PAGED = "paged"      # each token's own context, an online softmax over its blocks

    @property
    def cost(self) -> str:
        """What the layout costs per layer (T tokens, S sequences, C = max_blocks * block_size), in words:
        stored after the layout's name in the contract ("gather: ...")."""
        return _COSTS[self]

    @classmethod
    def parse(cls, text: Any) -> "Layout | None":
        """The layout a contract's `functions` entry names ("flat: ..."), or None when it names none."""
        head = str(text).split(":", 1)[0].strip()
        return cls(head) if head in cls._value2member_map_ else None

    @property
    def per_token(self) -> bool:
        """Reads only each token's own context: the layout for decodes."""
        return self is not Layout.FLAT

    @property
    def composites(self) -> tuple[tuple[str, int], ...]:
        """The composites (name, version) the layout's attention may be (version 2 where a scanned
        body's layers differ in their window), none when it is plain StableHLO."""
        versions = (PAGED_ATTENTION, PAGED_ATTENTION_V2)
        return tuple((c.name, c.version) for c in versions) if self is Layout.GATHER else ()


# measured on SmolLM2-135M, CPU: one 512-token prompt: flat 2.2 s, paged 10.0 s, gather 13.1 s;
# 31 decodes at context 1000 + one 256-token chunk (S=32, T=287): flat 40.5 s, paged 9.6 s,
# gather 9.0 s. Pick flat when S is small, gather/paged when many sequences share a step.
_COSTS = {
    Layout.FLAT: "scores T x S*C, K/V gathered once per sequence (S*C): best for few sequences, long chunks",
    Layout.GATHER: "K/V gathered per token (T*C), scores T x C: best for one token per sequence",
    Layout.PAGED: "per-token K/V one block at a time with an online softmax (a loop over max_blocks): "
                  "like gather, but peak memory O(T*block_size) for long contexts",
}


def step_dims() -> dict[str, dict[int, str]]:
    """Each step input's symbolic dims, {input: {axis: dim name}} (STEP_DIMS, and the cache's blocks),
    in STEP_INPUTS order: what an exporter declares dynamic."""
    dims = {name: dict(enumerate(STEP_DIMS[name])) for name in STEP_INPUTS if name in STEP_DIMS}
    return {**dims, "kv_cache": {3: NUM_BLOCKS}}


def example_step(block_size: int) -> dict[str, np.ndarray]:
    """A small valid step (2 sequences, 5 tokens, 3 blocks of table; every dim's size distinct and >= 2,
    as torch.export's dim inference needs), the int32 inputs in STEP_INPUTS order (the cache is the
    exporter's: its shape is the model's)."""
    bs = block_size
    i32 = functools.partial(np.array, dtype=np.int32)
    return {"tokens": i32([1, 2, 3, 4, 5]), "positions": i32([0, 1, 2, 0, 1]), "seq_ids": i32([0, 0, 0, 1, 1]),
            "slot_mapping": i32([bs, bs + 1, bs + 2, 2 * bs, 2 * bs + 1]),
            "block_tables": i32([[1, 0, 0], [2, 0, 0]]), "context_lens": i32([3, 2]), "last_token": i32([2, 4])}


EXAMPLE_CACHE_BLOCKS = 7   # the example cache's N (distinct from every other example size)


def _field(raw: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ArtifactError(f"{where} has no {key!r}; the artifact was written by an incompatible exporter, "
                            f"re-export it ({DOC})")
    return raw[key]


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ArtifactError(f"{where} is {type(raw).__name__ if raw is not None else 'null'}, not an object; the "
                            f"artifact is corrupted, re-export it ({DOC})")
    return raw


def _count(value: Any, where: str, lo: int = 0) -> int:
    """An int in [lo, 2**31 - 1]: the step's inputs are int32, so no count or id of the contract is larger."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= MAX_I32:
        raise ArtifactError(f"{where} = {str(value)[:40]} must be an integer in [{lo}, {MAX_I32}]; the artifact is "
                            f"corrupted, re-export it ({DOC})")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The paged KV cache: an explicit input and output of every step function.

    Attributes:
      input, output: the cache's input and output names ("kv_cache"); the input is donated.
      dtype: storage dtype as a manifest name ("f32", or "i16" when 16-bit values are kept as bits).
      holds: the values' dtype when stored as bits ("bf16"), else None.
      quant: "int8" for a quantized cache (version 3: its rows are head_dim int8 values and a bf16
        scale, so the shape's last dim is head_dim + 2; KV_QUANT), "int8_zp" (also an int8 zero point
        per row: head_dim + 3), "fp8_e4m3" (float8 e4m3fn bits and a bf16 scale: head_dim + 2), else None.
      shape: ints and "num_blocks", e.g. [L, 2, kv_heads, "num_blocks", block_size, head_dim].
    """
    input: str = "kv_cache"
    output: str = "kv_cache"
    dtype: str
    holds: str | None = None
    quant: str | None = None
    shape: tuple[int | str, ...]

    @property
    def stored_name(self) -> str:
        """How K and V are stored, as --kv-cache-dtype names it ("int8", "fp8_e4m3", "bfloat16", "float32", ...)."""
        if self.quant:
            return self.quant.removesuffix("_zp")     # both int8 row formats are --kv-cache-dtype int8
        return np.dtype(dtypes.NUMPY[self.holds or self.dtype]).name

    @property
    def holds_code(self) -> Holds:
        """What the composites' `holds` attribute says of this cache (Holds)."""
        return KV_QUANT[self.quant][1] if self.quant else Holds.named(self.holds)

    def concrete_shape(self, num_blocks: int) -> tuple[int, ...]:
        return tuple(int(num_blocks) if d == NUM_BLOCKS else int(d) for d in self.shape)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(dtypes.NUMPY[self.dtype])

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.concrete_shape(1))) * self.numpy_dtype.itemsize

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output, "dtype": self.dtype,
                **({"holds": self.holds, "stored": KV_BITS} if self.holds else {}),
                **({"quant": self.quant, "stored": KV_QUANT[self.quant][2]} if self.quant else {}),
                "shape": list(self.shape), "donated": True}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "KVCacheSpec":
        raw = _mapping(raw, where)
        shape, dtype = _field(raw, "shape", where), _field(raw, "dtype", where)
        dims_ok = isinstance(shape, list) and shape.count(NUM_BLOCKS) == 1 and all(
            d == NUM_BLOCKS or isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_I32 for d in shape)
        if not dims_ok or not isinstance(dtype, str) or dtype not in dtypes.NUMPY:
            raise ArtifactError(f"{where}: dtype {str(dtype)[:20]!r} / shape {str(shape)[:60]} is not a KV cache this "
                                f"reader understands (one {NUM_BLOCKS!r} dim, the rest positive ints); re-export it ({DOC})")
        names = {k: raw.get(k, "kv_cache") for k in ("input", "output")}
        holds = raw.get("holds")
        if not all(isinstance(v, str) for v in names.values()) or holds is not None and (
                not isinstance(holds, str) or holds not in dtypes.NUMPY):
            raise ArtifactError(f"{where}: input/output {list(names.values())} must be names and holds "
                                f"{str(holds)[:20]!r} a dtype or null; re-export it ({DOC})")
        quant = raw.get("quant")
        if quant is not None and (quant not in KV_QUANT or dtype != KV_QUANT[quant][0] or holds is not None):
            raise ArtifactError(f"{where}: quant {str(quant)[:20]!r} with dtype {dtype!r} is not a quantized KV cache "
                                f"this reader understands ({', '.join(f'{q} in {d}' for q, (d, _, _) in KV_QUANT.items())}); "
                                f"upgrade hloserve or re-export it ({DOC})")
        return cls(**names, dtype=dtype, holds=holds, quant=quant, shape=tuple(shape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallelSpec:
    """How the step splits over N devices (Megatron-style): what the exporter knows about its weights.

    The size N is the server's choice at load (`--tensor-parallel-size`), recorded nowhere here:
    the same artifact serves on 1 device or N. Column-split matrices (q/k/v, gate/up) divide their
    output rows, row-split ones (o, down) their input columns, so each layer needs one all-reduce
    after each row-split product; the KV cache divides its KV-head dim, and the fused q/k/v rows are
    grouped by KV head so a split hands every device whole heads.

    Attributes:
      weights: artifact weight name -> the dim its split divides; weights not named are replicated.
      kv_heads: the model's KV heads: N must divide them.
      kv_cache_dim: the KV cache's KV-head dim.
    """
    weights: Mapping[str, int]
    kv_heads: int
    kv_cache_dim: int

    def check(self, size: int, where: str) -> None:
        """One line when `size` devices cannot split this step."""
        if size < 1 or self.kv_heads % size:
            ok = [n for n in range(1, self.kv_heads + 1) if self.kv_heads % n == 0]
            raise ArtifactError(f"{where}: a tensor-parallel size of {size} does not divide the model's "
                                f"{self.kv_heads} KV heads; use one of {ok}")

    def to_json(self) -> dict:
        return {"weights": dict(self.weights), "kv_heads": self.kv_heads, "kv_cache_dim": self.kv_cache_dim}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "TensorParallelSpec":
        raw = _mapping(raw, where)
        weights = _field(raw, "weights", where)
        if not isinstance(weights, Mapping) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 64
                                                       for d in weights.values()):   # 64: numpy's largest rank
            raise ArtifactError(f"{where}.weights must map weight names to dims; re-export it ({DOC})")
        return cls(weights=dict(weights), kv_heads=_count(_field(raw, "kv_heads", where), f"{where}.kv_heads", 1),
                   kv_cache_dim=_count(_field(raw, "kv_cache_dim", where), f"{where}.kv_cache_dim"))


LORA_SLOTS = "lora_slots"   # the per-token adapter slot input of a step with adapter slots (0: no adapter)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Adapter slots of a step (version 3): one artifact serves any LoRA adapters of rank <= max_rank
    on the targeted projections, several in one batch.

    The step takes, after kv_cache, `lora_slots` int32[T] (each token's slot, 1..slots; 0 and padding:
    no adapter) and for each target T two stacks over the layers, every slot's rank-R block side by side
    (R = max_rank; a smaller rank is zero-padded, the scale folded into B):

        lora_a.T  f32[L, in, slots * R]      columns s*R .. s*R+R-1: slot s+1's A^T
        lora_b.T  f32[L, slots * R, out]     rows    s*R .. s*R+R-1: slot s+1's B^T * scale

    and adds ((x @ A) * onehot(slot)) @ B to the projection's output: two dense products whose cost
    grows with slots * R, no gather (docs/performance.md, "LoRA").

    Attributes:
      slots: adapter slots (adapters served at once).
      max_rank: R, the largest adapter rank a slot holds.
      num_layers: L, the decoder layers (each has every target).
      targets: projection name in a decoder layer (PEFT's target_modules names: "q_proj") ->
        (in_features, out_features).
    """
    slots: int
    max_rank: int
    num_layers: int
    targets: Mapping[str, tuple[int, int]]

    @property
    def width(self) -> int:
        """slots * R: the stacked rank dim of every A and B."""
        return self.slots * self.max_rank

    def inputs(self) -> dict[str, tuple[tuple[int | str, ...], str]]:
        """The step's inputs after kv_cache, in order: name -> (dims, dtype)."""
        out: dict[str, tuple[tuple[int | str, ...], str]] = {LORA_SLOTS: ((NUM_TOKENS,), "i32")}
        for t, (fan_in, fan_out) in self.targets.items():
            out[f"lora_a.{t}"] = ((self.num_layers, fan_in, self.width), "f32")
            out[f"lora_b.{t}"] = ((self.num_layers, self.width, fan_out), "f32")
        return out

    def to_json(self) -> dict:
        return {"slots": self.slots, "max_rank": self.max_rank, "num_layers": self.num_layers,
                "targets": {t: list(d) for t, d in self.targets.items()}}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "LoraSpec":
        raw = _mapping(raw, where)
        targets = _mapping(_field(raw, "targets", where), f"{where}.targets")
        if not targets or not all(isinstance(d, list) and len(d) == 2 for d in targets.values()):
            raise ArtifactError(f"{where}.targets must map projection names to [in, out]; re-export it ({DOC})")
        return cls(slots=_count(_field(raw, "slots", where), f"{where}.slots", 1),
                   max_rank=_count(_field(raw, "max_rank", where), f"{where}.max_rank", 1),
                   num_layers=_count(_field(raw, "num_layers", where), f"{where}.num_layers", 1),
                   targets={str(t): (_count(d[0], f"{where}.targets.{t}", 1), _count(d[1], f"{where}.targets.{t}", 1))
                            for t, d in targets.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """Architecture facts of the exported model, stored beside the contract's keys (what `inspect` and a
    reader may want to know; serving reads none of them).

    Attributes:
      num_layers, num_heads, num_kv_heads, head_dim, hidden_size: the decoder's geometry.
      sliding_window: the attention window in tokens, or None.
      layers: how the layers were exported ("scan", "unrolled", "scan (a period of 2 layers, ...)").
      attention: how attention was exported, when the step says (the generic step: the interface).
      other: keys a writer added that this reader does not know; kept and written back.
    """
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    sliding_window: int | None = None
    layers: str | None = None
    attention: str | None = None
    other: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "other"}
        return {**{k: v for k, v in known.items() if v is not None or k == "sliding_window"}, **dict(self.other)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "ModelFacts":
        names = {f.name for f in dataclasses.fields(cls)} - {"other"}
        return cls(**{k: v for k, v in raw.items() if k in names},
                   other={k: v for k, v in raw.items() if k not in names})


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLMSpec:
    """What a server needs to drive an LLM artifact's step functions (manifest.model["llm"]).

    Attributes:
      version: contract version (module docstring); readers accept LLM_VERSIONS.
      block_size: tokens per KV block.
      max_blocks: the widest block table the functions accept (B's upper bound).
      max_context: max_blocks * block_size, the longest sequence.
      max_seqs, max_tokens: upper bounds of S and T the functions were exported for.
      vocab_size: logits' last dim.
      bos_token_id, eos_token_ids: the tokenizer's special ids as the checkpoint declares them.
      kv_cache: the cache's names, storage and shape.
      functions: step function name -> its attention layout (stored as the Layout's value, then ": " and
        its cost in words).
      model: architecture facts (ModelFacts), stored at the top level beside the contract's keys.
      tensor_parallel: how the step splits over devices (version 2), or None: one device only.
      lora: the step's adapter slots (version 3), or None: it takes no adapters.
    """
    version: int = LLM_VERSION
    block_size: int
    max_blocks: int
    max_seqs: int
    max_tokens: int
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    kv_cache: KVCacheSpec
    functions: Mapping[str, Layout] = dataclasses.field(default_factory=dict)
    model: ModelFacts = ModelFacts()
    tensor_parallel: TensorParallelSpec | None = None
    lora: LoraSpec | None = None

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    def layout(self, function: str) -> Layout | None:
        """The attention layout of a step function, or None when the artifact does not say."""
        return self.functions.get(function)

    def to_json(self) -> dict:
        return {"version": self.version, **self.model.to_json(), "vocab_size": self.vocab_size,
                "block_size": self.block_size, "max_context": self.max_context, "max_blocks": self.max_blocks,
                "max_tokens": self.max_tokens, "max_seqs": self.max_seqs, "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "null_block": NULL_BLOCK, "kv_cache": self.kv_cache.to_json(),
                "step": {"inputs": list(STEP_INPUTS), "outputs": list(STEP_OUTPUTS),
                         "functions": {f: f"{lay.value}: {lay.cost}" for f, lay in self.functions.items()},
                         "context_lens": "tokens in the sequence's context including this step's",
                         "slot_mapping": "block*block_size+offset; padding tokens write into the null block 0"},
                **({"tensor_parallel": self.tensor_parallel.to_json()} if self.tensor_parallel else {}),
                **({"lora": self.lora.to_json()} if self.lora else {})}

    @classmethod
    def from_json(cls, raw: Any, where: str = "model.llm") -> "LLMSpec":
        """Validate and type a stored model["llm"]; every problem is an ArtifactError naming the field."""
        if not isinstance(raw, Mapping):
            raise ArtifactError(f"{where} is not an LLM step contract; serve the artifact with the predict API "
                                f"or export an LLM with `hloserve export`")
        version = raw.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version not in LLM_VERSIONS:
            raise ArtifactError(
                f"{where}: LLM step contract version {version} is outside the supported range "
                f"[{LLM_VERSIONS.start}..{LLM_VERSIONS.stop - 1}]; upgrade hloserve or re-export ({DOC})")
        ints = {k: _count(_field(raw, k, where), f"{where}.{k}", 1)
                for k in ("block_size", "max_blocks", "max_seqs", "max_tokens", "vocab_size")}
        known = {"version", "vocab_size", "block_size", "max_context", "max_blocks", "max_tokens", "max_seqs",
                 "bos_token_id", "eos_token_ids", "null_block", "kv_cache", "step", "tensor_parallel", "lora"}
        if ints["max_blocks"] * ints["block_size"] > MAX_I32:
            raise ArtifactError(f"{where}: max_blocks {ints['max_blocks']} x block_size {ints['block_size']} tokens "
                                f"exceeds the int32 positions of the step; the artifact is corrupted, re-export it ({DOC})")
        step = _mapping(raw.get("step") or {}, f"{where}.step")
        tp = raw.get("tensor_parallel")
        lora = raw.get("lora")
        bos = raw.get("bos_token_id")
        eos = raw.get("eos_token_ids") or []
        if not isinstance(eos, list):
            raise ArtifactError(f"{where}.eos_token_ids = {str(eos)[:40]} must be a list of token ids; re-export it ({DOC})")
        return cls(version=version, **ints,
                   bos_token_id=None if bos is None else _count(bos, f"{where}.bos_token_id"),
                   eos_token_ids=tuple(_count(t, f"{where}.eos_token_ids[{i}]") for i, t in enumerate(eos)),
                   kv_cache=KVCacheSpec.from_json(_field(raw, "kv_cache", where), f"{where}.kv_cache"),
                   functions={f: lay for f, text in _mapping(step.get("functions") or {}, f"{where}.step.functions").items()
                              if (lay := Layout.parse(text)) is not None},
                   tensor_parallel=None if tp is None else TensorParallelSpec.from_json(tp, f"{where}.tensor_parallel"),
                   lora=None if lora is None else LoraSpec.from_json(lora, f"{where}.lora"),
                   model=ModelFacts.from_json({k: v for k, v in raw.items() if k not in known}))

    def check(self, manifest: Manifest, where: str) -> None:
        """Every step function's recorded signature is the contract's (names, dims, dtypes, the donated
        cache, paddable dims): a mismatch is an ArtifactError here, at load, not at the first call."""
        lora = {n: (dtype, dims) for n, (dims, dtype) in self.lora.inputs().items()} if self.lora else {}
        want_in = {**{n: ("i32", dims) for n, dims in STEP_DIMS.items()},
                   self.kv_cache.input: (self.kv_cache.dtype, self.kv_cache.shape), **lora}
        names = list(STEP_INPUTS[:-1]) + [self.kv_cache.input] + list(lora)
        for fn in manifest.functions.values():
            got = [t.name for t in fn.inputs]
            if got != names:
                raise ArtifactError(f"{where}: step function {fn.name!r} takes {got}, not the contract's "
                                    f"{names}; re-export it ({DOC})")
            for t in fn.inputs:
                dtype, dims = want_in[t.name]
                if (t.dtype, tuple(t.shape)) != (dtype, tuple(dims)):
                    raise ArtifactError(f"{where}: step function {fn.name!r} input {t.name!r} is {t.describe()}, "
                                        f"the contract says {dtype}[{','.join(map(str, dims))}]; re-export it ({DOC})")
            outs = [t.name for t in fn.outputs]
            if outs != ["logits", self.kv_cache.output] or self.kv_cache.input not in fn.donated:
                raise ArtifactError(f"{where}: step function {fn.name!r} returns {outs} (donating {list(fn.donated)}), "
                                    f"not logits and the donated {self.kv_cache.output!r}; re-export it ({DOC})")
            if not set(fn.paddable) <= set(PADDABLE):
                raise ArtifactError(f"{where}: step function {fn.name!r} pads {list(fn.paddable)}; the contract "
                                    f"pads only {list(PADDABLE)}; re-export it ({DOC})")

    @classmethod
    def of(cls, manifest: Manifest, path: str) -> "LLMSpec":
        """The typed contract of a manifest, or an ArtifactError saying the artifact is not an LLM."""
        raw = manifest.model.get("llm")
        if raw is None:
            raise ArtifactError(f"{path} is not an LLM step artifact (its manifest has no model.llm): serve it with "
                                f"the predict API, or export an LLM with `hloserve export`")
        return cls.from_json(raw, f"{path}: model.llm")


@dataclasses.dataclass(frozen=True)
class LLMArtifact:
    """An LLM step artifact read once: its directory, manifest, typed step contract and text spec. A
    server reads one of these per start and hands it down (server/wiring.py); nothing below reads
    the manifest again."""
    path: str
    manifest: Manifest
    llm: LLMSpec
    text: TextSpec

    @classmethod
    def read(cls, path: str, manifest: Manifest | None = None) -> "LLMArtifact":
        """Read manifest.json (unless given), type its contract and text spec and check the step
        functions against the contract; ArtifactError if it is not an LLM, its functions do not follow
        the contract or its text spec is malformed."""
        manifest = manifest if manifest is not None else read_manifest(path)
        llm = LLMSpec.of(manifest, path)
        llm.check(manifest, path)
        return cls(path, manifest, llm, TextSpec.of(manifest, path))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRow:
    """One sequence's share of a step: `token_ids` at positions start, start+1, ... with its block table."""
    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


def slots(start: int, n: int, block_table: Sequence[int], block_size: int) -> list[int]:
    """Cache slots (block * block_size + offset) of positions start .. start+n-1."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def pack_step(rows: Sequence[StepRow | tuple[Sequence[int], int, Sequence[int]]], block_size: int, *,
              pad_tokens: int | None = None, pad_seqs: int | None = None,
              pad_blocks: int | None = None, lora_slots: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The step inputs (all but kv_cache and the adapters' stacks) for `rows`, padded to at least the
    given T, S and B.

    rows: StepRow or (token_ids, start, block_table). Padding tokens are token 0 at position 0 in the
    last padding row (row 0 when there is none), writing into the null block. `lora_slots` (a step
    with adapter slots, LoraSpec): each row's adapter slot, given to its tokens as `lora_slots`
    (padding tokens: 0, no adapter).
    """
    rows = [r if isinstance(r, StepRow) else StepRow(token_ids=r[0], start=r[1], block_table=r[2]) for r in rows]
    T, S = sum(len(r.token_ids) for r in rows), len(rows)
    Tp, Sp = max(pad_tokens or T, T), max(pad_seqs or S, S)
    Bp = max([pad_blocks or 1] + [len(r.block_table) for r in rows])
    tokens = np.zeros(Tp, np.int32)
    positions = np.zeros(Tp, np.int32)
    seq_ids = np.full(Tp, Sp - 1 if Sp > S else 0, np.int32)   # padding tokens -> a padding row
    slot_mapping = np.full(Tp, NULL_BLOCK, np.int32)            # ... writing into the null block
    block_tables = np.full((Sp, Bp), NULL_BLOCK, np.int32)
    context_lens = np.zeros(Sp, np.int32)
    last_token = np.zeros(Sp, np.int32)
    t = 0
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        tokens[t:t + n] = r.token_ids
        positions[t:t + n] = np.arange(r.start, r.start + n)
        seq_ids[t:t + n] = i
        slot_mapping[t:t + n] = slots(r.start, n, r.block_table, block_size)
        block_tables[i, :len(r.block_table)] = r.block_table
        context_lens[i] = r.context_len
        t += n
        last_token[i] = t - 1
    out = dict(tokens=tokens, positions=positions, seq_ids=seq_ids, slot_mapping=slot_mapping,
               block_tables=block_tables, context_lens=context_lens, last_token=last_token)
    if lora_slots is not None:
        per_token = np.zeros(Tp, np.int32)
        per_token[:T] = np.repeat(np.asarray(lora_slots, np.int32), [len(r.token_ids) for r in rows])
        out[LORA_SLOTS] = per_token
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One call of a step function: which function, its padded inputs (host int32), how many rows are real."""
    function: str
    inputs: dict[str, np.ndarray]
    num_seqs: int
