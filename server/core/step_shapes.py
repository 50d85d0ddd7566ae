"""What a scheduler plan becomes as a step call, before anything runs: the buckets the runner
compiles (RunnerConfig), the padded call of one plan (build_step), every call shape warm-up compiles
(warmup_shapes) and which step function runs what (StepPolicy). Pure functions of the plan, the
config and the artifact's spec: model_runner.py executes what they describe.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from hloserve.runtime.artifact.llm import Layout, LLMSpec, StepBatch, pack_step
from hloserve.runtime.buckets import geometric

from .outputs import SchedulerPlan

if TYPE_CHECKING:
    from hloserve.runtime.kernels import KernelBackend


def fit_bucket(buckets: Sequence[int], n: int, what: str) -> int:
    """The smallest of `buckets` that holds n (what: the dim, named in the error)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what}={n} is above the largest bucket {buckets[-1]}; the scheduler's limits must not exceed "
                     f"the runner's buckets (max_num_batched_tokens / max_num_seqs / max_model_len)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Shapes the runner compiles and the cache it allocates (built by ServeConfig.resolve).

    Attributes:
      token_buckets: padded T of prefill steps (the largest >= the scheduler's max_num_batched_tokens).
      seq_buckets: padded S of decode and prefill steps (the largest >= max_num_seqs); decode
        steps use T = S.
      block_buckets: padded B, the block-table width (the largest covers max_model_len).
      num_blocks: KV blocks N, or None to derive it from kv_cache_bytes.
      kv_cache_bytes: device memory for the KV cache when num_blocks is None.
      lone_token_buckets: padded T of prompt steps of one sequence, finer than token_buckets where
        padding rows cost what real ones do (`with_lone_buckets`); () : token_buckets.
    """
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    block_buckets: tuple[int, ...]
    num_blocks: int | None
    kv_cache_bytes: int
    lone_token_buckets: tuple[int, ...] = ()

    def tokens_for(self, num_seqs: int) -> tuple[int, ...]:
        """The padded T of a prompt step padded to `num_seqs` sequences."""
        return self.lone_token_buckets if num_seqs == 1 and self.lone_token_buckets else self.token_buckets

    def with_lone_buckets(self, step: int) -> "RunnerConfig":
        """This config with finer T buckets for prompt steps of one sequence: every multiple of `step` up
        to 8 x step besides token_buckets, so a lone request's prompt pads to the next `step` tokens there
        (the defaults: 32, 64, ..., 256 against 32, 128, 256; five executables more)."""
        fine = range(step, min(self.token_buckets[-1], 8 * step) + 1, step)
        return dataclasses.replace(self, lone_token_buckets=tuple(sorted({*self.token_buckets, *fine})))

    @classmethod
    def for_limits(cls, *, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int,
                   num_blocks: int | None, kv_cache_bytes: int, min_tokens: int, block_buckets: int,
                   prefill_growth: int, block_growth: int) -> "RunnerConfig":
        """Buckets up to the scheduler's limits.

        S (decode and prefill): powers of two: a padding sequence costs prefill's flat
        attention a whole context (T x C), so S buckets stay fine. Prefill T: min_tokens times
        powers of `prefill_growth`. B: `block_buckets` widths ending at max_blocks, `block_growth`
        apart.
        """
        widths = [max_blocks]
        while len(widths) < block_buckets and widths[-1] // block_growth >= 1:
            widths.append(widths[-1] // block_growth)
        seqs = geometric(1, max_num_seqs)
        return cls(token_buckets=geometric(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens,
                                           prefill_growth),
                   seq_buckets=seqs, block_buckets=tuple(sorted(set(widths))), num_blocks=num_blocks,
                   kv_cache_bytes=kv_cache_bytes)


def build_step(plan: SchedulerPlan, cfg: RunnerConfig, block_size: int, *, decode_fn: str = "decode",
               prefill_fn: str = "prefill", lora: bool = False) -> StepBatch:
    """A plan as one call: the function (decode when every row runs one token) and its inputs padded
    to cfg's buckets by the contract's packer (which also computes each token's cache slot; with
    `lora`, each token's adapter slot)."""
    seqs = plan.seqs
    S, T = plan.num_rows, plan.num_tokens
    is_decode = T == S   # one token per row: decodes, and the rows of verified drafts
    Sp = fit_bucket(cfg.seq_buckets, S, "num_seqs")
    Tp = Sp if is_decode else fit_bucket(cfg.tokens_for(Sp), T, "num_tokens")
    Bp = fit_bucket(cfg.block_buckets, max(len(s.block_table) for s in seqs), "max_blocks")
    slots = [s.sampling.adapter.slot if s.sampling.adapter else 0 for s in seqs for _ in s.step_rows()]
    inputs = pack_step([(tokens, start, s.block_table) for s in seqs for tokens, start in s.step_rows()], block_size,
                       pad_tokens=Tp, pad_seqs=Sp, pad_blocks=Bp, lora_slots=slots if lora else None)
    return StepBatch(function=decode_fn if is_decode else prefill_fn, inputs=inputs, num_seqs=S)


def warmup_shapes(cfg: RunnerConfig, decode_fn: str = "decode", prefill_fn: str = "prefill") -> list[tuple[str, int, int, int]]:
    """Every (function, T, S, B) that build_step can produce under cfg.

    Decode steps: T = S = each seq bucket. Prefill steps have T > S: a seq bucket
    whose smallest member is m pairs with every token bucket holding m + 1 tokens or more.
    """
    out = []
    for b in cfg.block_buckets:
        out += [(decode_fn, s, s, b) for s in cfg.seq_buckets]
        prev = 0
        for s in cfg.seq_buckets:
            smallest = prev + 1            # the fewest sequences padded to bucket s
            prev = s
            tokens = cfg.tokens_for(s)
            if smallest + 1 > tokens[-1]:
                continue
            t_min = fit_bucket(tokens, smallest + 1, "num_tokens")
            out += [(prefill_fn, t, s, b) for t in tokens if t >= t_min]
    return list(dict.fromkeys(out))



@dataclasses.dataclass(frozen=True)
class StepPolicy:
    """Which step function runs what, chosen before the artifact loads from its functions' layouts
    (LLMSpec.layout) and what the runtime will run as kernels (runtime.kernel_support).

    With its attention composite run by a kernel (the CPU's, or a GPU's or TPU's Pallas kernel), the
    per-token `decode` reads only each token's own blocks, for prompt chunks too: then every step is
    ONE call of it, mixed or not (CPU, T=256: 83-125 ms against the flat layout's 113-255 ms, S =
    1..4; docs/performance.md), and one block-table width (the longest context's) serves every step:
    a wider table costs the kernel nothing (20 executables instead of 100; on an H200 each took ~3.4 s
    to compile, docs/deploy.md). Without one, its decomposition gathers every
    token's padded context, so prompt chunks take the flat `prefill` and a mixed step is two calls.
    """
    decode_fn: str          # runs decode-only steps (T = S)
    prefill_fn: str         # runs steps with prompt chunks
    one_call: bool          # a mixed step is one call of decode_fn

    @classmethod
    def choose(cls, llm: LLMSpec, functions: Sequence[str], kernels: "KernelBackend", path: str) -> "StepPolicy":
        layouts = {f: llm.layout(f) for f in functions}
        per_token = [f for f, lay in layouts.items() if lay is not None and lay.per_token]
        flat = [f for f, lay in layouts.items() if lay is Layout.FLAT]
        # artifacts that name no layout: the functions' conventional names
        decode = (per_token or [f for f in ("decode", "prefill") if f in functions] or [None])[0]
        if decode is None:
            raise ValueError(f"artifact {path} has neither a 'decode' nor a 'prefill' step function "
                             f"(it has {sorted(functions)})")
        prefill = (flat or [f for f in ("prefill",) if f in functions] or [decode])[0]
        composites = layouts[decode].composites if layouts.get(decode) else ()
        one_call = bool(composites) and set(composites) <= kernels.composites
        return cls(decode_fn=decode, prefill_fn=decode if one_call else prefill, one_call=one_call)

    def buckets(self, cfg: RunnerConfig) -> RunnerConfig:
        """cfg with the block-table widths this policy compiles (the widest alone for one call)."""
        return dataclasses.replace(cfg, block_buckets=cfg.block_buckets[-1:]) if self.one_call else cfg
