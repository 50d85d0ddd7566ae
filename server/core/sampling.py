"""Sampling parameters and sampling from logits (numpy, on the host).

Randomness is explicit: each draw uses a generator built from
(request seed, index of the token being sampled), so a request's tokens
depend only on its seed and its logits, never on which other requests share
the batch, and a preempted-and-recomputed request draws the same tokens again.
There is no global RNG.

Order of operations per row (as in vLLM): logit_bias -> suppress stop tokens before min_tokens ->
repetition / presence / frequency penalties -> temperature 0: argmax; otherwise logits / temperature ->
top-k -> top-p (nucleus) -> min-p -> draw. The processing steps touch only the few ids they name
(bias entries, the request's distinct tokens), never a Python loop over the vocabulary.
Logprobs are the model's log-softmax of the raw logits (before temperature,
top-k and top-p), as OpenAI and vLLM report them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ..text.grammar import GrammarSpec
from .adapters import AdapterRef

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
_NUCLEUS_PROBE = 64  # top-p first tries the 64 most likely tokens before a full sort


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI names).

    Attributes:
      temperature: 0 means greedy (argmax); > 0 divides the logits.
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; None disables it.
      max_tokens: tokens to generate at most (finish_reason "length").
      stop: strings that end generation; the text returned stops before them.
      stop_token_ids: token ids that end generation besides the model's EOS ids.
      ignore_eos: keep generating past EOS (benchmarks).
      seed: makes the draws reproducible; None draws a seed at admission.
      logprobs: None for no logprobs; k in [0, 20] returns the sampled token's
        logprob and the k most likely alternatives.
      prompt_logprobs: the same for every prompt token after the first (vLLM's; what completions'
        echo with logprobs returns), computed once the prompt is in the cache.
      n: completions per prompt; only 1 is supported.
      min_p: drop tokens whose probability is below min_p times the most likely one's (0: off).
      presence_penalty / frequency_penalty: OpenAI's, subtracted per generated token (once /
        per occurrence) from the logits of tokens already generated; in [-2, 2].
      repetition_penalty: vLLM's / HF's multiplicative penalty on tokens of the prompt and the
        output (> 1 discourages repeats; 1: off).
      logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
      min_tokens: EOS and stop token ids cannot be sampled before this many output tokens.
      structured: the grammar the output must match (server/text/grammar.py), or None.
      include_stop_str_in_output: the text keeps the stop string that ended it (vLLM's).
      skip_special_tokens: special tokens' text is left out of the output (vLLM's; default True).
      adapter: the LoRA adapter the request runs with (its `model` named it; core/adapters.py), or None.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: GrammarSpec | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    adapter: AdapterRef | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature={self.temperature!r}: must be a finite number >= 0 (0 means greedy)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p={self.top_p!r}: must be in (0, 1] (1 disables nucleus sampling)")
        _check(self.top_k is None or (_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1))),
               f"top_k={self.top_k!r}: must be an integer >= 1, or 0/-1/None to disable it")
        if self.top_k is not None and self.top_k <= 0:
            object.__setattr__(self, "top_k", None)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop={list(self.stop)!r}: every stop sequence must be a non-empty string")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids={list(self.stop_token_ids)!r}: must be non-negative integers")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
               f"seed={self.seed!r}: must be an integer (64-bit) or null")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs={self.logprobs!r}: must be an integer in [0, {MAX_LOGPROBS}] or null")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                 and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs={self.prompt_logprobs!r}: must be an integer in [0, {MAX_LOGPROBS}] or null")
        _check(_is_int(self.n) and self.n == 1, f"n={self.n!r}: only n=1 is supported; send separate requests for more completions")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p={self.min_p!r}: must be in [0, 1] (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2 <= v <= 2, f"{name}={v!r}: must be in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               f"repetition_penalty={self.repetition_penalty!r}: must be in (0, 10] (1 disables it)")
        bias = tuple((int(t), float(b)) for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                                     else self.logit_bias))
        object.__setattr__(self, "logit_bias", bias)
        _check(all(t >= 0 and -100 <= b <= 100 for t, b in bias),
               "logit_bias: keys must be token ids >= 0 and values in [-100, 100]")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens!r}: must be an integer in [0, max_tokens]")

    @property
    def processes_logits(self) -> bool:
        """Whether logits are changed before sampling (bias, penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the request's earlier tokens (penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one sampled token.

    Attributes:
      token_id: the sampled token.
      logprob: its log-probability under the model (raw logits).
      top: the `logprobs` most likely (token id, logprob) pairs, most likely first.
    """
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def rng_for(seed: int, index: int) -> np.random.Generator:
    """The generator for draw number `index` of a request with `seed` (explicit, no global state)."""
    return np.random.Generator(np.random.PCG64([seed % 2**64, index]))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate token ids, their probabilities) after temperature, top-k and top-p; probabilities sum to 1."""
    ids, w = _candidates(logits, params)
    p = w.astype(np.float64)
    return ids, p / p.sum()


def _candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate token ids, unnormalized f32 weights) after temperature, top-k, top-p and min-p.

    logits: f32[vocab] of one row.
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p
    (tokens tied with the last one kept are kept too). It finds the cut-off
    probability without sorting the vocabulary when the 64 most likely tokens
    already hold the nucleus (the usual case for a trained model), and with a
    value-only sort otherwise; candidates come back in vocabulary order.
    """
    z = np.asarray(logits, np.float32) / np.float32(params.temperature)
    ids = None
    if params.top_k is not None and params.top_k < z.shape[0]:
        ids = np.sort(np.argpartition(-z, params.top_k - 1)[:params.top_k])
        z = z[ids]
    e = np.exp(z - z.max())                                   # unnormalized probabilities, f32
    if params.top_p < 1.0:
        target = params.top_p * float(e.sum(dtype=np.float64))
        head = min(_NUCLEUS_PROBE, e.shape[0])
        top = np.partition(e, e.shape[0] - head)[e.shape[0] - head:] if head < e.shape[0] else e
        if float(top.sum(dtype=np.float64)) < target:
            top = e                                           # the nucleus is larger than the probe
        desc = np.sort(top)[::-1]
        keep = int(np.searchsorted(np.cumsum(desc, dtype=np.float64), target, side="left"))
        cutoff = desc[min(keep, len(desc) - 1)]
        sel = np.flatnonzero(e >= cutoff)
        ids = sel if ids is None else ids[sel]
        e = e[sel]
    if params.min_p > 0:                                      # e is relative to the most likely token
        sel = np.flatnonzero(e >= np.float32(params.min_p))
        ids = sel if ids is None else ids[sel]
        e = e[sel]
    if ids is None:
        ids = np.arange(e.shape[0])
    return ids, e


@dataclasses.dataclass(frozen=True)
class RowContext:
    """What a row's logits processing reads besides its params: the request's tokens so far
    (only when penalties need them) and the token ids it may not sample yet (min_tokens)."""
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    suppress: tuple[int, ...] = ()
    allowed: np.ndarray | None = dataclasses.field(default=None, compare=False)   # bool[vocab]: the grammar's mask

    @property
    def masks(self) -> bool:
        """Whether this row's logits are masked (min_tokens, structured output)."""
        return bool(self.suppress) or self.allowed is not None


def process_logits(logits: np.ndarray, params: SamplingParams, ctx: RowContext) -> np.ndarray:
    """Bias, min_tokens suppression and penalties applied to one row (a copy; raw logits stay for logprobs)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    vocab = out.shape[-1]
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), np.int64)
        keep = ids < vocab
        np.add.at(out, ids[keep], np.fromiter((b for _, b in params.logit_bias), np.float32)[keep])
    if ctx.suppress:
        ids = np.asarray(ctx.suppress, np.int64)
        out[ids[ids < vocab]] = -np.inf
    if ctx.allowed is not None:
        n = min(vocab, ctx.allowed.shape[0])
        out[:n][~ctx.allowed[:n]] = -np.inf
        out[n:] = -np.inf
    if params.repetition_penalty != 1:
        seen = np.unique(np.asarray(ctx.prompt + ctx.output, np.int64))
        seen = seen[seen < vocab]
        v = out[seen]
        out[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and ctx.output:
        ids, counts = np.unique(np.asarray(ctx.output, np.int64), return_counts=True)
        keep = ids < vocab
        out[ids[keep]] -= params.frequency_penalty * counts[keep] + params.presence_penalty
    return out


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, index: int,
               ctx: RowContext = RowContext()) -> tuple[int, TokenLogprobs | None]:
    """Sample one token from one row of logits (f32[vocab]); returns (token, logprobs or None)."""
    raw = logits
    if params.processes_logits or ctx.masks:
        logits = process_logits(logits, params, ctx)
    if params.greedy:
        token = int(np.argmax(logits))
    else:
        ids, w = _candidates(logits, params)
        cdf = np.cumsum(w, dtype=np.float64)
        u = rng_for(seed, index).random() * cdf[-1]
        k = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)  # inverse CDF
        token = int(ids[k])
    return token, (token_logprobs(raw, token, params.logprobs) if params.logprobs is not None else None)


def verify_draft(logits: np.ndarray, draft: Sequence[int], params: SamplingParams, seed: int, index: int,
                 ctx: RowContext = RowContext()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Speculative decoding's acceptance for a point-mass draft (a proposed token, no draft
    distribution): logits f32[len(draft) + 1, vocab], row j the logits after the draft's first j tokens.

    Row j draws the token the request would draw at that position without speculation (draw number
    index + j of its seed); the draft's token j is accepted while it equals that draw, and the first
    draw that differs (or the draw after the whole draft) ends the tokens returned. Greedy: the
    accepted tokens are the argmax ones, so the text is the same as without speculation. Sampling:
    the draft token t is accepted with probability p(t), and when it is not, the token returned is
    distributed as p with t removed and renormalized: the rejection sampling of Leviathan et al. for a
    draft q that is a point mass on t (min(1, p(t)/q(t)) = p(t); the residual max(0, p - q) is p off
    t), so each token keeps the target distribution; and since the draw is the one made without
    speculation, a seeded request draws the same tokens whether or not a step speculated.
    Returns (tokens, their logprobs or Nones), 1..len(draft)+1 tokens.
    """
    tokens: list[int] = []
    lps: list[TokenLogprobs | None] = []
    for j in range(len(draft) + 1):
        token, lp = sample_row(logits[j], params, seed, index + j, ctx)
        tokens.append(token)
        lps.append(lp)
        if j == len(draft) or token != draft[j]:
            break
    return tokens, lps


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    lp = _log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        part = np.argpartition(-lp, k - 1)[:k]
        part = part[np.lexsort((part, -lp[part]))]            # most likely first, ties by token id
        top = tuple((int(t), float(lp[t])) for t in part)
    return TokenLogprobs(token, float(lp[token]), top)


def sample(logits: np.ndarray, params: Sequence[SamplingParams], seeds: Sequence[int],
           indexes: Sequence[int], contexts: Sequence[RowContext] | None = None,
           rows: Sequence[int] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row. logits: f32[S, vocab]; row i of params is logits[rows[i]] (default: row
    i; other rows are padding and ignored). Plain greedy rows take one argmax over the logits as they
    lie (a copy of the rows first cost more than the argmax: 16 x 49,152 f32 is 3 MiB, in fresh pages
    each step); the others go row by row."""
    logits = np.asarray(logits)
    rows = list(range(len(params))) if rows is None else [int(r) for r in rows]
    contexts = contexts or [RowContext()] * len(params)
    tokens, lps = [], []
    greedy = [p.greedy and p.logprobs is None and not p.processes_logits and not contexts[i].masks
              for i, p in enumerate(params)]
    argmax = np.argmax(logits[:max(rows) + 1], axis=-1) if any(greedy) else None
    for i, p in enumerate(params):
        if greedy[i]:
            tokens.append(int(argmax[rows[i]]))
            lps.append(None)
        else:
            t, lp = sample_row(logits[rows[i]], p, seeds[i], indexes[i], contexts[i])
            tokens.append(t)
            lps.append(lp)
    return tokens, lps
