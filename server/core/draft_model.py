"""Speculative decoding's draft-model proposer: a second, smaller (or quantized) LLM artifact with the
target's tokenizer proposes K tokens greedily (vLLM's "draft_model" method).

    target blocks  one block table per request, allocated by the scheduler's BlockManager
    draft cache    the draft runner's own paged KV cache with as many blocks as the target's: it is read
                   and written through the SAME block tables, so blocks are allocated once, and the
                   KV-cache budget is split between the two caches in proportion to their block sizes
                   (server/wiring.py)

Per request and engine step (`draft`), with the request's blocks already grown by K tokens:

    catch up   the tokens the draft has not computed yet (the prompt on the first proposal; then the
               tokens the target accepted last step, and the one it drew) in one or more chunks, the
               last one's logits giving d1 (greedy)
    decode     d1 .. d(K-1) one at a time, each giving the next proposal

The draft's cache then holds the context and d1..d(K-1); what of that the target accepted stays valid
(`_State.valid`), the rest is written again by the next catch-up, as the target's rejected slots are.
Proposals are deterministic (greedy), so the verifier for a point-mass proposal (sampling.verify_draft,
the n-gram path's) keeps the target's distribution. Each request proposes on its own (rows of one
sequence; at most `disable_by_batch_size` requests propose in a step).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

from .outputs import RunnerOutput, ScheduledSeq, SchedulerPlan
from .sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftRunner(Protocol):
    """What the proposer needs of the draft's runner (ModelRunner; MockRunner in tests)."""

    def execute(self, plan: SchedulerPlan) -> RunnerOutput: ...

    def warmup(self, progress: Callable[[str], None] | None = None) -> int: ...


@dataclasses.dataclass
class _State:
    """The tokens whose K/V a request's draft cache holds, position by position."""
    computed: list[int]

    def valid(self, token_ids: Sequence[int]) -> int:
        """How many of them still match the request's tokens (the context's prefix they agree on)."""
        n = 0
        for a, b in zip(self.computed, token_ids):
            if a != b:
                break
            n += 1
        return n


class DraftModelProposer:
    """Greedy proposals from a draft model run by its own runner (see the module docstring).

    Args:
      runner: the draft artifact's runner, its KV cache as many blocks as the target's.
      max_chunk: the most tokens one catch-up call runs (the runner's largest token bucket).
    """
    writes_kv = True

    def __init__(self, runner: DraftRunner, max_chunk: int):
        self.runner = runner
        self.max_chunk = max_chunk
        self._states: dict[str, _State] = {}
        self.steps = 0

    def draft(self, request_id: str, token_ids: Sequence[int], k: int, block_table: Sequence[int]) -> tuple[int, ...]:
        """k greedy tokens to follow `token_ids`; `block_table` holds room for len(token_ids) + k - 1."""
        if k < 1 or not token_ids:
            return ()
        state = self._states.setdefault(request_id, _State([]))
        # at least the last token runs: its logits give the first proposal
        start = min(state.valid(token_ids), len(token_ids) - 1)
        table = tuple(block_table)
        token = None
        while start < len(token_ids):
            chunk = tuple(token_ids[start:start + self.max_chunk])
            token = self._run(request_id, chunk, start, table, last=start + len(chunk) == len(token_ids))
            start += len(chunk)
        proposed = [token]
        for _ in range(k - 1):
            proposed.append(self._run(request_id, (proposed[-1],), start, table, last=True))
            start += 1
        state.computed = list(token_ids) + proposed[:-1]
        return tuple(proposed)

    def _run(self, request_id: str, tokens: tuple[int, ...], start: int, table: tuple[int, ...],
             last: bool) -> int | None:
        """One draft step over `tokens` at positions start..; the greedy next token when `last`."""
        seq = ScheduledSeq(request_id=request_id, token_ids=tokens, start=start, block_table=table,
                           needs_logits=last, sampling=GREEDY, seed=0, sample_index=0)
        out = self.runner.execute(SchedulerPlan.of((seq,)))
        self.steps += 1
        return int(out.sampled[request_id][0]) if last else None

    def forget(self, request_id: str) -> None:
        """Its blocks were freed (finished or preempted): its draft cache is no longer its own."""
        self._states.pop(request_id, None)

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile the draft's shapes (before /ready); its progress lines say "draft model"."""
        return self.runner.warmup(None if progress is None else lambda line: progress(f"draft model {line}"))
