"""Speculative decoding: its configuration (vLLM's `--speculative-config`), the proposers' interface,
the n-gram proposer and its counters (the draft-model proposer, which runs a second artifact, is
core/draft_model.py).

How a step speculates (the scheduler plans, the runner verifies, the scheduler accepts):

    schedule():  a decoding request whose last sampled token x0 is not yet in the cache gets up to K
                 proposed tokens d1..dk (NgramProposer: prompt lookup; DraftModelProposer: K greedy
                 decode steps of a draft model, its blocks allocated first), planned as k+1 tokens x0,
                 d1..dk (`ScheduledSeq.draft_token_ids`), their KV blocks included, within the step's
                 token budget and rows: each token runs in a row of its own over the request's block
                 table, as a decode's token does, and the step returns one row of logits per row
                 (`ScheduledSeq.step_rows`).
    execute():   one step call computes the logits at every position x0, d1..dk; the sampler draws the
                 token each position would have drawn without speculation and keeps the drafts while
                 they equal those draws, plus the first draw that differs (or the bonus draw after dk)
                 (sampling.verify_draft).
    update():    the accepted tokens are appended one at a time under the usual stop rules; the
                 request's computed length counts only the accepted positions, so the rejected
                 drafts' KV slots are simply written again by a later step.

Nothing here touches the device. The scheduler turns speculation off for a step whose running
requests exceed `disable_by_batch_size` (vLLM's field), where verifying costs more than it saves
(measured, docs/performance.md "Speculative decoding").
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from hloserve.runtime.artifact.errors import HloserveError

from .sampling import SamplingParams

FLAG = "--speculative-config"
EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\''
DRAFT_EXAMPLE = '\'{"model": "/path/to/draft-artifact", "num_speculative_tokens": 4}\''
# running requests above which a step does not speculate (the default of disable_by_batch_size): measured
# on SmolLM2-135M on a 2-core Xeon, docs/performance.md "Speculative decoding"
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# vLLM's defaults where both prompt_lookup sizes are left out
DEFAULT_PROMPT_LOOKUP = 5
FIELDS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"),
          "draft_model": ("method", "model", "num_speculative_tokens", "disable_by_batch_size")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's speculative config: the n-gram (prompt lookup) and draft-model methods.

    Attributes:
      method: "ngram" or "draft_model" (vLLM's other methods are refused).
      model: the draft model ("draft_model" only): an hloserve LLM artifact, or a GGUF file or preset
        that `hloserve serve` exports into the cache (serve.resolve_draft makes it a directory), with
        the target's tokenizer.
      num_speculative_tokens: K, tokens proposed per request and step (at most; fewer where the
        match, the token budget, the step's rows, max_tokens or the context leave less room).
      prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram (the context's last n
        tokens) looked up earlier in the context; the longest that matches wins, at its earliest place.
      disable_by_batch_size: no speculation in a step where more requests than this are running.
    """
    method: str = "ngram"
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method not in FIELDS:
            raise HloserveError(_refuse_method(self.method))
        if (self.method == "draft_model") != isinstance(self.model, str) or self.model == "":
            raise HloserveError(f"{FLAG}: method {self.method!r} with model={self.model!r}: a draft model is "
                                f"named by \"model\" (a path or preset) with method \"draft_model\", e.g. "
                                f"{DRAFT_EXAMPLE}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HloserveError(f"{FLAG}: {name}={v!r} must be an integer >= 1, e.g. {EXAMPLE}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise HloserveError(f"{FLAG}: prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max="
                                f"{self.prompt_lookup_max}; lower prompt_lookup_min or raise prompt_lookup_max")

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """The flag's JSON object, checked field by field (HloserveError naming the field and the fix)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise HloserveError(f"{FLAG} {text!r} is not JSON ({e}); pass an object such as {EXAMPLE}") from None
        if not isinstance(raw, dict):
            raise HloserveError(f"{FLAG} {text!r} is a JSON {type(raw).__name__}; pass an object such as {EXAMPLE}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SpeculativeConfig":
        """vLLM's rules: `method` "ngram" (or `model` "ngram"); a `model` naming anything else is a draft
        model (`method` "draft_model", implied); for n-gram both lookup sizes 5 when neither is given,
        else the missing one equal to the other."""
        raw = dict(raw)
        if raw.get("model") in ("ngram", "[ngram]"):
            raw.setdefault("method", "ngram")
            del raw["model"]
        elif "model" in raw:
            raw.setdefault("method", "draft_model")
        if raw.get("method") == "[ngram]":
            raw["method"] = "ngram"
        method = raw.get("method")
        if method is None:
            raise HloserveError(f"{FLAG}: no 'method'; add \"method\": \"ngram\", e.g. {EXAMPLE}")
        if method not in FIELDS:
            raise HloserveError(_refuse_method(method))
        unknown = sorted(set(raw) - set(FIELDS[method]))
        if unknown:
            raise HloserveError(f"{FLAG}: unknown field(s) {', '.join(map(repr, unknown))}; the {method} method's "
                                f"fields are {', '.join(FIELDS[method])}")
        if "num_speculative_tokens" not in raw:
            raise HloserveError(f"{FLAG}: no 'num_speculative_tokens'; add the tokens to propose per step, "
                                f"e.g. {EXAMPLE if method == 'ngram' else DRAFT_EXAMPLE}")
        if method == "ngram":
            hi, lo = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
            if hi is None and lo is None:
                hi = lo = DEFAULT_PROMPT_LOOKUP
            raw["prompt_lookup_max"] = hi if hi is not None else lo
            raw["prompt_lookup_min"] = lo if lo is not None else hi
        return cls(**raw)


def _refuse_method(method: Any) -> str:
    return (f"{FLAG}: method {method!r} is not supported; use \"method\": \"ngram\" (prompt lookup), e.g. {EXAMPLE}, "
            f"or a draft model, e.g. {DRAFT_EXAMPLE}")


def speculates(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens can be verified together: each position samples from its own
    logits with the same processing. Not for penalties (they read the tokens before each position),
    grammars (their mask moves with each token) or while min_tokens still suppresses the stop tokens."""
    return not params.needs_history and params.structured is None and num_output_tokens >= params.min_tokens


@dataclasses.dataclass(frozen=True)
class DraftAsk:
    """One request's ask of a step: up to k tokens to follow token_ids. With a proposer that writes K/V,
    block_table (the request's) already holds room for len(token_ids) + k - 1 tokens."""
    request_id: str
    token_ids: Sequence[int]
    k: int
    block_table: tuple[int, ...] = ()


class Proposer(Protocol):
    """What the scheduler asks of a proposer (NgramProposer; DraftModelProposer in core/draft_model.py)."""
    writes_kv: bool   # proposing writes K/V into the request's blocks: the scheduler allocates them first

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        """Each ask's proposal, in order (the requests of one step together: a draft model runs them
        batched)."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks are no longer its own."""

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile what proposing runs (before /ready); returns the compiles done."""


class NgramProposer:
    """Prompt lookup (vLLM's NgramProposer): find the longest n-gram, prompt_lookup_min <= n <=
    prompt_lookup_max, ending the context that also occurs earlier in it (the earliest such place),
    and propose the tokens that followed it there."""

    writes_kv = False

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        return [self.propose(a.token_ids, a.k) for a in asks]

    def forget(self, request_id: str) -> None:
        pass

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        return 0

    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to k tokens to follow `token_ids` (empty when no n-gram matches)."""
        n_total = len(token_ids)
        if k < 1 or n_total <= self.min_n:
            return ()
        ctx = np.asarray(token_ids, np.int64)
        # candidate starts of an earlier occurrence: where the context's last token occurs (not last)
        ends = np.flatnonzero(ctx[:-1] == ctx[-1])           # index of the match's last token
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            starts = ends - (n - 1)
            starts = starts[starts >= 0]
            if not starts.size:
                continue
            suffix = ctx[n_total - n:]
            ok = np.ones(starts.size, bool)
            for j in range(n - 1):                            # the last token matched already
                ok &= ctx[starts + j] == suffix[j]
            hits = starts[ok]
            if hits.size:
                at = int(hits[0]) + n                         # the earliest occurrence's next token
                return tuple(int(t) for t in ctx[at:at + k])
        return ()


MAX_WAIT = 64   # steps a request whose proposals keep missing waits at most before proposing again


@dataclasses.dataclass
class DraftLength:
    """One request's proposal length, adapted to its own acceptance (hloserve's, not vLLM's: on a CPU a
    verifying row costs a sizeable part of a decode step, so proposals that keep missing must stop
    costing). A proposal accepted whole doubles the length, up to K; one accepted in part sets it to
    the accepted tokens + 1; one rejected outright halves it and makes the request wait 2, 4, ...
    MAX_WAIT of its steps before it proposes again (reset by the next proposal that is accepted in part).
    The tokens do not depend on it: each position draws what it draws without speculation."""
    limit: int
    wait: int = 0
    misses: int = 0

    def take(self) -> int:
        """Tokens the request may propose this step (0 while it waits; each call is one of its steps)."""
        if self.wait:
            self.wait -= 1
            return 0
        return self.limit

    def observe(self, drafted: int, accepted: int, k_max: int) -> None:
        if accepted == drafted:
            self.limit, self.misses = min(k_max, 2 * self.limit), 0
        elif accepted:
            self.limit, self.misses = accepted + 1, 0
        else:
            self.misses += 1
            self.limit = max(1, self.limit // 2)
            self.wait = min(2 ** self.misses, MAX_WAIT)


@dataclasses.dataclass
class SpecDecodeStats:
    """Counters with vLLM's meaning: a draft is one request's proposal verified in one step; its
    accepted tokens are the drafted tokens kept (the token drawn after them is not counted)."""
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def copy(self) -> "SpecDecodeStats":
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))
