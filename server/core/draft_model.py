"""Speculative decoding's draft-model proposer: a second, smaller (or quantized) LLM artifact with the
target's tokenizer proposes K tokens greedily (vLLM's "draft_model" method).

    target blocks  one block table per request, allocated by the scheduler's BlockManager
    draft cache    the draft runner's own paged KV cache with as many blocks as the target's: it is read
                   and written through the SAME block tables, so blocks are allocated once, and the
                   KV-cache budget is split between the two caches in proportion to their block sizes
                   (server/wiring.py)

Per engine step (`draft`), for each proposing request, its blocks already grown by K tokens:

    catch up   the tokens the draft has not computed yet (the prompt on the first proposal; then the
               tokens the target accepted last step, and the one it drew) in one or more chunks, the
               last one's logits giving d1 (greedy)
    decode     d1 .. d(K-1) one at a time, each giving the next proposal

The draft's cache then holds the context and d1..d(K-1); what of that the target accepted stays valid
(`_State.valid`), the rest is written again by the next catch-up, as the target's rejected slots are.
Proposals are deterministic (greedy), so the verifier for a point-mass proposal (sampling.verify_draft,
the n-gram path's) keeps the target's distribution. The step's proposing requests (at most
`disable_by_batch_size`) run together: their catch-ups share calls (mixed chunk and one-token rows),
then each proposal position is one call for all of them, so a step costs about K draft calls however
many requests propose.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

from .outputs import RunnerOutput, ScheduledSeq, SchedulerPlan
from .sampling import SamplingParams
from .spec_decode import DraftAsk

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
      max_chunk: the most tokens one call runs (the runner's largest token bucket).
      max_rows: the most requests one call runs (the runner's largest sequence bucket).
    """
    writes_kv = True

    def __init__(self, runner: DraftRunner, max_chunk: int, max_rows: int = 1):
        self.runner = runner
        self.max_chunk = max_chunk
        self.max_rows = max_rows
        self._states: dict[str, _State] = {}
        self.steps = 0

    def draft(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        """Each ask's k greedy tokens, the step's requests batched: their catch-ups packed into calls of
        up to max_chunk tokens and max_rows rows, then one call per proposal position for every request
        that proposes that many."""
        live = [a for a in asks if a.k >= 1 and a.token_ids]
        # at least each request's last token runs: its logits give the first proposal
        start = {a.request_id: min(self._states.setdefault(a.request_id, _State([])).valid(a.token_ids),
                                   len(a.token_ids) - 1) for a in live}
        proposed: dict[str, list[int]] = {a.request_id: [] for a in live}
        behind = live
        while behind:                                   # catch up
            rows, room = [], self.max_chunk
            for a in behind[:self.max_rows]:
                n = min(len(a.token_ids) - start[a.request_id], room)
                if n == 0:
                    break
                rows.append((a, tuple(a.token_ids[start[a.request_id]:start[a.request_id] + n])))
                room -= n
            for rid, token in self._run([(a, chunk, start[a.request_id]) for a, chunk in rows]).items():
                proposed[rid].append(token)
            for a, chunk in rows:
                start[a.request_id] += len(chunk)
            behind = [a for a in behind if start[a.request_id] < len(a.token_ids)]
        for i in range(1, max((a.k for a in live), default=0)):    # proposal i + 1 after proposal i
            going = [a for a in live if a.k > i]
            for j in range(0, len(going), self.max_rows):
                rows = [(a, (proposed[a.request_id][-1],), len(a.token_ids) + i - 1) for a in going[j:j + self.max_rows]]
                for rid, token in self._run(rows).items():
                    proposed[rid].append(token)
        for a in live:
            self._states[a.request_id].computed = list(a.token_ids) + proposed[a.request_id][:-1]
        return [tuple(proposed.get(a.request_id, ())) for a in asks]

    def _run(self, rows: list[tuple[DraftAsk, tuple[int, ...], int]]) -> dict[str, int]:
        """One draft call over rows (ask, tokens at positions start..): by request id, the greedy next
        token of each row whose tokens end its request's context so far (its proposals included)."""
        seqs = tuple(ScheduledSeq(request_id=a.request_id, token_ids=tokens, start=start, block_table=a.block_table,
                                  needs_logits=start + len(tokens) >= len(a.token_ids), sampling=GREEDY, seed=0,
                                  sample_index=0) for a, tokens, start in rows)
        out = self.runner.execute(SchedulerPlan.of(seqs))
        self.steps += 1
        return {s.request_id: int(out.sampled[s.request_id][0]) for s in seqs if s.needs_logits}

    def forget(self, request_id: str) -> None:
        """Its blocks were freed (finished or preempted): its draft cache is no longer its own."""
        self._states.pop(request_id, None)

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compile the draft's shapes (before /ready); its progress lines say "draft model"."""
        return self.runner.warmup(None if progress is None else lambda line: progress(f"draft model {line}"))
