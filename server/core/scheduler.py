"""Continuous-batching scheduler: the policy half of the engine loop.

    plan = scheduler.schedule()        # host state only: who runs, which tokens, which slots
    out = runner.execute(plan)         # the device step + sampling
    outputs = scheduler.update(plan, out)

(One exception: with a draft model, speculative decoding's proposer, handed in by server/wiring.py,
runs the draft's own steps inside schedule(), on the draft's runner and cache; core/draft_model.py.)

The algorithm of `schedule()`. Every request has `num_computed_tokens` (tokens
whose K/V is in the cache) and `token_ids` (prompt + generated so far); a step
runs some of the tokens in between. There is no separate "prefill" and
"decode" phase: a decode is a request with exactly one token left to compute,
a prefill chunk is any larger run.

1. Running requests, oldest first. Each request in decode gets exactly one
   token; the budget for all of them is reserved before any prefill chunk is
   sized, so a long prompt never starves decodes. A running request still in
   prefill gets `min(tokens left, budget left after the reservation)`, never
   one token of a longer remainder and never leaving one alone (`chunk_tokens`).
   Blocks come from the block manager; if none are free, a prefill chunk
   shrinks to the slots available, and otherwise the NEWEST running request is
   preempted (its blocks freed, its computed tokens forgotten, back to the
   front of the waiting queue: preempt-and-recompute; with prefix-cache tiers its
   full blocks were saved to host RAM as they filled, so its readmission loads them
   back and recomputes only its last, partial block). If the newest is the
   request itself, it preempts itself. Oldest-first means the oldest request
   always makes progress, so preemption cannot livelock.
2. Waiting requests, FIFO, while fewer than `max_num_seqs` run, budget is
   left and nothing was preempted this step: look up the prefix cache, size
   the first chunk to the budget, and admit if its blocks fit while leaving
   a watermark of free blocks for the running decodes. The first waiting
   request that does not fit stops admission (no overtaking).

A chunk that reaches the end of a request's known tokens needs logits: the
runner samples its next token. `update()` appends sampled tokens, hashes
newly full blocks for the prefix cache, checks the token-level stop rules
(max_tokens, EOS / stop token ids, the model's context length), frees
finished requests' blocks and emits one `RequestOutput` (token ids, no text)
per request that produced a token. Text and stop strings are the
detokenizer's (core/detokenizer.py), as in vLLM, and grammars the engine's structured-output
component's (core/structured_output.py).
"""
from __future__ import annotations

import collections
import dataclasses
import random
from typing import Sequence

from .block_manager import BlockManager
from .outputs import FinishReason, RequestOutput, RunnerOutput, ScheduledSeq, SchedulerPlan
from .request import PLACEHOLDER, Request, RequestStatus, check_context
from .sampling import RowContext, SamplingParams, TokenLogprobs
from .spec_decode import (DraftAsk, DraftLength, NgramProposer, Proposer, SpecDecodeStats, SpeculativeConfig,
                          speculates)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one step (built by ServeConfig.resolve, which holds the defaults).

    Attributes:
      max_num_seqs: requests running at once (rows of a step; <= the runner's largest S bucket).
      max_num_batched_tokens: tokens per step (<= the runner's largest T bucket); >= max_num_seqs
        so every running decode fits in one step.
      max_model_len: prompt + generated tokens per request (the model's context).
      admission_watermark: fraction of blocks kept free when admitting a new request,
        so running decodes can grow without preempting at once.
      speculative: speculative decoding (core/spec_decode.py), None: off. Each drafted token takes one
        token of the budget and one row of the step (rows stay <= max_num_seqs).
      token_buckets: the runner's padded step sizes (RunnerConfig.token_buckets), given where padding rows
        cost what real ones do (a CPU: prompt chunks are compute-bound); () : steps are never cut to fit.
        A step whose tokens would pad far up to the next bucket has its last prompt chunk cut back to the
        bucket below (`fit_to_bucket`): a 160-token prompt runs as 128 + 32 tokens, not 256 rows.
      lone_token_buckets: the runner's buckets for a step of one sequence (RunnerConfig.lone_token_buckets),
        used instead of token_buckets for such a step; () : token_buckets.
      step_cost_rows: what one more step costs, in rows of a step (its fixed cost: the weights read once,
        the host's work), weighed against the padding rows a cut saves.
    """
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    admission_watermark: float
    enable_prefix_caching: bool        # read by build_engine for the BlockManager
    speculative: SpeculativeConfig | None = None
    token_buckets: tuple[int, ...] = ()
    lone_token_buckets: tuple[int, ...] = ()
    step_cost_rows: int = 16

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs={self.max_num_seqs}: "
                             f"every running decode needs one token per step; raise the token budget")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 2")
        if not 0 <= self.admission_watermark < 1:
            raise ValueError(f"admission_watermark={self.admission_watermark}: must be in [0, 1)")


@dataclasses.dataclass
class SchedulerStats:
    """Monotonic counters (the engine exports them as metrics)."""
    num_preemptions: int = 0
    prefix_cache_queries: int = 0   # prompt tokens looked up at admission
    prefix_cache_hits: int = 0      # of those, tokens found cached
    prefix_cache_hits_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)   # device / host / disk
    prompt_tokens: int = 0          # prompt tokens of admitted requests (recomputation not counted)
    generation_tokens: int = 0
    spec: SpecDecodeStats | None = None   # speculative decoding's counters, when it is on


class Scheduler:
    """Continuous batching over a BlockManager; see the module docstring for the algorithm."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *, eos_token_ids: Sequence[int] = (),
                 seed_rng: random.Random | None = None, proposer: Proposer | None = None):
        """`proposer`: speculative decoding's (the n-gram one, made here, when the config asks for it and
        none is given; a draft model's is built by server/wiring.py, which loads it)."""
        self.config = config
        self.blocks = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed_rng = seed_rng or random.Random()   # owned, OS-seeded: seeds for requests without one
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []               # sorted by arrival (oldest first)
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self._assumed: SchedulerPlan | None = None     # the step in flight that assume() counted as run
        spec = config.speculative
        if proposer is None and spec is not None and spec.method != "ngram":
            raise ValueError(f"speculative method {spec.method!r} needs its proposer (core/draft_model.py)")
        self.proposer = proposer or (NgramProposer(spec) if spec is not None else None)
        self.stats = SchedulerStats(spec=SpecDecodeStats(spec.num_speculative_tokens) if spec is not None else None)

    # -- admission ----------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (a 400 for the server) if the request can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        check_context(n, params.max_tokens, self.config.max_model_len)
        need = self.blocks.num_blocks_needed(n + params.max_tokens - 1)   # the last token is never computed
        if need > self.blocks.total_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks but the cache has {self.blocks.total_blocks}; "
                             f"lower max_tokens or serve with a larger KV-cache budget")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        spec = self.config.speculative
        req = Request(request_id, list(prompt_token_ids), len(prompt_token_ids), params, seed, self._arrivals,
                      self.stop_token_ids(params),
                      draft=DraftLength(spec.num_speculative_tokens) if spec is not None else None)
        self._arrivals += 1
        self._requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Remove a request now and free its blocks; None if it is unknown or already finished."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        """End a request now (aborted, or stopped by a stop string found in its text) and free its blocks."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        return self._finish(req, reason, (), None)

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request: its stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)

    # -- queries ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        """Requests to run, or full blocks still to save to the prefix-cache tiers (a step with no rows)."""
        return self.has_unfinished() or self.blocks.has_transfers

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the plan -----------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        budget = self.config.max_num_batched_tokens
        reserved = sum(1 for r in self.running if r.num_tokens_left == 1)  # one token per decode
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            is_decode = req.num_tokens_left == 1
            if is_decode and req.ends_in_flight(self.config.max_model_len):   # its token in flight is its last: nothing to run
                reserved -= 1
                i += 1
                continue
            if is_decode:
                reserved -= 1
                want = 1
            else:
                want = chunk_tokens(req.num_tokens_left, budget - reserved)
                if want <= 0:
                    i += 1
                    continue
            n, victims, victim_decodes = self._grow(req, want, partial_ok=not is_decode)
            preempted += victims
            reserved -= victim_decodes   # their reserved decode tokens are free again
            if n == 0:  # req preempted itself: it was the newest, nothing runs after it
                break
            budget -= n
            (decodes if is_decode else prefills).append(self._seq(req, n))
            i += 1
        if not preempted:
            budget = self._admit(budget, prefills)
        if self.proposer is not None and decodes:
            decodes = self._speculate(decodes, budget, self.config.max_num_seqs - len(decodes) - len(prefills))
        if prefills and self.config.token_buckets:
            prefills = self._fit_to_bucket(decodes, prefills)
        seqs = tuple(decodes + prefills)
        saves, loads = self.blocks.take_transfers()
        return SchedulerPlan(seqs=seqs, num_tokens=sum(len(s.token_ids) for s in seqs), preempted=tuple(preempted),
                             kv_saves=saves, kv_loads=loads)

    def _fit_to_bucket(self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The step's prompt chunks, the last one cut back where that makes the step fill a token bucket
        and the rows saved outweigh one more step (`fit_to_bucket`). The cut tokens stay the request's
        to compute (its blocks stay allocated), so a later step runs them."""
        total = sum(len(s.token_ids) for s in decodes) + sum(len(s.token_ids) for s in prefills)
        last = prefills[-1]
        lone = not decodes and len(prefills) == 1 and self.config.lone_token_buckets
        buckets = self.config.lone_token_buckets if lone else self.config.token_buckets
        keep = fit_to_bucket(total, len(last.token_ids), buckets, self.config.step_cost_rows)
        if keep == len(last.token_ids):
            return prefills
        req = next(r for r in self.running if r.request_id == last.request_id)
        if chunk_tokens(req.num_tokens_left, keep) != keep:     # a lone token left, or a chunk of one
            return prefills
        return [*prefills[:-1], self._seq(req, keep)]

    def _grow(self, req: Request, want: int, *, partial_ok: bool) -> tuple[int, list[str], int]:
        """Get blocks for `want` more tokens of a running request, shrinking or preempting as needed.

        Returns (tokens granted, ids of requests preempted, how many of those other
        than `req` were decodes). 0 tokens granted means `req` itself was preempted.
        """
        victims: list[str] = []
        victim_decodes = 0
        while True:
            if self.blocks.allocate(req.request_id, req.num_computed_tokens + want) is not None:
                return want, victims, victim_decodes
            fit = chunk_tokens(req.num_tokens_left, min(self._fit_tokens(req), want)) if partial_ok else 0
            if fit > 0:
                self.blocks.allocate(req.request_id, req.num_computed_tokens + fit)
                return fit, victims, victim_decodes
            victim = self.running[-1]   # the newest running request (running is sorted by arrival)
            victim_decodes += victim is not req and victim.num_tokens_left == 1
            self._preempt(victim)
            victims.append(victim.request_id)
            if victim is req:
                return 0, victims, victim_decodes

    def _fit_tokens(self, req: Request) -> int:
        """How many more tokens of `req` fit in its blocks plus the free ones."""
        owned = len(self.blocks.blocks_of(req.request_id).block_ids)
        return (owned + self.blocks.num_free_blocks) * self.blocks.block_size - req.num_computed_tokens

    def _preempt(self, req: Request) -> None:
        """Back to the waiting queue; a token still in flight for it is dropped (recomputing draws the
        same token again: a draw depends only on the request's seed and the token's index)."""
        if req.token_ids[-1] == PLACEHOLDER:
            req.token_ids.pop()
        self.running.remove(req)
        self.blocks.free(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)   # it is older than every waiting request (admission is FIFO)

    def _admit(self, budget: int, prefills: list[ScheduledSeq]) -> int:
        """Admit waiting requests FIFO while they fit; appends their first chunks; returns the budget left."""
        watermark = int(self.config.admission_watermark * self.blocks.total_blocks)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.blocks.find_cached_prefix(req.token_ids, _salt(req))
            n = chunk_tokens(len(req.token_ids) - hit.num_cached_tokens, budget)
            if n <= 0:
                break
            total = hit.num_cached_tokens + n
            new_blocks = self.blocks.new_blocks_needed(req.request_id, total, hit)
            free = self.blocks.num_free_blocks
            if new_blocks > free or (self.running and free - new_blocks < watermark):
                break
            self.blocks.allocate(req.request_id, total, hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = hit.num_cached_tokens
            self.stats.prefix_cache_queries += len(req.token_ids)
            self.stats.prefix_cache_hits += hit.num_cached_tokens
            for tier, hits in hit.tokens_by_tier(self.blocks.block_size).items():
                self.stats.prefix_cache_hits_by_tier[tier] = self.stats.prefix_cache_hits_by_tier.get(tier, 0) + hits
            if req.num_preemptions == 0:
                self.stats.prompt_tokens += req.num_prompt_tokens
            self.running.append(req)   # the newest arrival among the running (admission is FIFO)
            budget -= n
            prefills.append(self._seq(req, n))
        return budget

    def _speculate(self, decodes: list[ScheduledSeq], budget: int, rows: int) -> list[ScheduledSeq]:
        """The decode rows with proposed tokens to verify, oldest first, while the step's token budget
        and rows last; none when more requests run than `disable_by_batch_size`. A draft never takes
        blocks below the admission watermark, and never preempts. A proposer that writes K/V (a draft
        model) gets the blocks for all k first and proposes for every request of the step in one
        batch; the n-gram one proposes request by request and gets only the blocks its proposal needs."""
        spec = self.config.speculative
        if len(self.running) > spec.disable_by_batch_size:
            return decodes
        out, asks = [], []
        for seq in decodes:
            req = self._requests[seq.request_id]
            ask = self._ask(req, min(spec.num_speculative_tokens, budget, rows))
            if ask is not None and self.proposer.writes_kv:
                asks.append(ask)
                budget, rows = budget - ask.k, rows - ask.k
            elif ask is not None:
                draft = self.proposer.draft([ask])[0]
                if draft and self._fits(req, len(draft)):
                    seq = self._with_draft(seq, req, draft)
                    budget, rows = budget - len(draft), rows - len(draft)
            out.append(seq)
        if asks:
            drafts = dict(zip((a.request_id for a in asks), self.proposer.draft(asks)))
            out = [self._with_draft(seq, self._requests[seq.request_id], drafts[seq.request_id])
                   if drafts.get(seq.request_id) else seq for seq in out]
        return out

    def _ask(self, req: Request, k: int) -> DraftAsk | None:
        """What to ask the proposer for a decoding request: up to k tokens within its room (the draft and
        the token drawn after it stay within max_tokens and the context) and its adaptive length
        (DraftLength); for a proposer that writes K/V, the blocks for all k, above the admission
        watermark (None when they do not fit)."""
        room = min(req.params.max_tokens - req.num_output_tokens, self.config.max_model_len - len(req.token_ids)) - 1
        k = min(k, room)
        if k <= 0 or not speculates(req.params, req.num_output_tokens):
            return None
        k = min(k, req.draft.take())
        if k <= 0:
            return None
        if not self.proposer.writes_kv:
            return DraftAsk(req.request_id, req.token_ids, k)
        if not self._fits(req, k):
            return None
        table = self.blocks.allocate(req.request_id, req.num_computed_tokens + 1 + k).block_ids
        return DraftAsk(req.request_id, req.token_ids, k, tuple(table))

    def _fits(self, req: Request, n: int) -> bool:
        """Whether n drafted tokens of `req` fit in the free blocks above the admission watermark."""
        watermark = int(self.config.admission_watermark * self.blocks.total_blocks)
        needed = self.blocks.new_blocks_needed(req.request_id, req.num_computed_tokens + 1 + n)
        return needed <= self.blocks.num_free_blocks - watermark

    def _with_draft(self, seq: ScheduledSeq, req: Request, draft: tuple[int, ...]) -> ScheduledSeq:
        """The decode row with its draft to verify, the request's blocks grown to hold it."""
        table = self.blocks.allocate(req.request_id, req.num_computed_tokens + 1 + len(draft)).block_ids
        return dataclasses.replace(seq, token_ids=seq.token_ids + draft, block_table=table, draft_token_ids=draft)

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        """The plan row running tokens [num_computed, num_computed + n) of `req` (blocks already allocated)."""
        start = req.num_computed_tokens
        table = self.blocks.blocks_of(req.request_id).block_ids
        needs_logits = start + n == len(req.token_ids)
        # prompt logprobs come with the first sampled token (a preempted request keeps its outputs)
        score = needs_logits and req.num_output_tokens == 0 and req.params.prompt_logprobs is not None
        return ScheduledSeq(request_id=req.request_id, token_ids=tuple(req.token_ids[start:start + n]), start=start,
                            block_table=table, needs_logits=needs_logits, sampling=req.params,
                            seed=req.seed, sample_index=req.num_output_tokens,
                            context=self._row_context(req) if needs_logits else RowContext(),
                            score_prompt=tuple(req.token_ids[:req.num_prompt_tokens]) if score else ())

    def _row_context(self, req: Request) -> RowContext:
        """The tokens penalties read and the ids min_tokens forbids, only for requests that use them
        (a grammar's mask is the engine's structured-output component's, added after planning)."""
        p = req.params
        suppress = tuple(sorted(req.eos_token_ids)) if req.num_output_tokens < p.min_tokens else ()
        if not p.needs_history and not suppress:
            return RowContext()
        n = req.num_prompt_tokens
        return RowContext(prompt=tuple(req.token_ids[:n]) if p.repetition_penalty != 1 else (),
                          output=tuple(req.token_ids[n:]) if p.needs_history else (), suppress=suppress)

    # -- after the step -------------------------------------------------------------
    def update(self, plan: SchedulerPlan, output: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's results: advance computed tokens, append sampled tokens, stop, free, emit.
        For the plan assume() counted already, only its sampled tokens replace the placeholders."""
        assumed, self._assumed = plan is self._assumed, None
        outputs: list[RequestOutput] = []
        for seq in plan.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING or (
                    req.num_computed_tokens != (seq.context_len if assumed else seq.start)):
                continue  # aborted or preempted since the plan was made
            if not seq.needs_logits:
                if not assumed:
                    self._computed(req, len(seq.token_ids))
                continue
            tokens = tuple(int(t) for t in output.sampled[seq.request_id])
            accepted = len(tokens) - 1           # drafted tokens kept: their K/V, computed this step, is valid
            if seq.draft_token_ids:
                self.stats.spec.observe(len(seq.draft_token_ids), accepted)
                req.draft.observe(len(seq.draft_token_ids), accepted, self.config.speculative.num_speculative_tokens)
            if assumed:
                req.token_ids.pop()              # the placeholder: the sampled token takes its place below
            else:   # the rejected drafts' slots lie past the computed length: a later step writes them again
                self._computed(req, len(seq.token_ids) - len(seq.draft_token_ids) + accepted, tokens[:accepted])
            out = self._after_tokens(req, tokens, output.logprobs.get(seq.request_id))
            if seq.score_prompt:
                out = dataclasses.replace(out, prompt_logprobs=tuple(output.prompt_logprobs.get(seq.request_id, ())))
            outputs.append(out)
        return outputs

    def _computed(self, req: Request, n: int, accepted: Sequence[int] = ()) -> None:
        """n more of `req`'s tokens are in the cache (the last `accepted` of them drafts that a step
        kept); its newly full blocks join the prefix cache."""
        req.num_computed_tokens += n
        known = req.token_ids + list(accepted) if accepted else req.token_ids
        self.blocks.cache_full_blocks(req.request_id, known, req.num_computed_tokens, _salt(req))

    # -- async scheduling: the next step planned while one runs ----------------------------------
    def assume(self, plan: SchedulerPlan) -> None:
        """Count a dispatched step as run, so schedule() plans the one after it while it runs: its
        tokens computed and, where it samples, one token more, a PLACEHOLDER until update(plan)
        reads the real one (then fill() puts it into the next plan). No drafts: speculative decoding
        runs serially."""
        self._assumed = plan
        for seq in plan.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING or req.num_computed_tokens != seq.start:
                continue
            self._computed(req, len(seq.token_ids))
            if seq.needs_logits:
                req.token_ids.append(PLACEHOLDER)

    def fill(self, plan: SchedulerPlan) -> SchedulerPlan:
        """A plan made ahead, after update() read the step before it: the placeholders replaced by the
        sampled tokens (with the row's context read again), the rows of requests that ended since
        dropped (their blocks are free already)."""
        seqs = []
        for seq in plan.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if PLACEHOLDER in seq.token_ids:
                seq = dataclasses.replace(seq, token_ids=tuple(req.token_ids[seq.start:seq.context_len]),
                                          context=self._row_context(req) if seq.needs_logits else RowContext())
            seqs.append(seq)
        return dataclasses.replace(plan, seqs=tuple(seqs), num_tokens=sum(len(s.token_ids) for s in seqs))

    def _after_tokens(self, req: Request, tokens: tuple[int, ...],
                      lps: tuple[TokenLogprobs, ...] | None) -> RequestOutput:
        """Append a step's tokens one at a time under the token-level stop rules (vLLM's check_stop:
        EOS / stop token ids, max_tokens, the context); the first that stops ends the request and the
        tokens after it are dropped. Stop strings (core/detokenizer.py) and grammars
        (core/structured_output.py) are the engine's."""
        params = req.params
        reason = None
        kept = 0
        for token in tokens:
            req.token_ids.append(token)
            self.stats.generation_tokens += 1
            kept += 1
            if token in req.eos_token_ids and req.num_output_tokens >= params.min_tokens:
                reason = FinishReason.STOP
            elif req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        new = tokens[:kept]
        lps = tuple(lps[:kept]) if lps else (() if params.logprobs is not None else None)
        if reason is not None:
            return self._finish(req, reason, new, lps)
        return RequestOutput(request_id=req.request_id, new_token_ids=new, logprobs=lps,
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def _finish(self, req: Request, reason: FinishReason, tokens: tuple[int, ...], lps, error: str | None = None) -> RequestOutput:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self.blocks.free(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        req.status = RequestStatus.FINISHED
        del self._requests[req.request_id]
        return RequestOutput(request_id=req.request_id, new_token_ids=tokens, finish_reason=reason,
                             logprobs=lps, num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
                             error=error)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with finish_reason "error" (the runner failed); frees all blocks."""
        outs = []
        for req in list(self.running) + list(self.waiting):
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            outs.append(self._finish(req, FinishReason.ERROR, (), None, error))
        return outs


def fit_to_bucket(total: int, chunk: int, buckets: Sequence[int], step_cost_rows: int) -> int:
    """How many tokens of a step's last prompt chunk (`chunk` of the step's `total`) to run so the step
    pads little: `chunk` itself unless cutting it back to the bucket below `total` costs fewer rows, the
    cut tokens padded to a bucket of their own in a later step plus that step's fixed cost
    (`step_cost_rows`), than padding `total` up to its bucket. Never cuts to fewer than 2 tokens.

    With buckets (32, 128, 256): 160 tokens -> 128 (128 + 32 + cost rows against 256); 200 tokens
    stay 200 (128 + 128 + cost against 256)."""
    padded = next((b for b in buckets if b >= total), total)
    below = [b for b in buckets if b < total]
    if padded == total or not below:
        return chunk
    cut = total - below[-1]
    later = next((b for b in buckets if b >= cut), cut)
    if cut > chunk - 2 or below[-1] + later + step_cost_rows >= padded:
        return chunk
    return chunk - cut


def chunk_tokens(left: int, budget: int) -> int:
    """How many of a request's `left` tokens to compute (a prompt chunk) within `budget`: as many as fit,
    but never one token of a longer remainder and never a remainder of one, 0 where no such chunk fits.
    The attention kernel computes a lone token (a decode's path) in another order than the tokens of a
    chunk (a tile's path), so a prompt token cut off alone would get other bits than in a chunk split
    otherwise, and a greedy answer could then depend on how the step's budget fell (the kernel's own
    tiles keep to the same rule; find_cached_prefix leaves at least two tokens to compute)."""
    n = min(left, budget)
    if n < left and left - n == 1:
        n -= 1
    return 0 if n == 1 and left > 1 else n


def _salt(req: Request) -> bytes:
    """The prefix cache's salt of a request: its LoRA adapter's load key (b"": the base model)."""
    adapter = req.params.adapter
    return b"" if adapter is None else adapter.key.encode()
