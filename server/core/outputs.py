"""The records that pass between the engine's parts: plan (scheduler -> runner), runner output
(runner -> scheduler) and request outputs (scheduler -> streams). Plain frozen data, built by keyword."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from .sampling import RowContext, SamplingParams, TokenLogprobs


class FinishReason(str, enum.Enum):
    """Why a request ended; the value is what the OpenAI API and the metrics report."""
    STOP = "stop"        # EOS, a stop token or a stop string
    LENGTH = "length"    # max_tokens or the model's context
    ABORT = "abort"      # the client left (or a request was aborted by id)
    ERROR = "error"      # the engine failed, or stopped before the request finished

    __str__ = str.__str__
    __format__ = str.__format__


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledSeq:
    """One request's share of a step; one row of the runner's block tables."""
    request_id: str
    token_ids: tuple[int, ...]      # tokens to run this step: a prefill chunk, or one token for a decode (+ its draft)
    start: int                      # position of token_ids[0] in the sequence (= num_computed_tokens)
    block_table: tuple[int, ...]    # the request's blocks, unpadded (the runner pads with the null block 0)
    needs_logits: bool              # the chunk reaches the end of the known tokens: sample the next one
    sampling: SamplingParams        # how to sample (read only when needs_logits)
    seed: int                       # the request's explicit RNG seed
    sample_index: int               # index of the token to sample among the outputs; (seed, index) picks the draw
    context: RowContext = RowContext()  # what penalties and min_tokens read (empty unless the request uses them)
    score_prompt: tuple[int, ...] = ()  # the whole prompt, on the step that completes it, when its logprobs are asked
    # speculative decoding (core/spec_decode.py): the last len(draft_token_ids) of token_ids are proposed
    # tokens to verify; each token of a verifying share runs in a row of its own (step_rows)
    draft_token_ids: tuple[int, ...] = ()

    def step_rows(self) -> list[tuple[tuple[int, ...], int]]:
        """(token ids, start) of each row of the step this share takes: one row; or, verifying a draft,
        one row per token, all over the request's block table, row j attending to the positions up
        to start + j (the step writes every token's K/V before any token attends), so each token
        is computed as a decode's token is and its row returns its logits."""
        if not self.draft_token_ids:
            return [(self.token_ids, self.start)]
        return [((t,), self.start + j) for j, t in enumerate(self.token_ids)]

    @property
    def is_chunk(self) -> bool:
        """Whether this share computes a chunk (a prompt's, or a preempted request's tokens again): more
        than one token of its own; a decode's share is one token (and its draft, a row per token). (A
        chunk of exactly one token runs, and counts, as a decode.)"""
        return len(self.token_ids) > 1 + len(self.draft_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerPlan:
    """What one step runs; the runner turns it into padded arrays (and computes the cache slots)."""
    seqs: tuple[ScheduledSeq, ...]  # rows of the step: decodes first, then prefill chunks
    num_tokens: int                 # total tokens (sum of len(token_ids)), the T the runner pads to a bucket
    preempted: tuple[str, ...] = ()  # requests preempted while planning this step (blocks already freed)
    # prefix-cache tiers (core/kv_tiers.py), copied by the runner before the step, in this order: each
    # (block, hash) of kv_saves from the device to the tiers (full blocks, read before any write), then
    # each (block, K/V) of kv_loads from the host into its fresh block
    kv_saves: tuple[tuple[int, bytes], ...] = ()
    kv_loads: tuple[tuple[int, Any], ...] = dataclasses.field(default=(), compare=False)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_rows(self) -> int:
        """Rows of the step (S): one per sequence, plus one per drafted token (ScheduledSeq.step_rows)."""
        return len(self.seqs) + sum(len(s.draft_token_ids) for s in self.seqs)

    @classmethod
    def of(cls, seqs: tuple[ScheduledSeq, ...]) -> "SchedulerPlan":
        return cls(seqs=seqs, num_tokens=sum(len(s.token_ids) for s in seqs))


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    """What the runner returns for a plan."""
    # request id -> the tokens the step produced for it, for seqs with needs_logits: one sampled token, or
    # with a draft, the draft tokens accepted and then the token drawn after them
    sampled: Mapping[str, tuple[int, ...]]
    # for requests that asked: one entry per token of `sampled`
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = dataclasses.field(default_factory=dict)
    # request id -> one entry per prompt token after the first (its logprob given the tokens before)
    prompt_logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = dataclasses.field(default_factory=dict)
    # seconds the host waited on the device: the step functions' calls until their logits were on the host
    # (input transfer, execution and output transfer; what the host cannot use for its own work)
    device_seconds: float = 0.0
    # time.perf_counter() when the step's last logits reached the host (0: not measured); async scheduling
    # times a step from its dispatch to this moment (core/engine.py)
    ready_at: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """One streamed update for one request.

    Attributes:
      new_token_ids: tokens generated since the last update (usually one).
      new_text: text since the last update (may be "" while a character or a
        possible stop string is incomplete).
      finish_reason: None while the request runs, then why it ended.
      logprobs: one entry per new token, when the request asked for logprobs.
      prompt_logprobs: with the first token, one entry per prompt token after the first, when the
        request asked for them (SamplingParams.prompt_logprobs).
      num_prompt_tokens / num_output_tokens / num_cached_tokens: usage so far.
      error: what failed, with finish_reason ERROR (e.g. "the engine stopped").
    """
    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def ended_before_start(cls, request_id: str, *, prompt_len: int, reason: FinishReason,
                           error: str) -> "RequestOutput":
        """A request that never ran (refused at admission, or the engine stopped first)."""
        return cls(request_id=request_id, num_prompt_tokens=prompt_len, finish_reason=reason, error=error)
