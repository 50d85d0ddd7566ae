"""MockRunner: the engine's Runner computable by hand, for scheduler and engine tests.

Its "KV cache" stores token ids, and the next token is (last token + 1) % vocab, read back from the
cache through the block table (JetStream's mock engine, for hloserve's step contract).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hloserve.runtime.artifact.llm import NULL_BLOCK, slots
from hloserve.server.core.plan_sampling import sample_plan
from hloserve.server.core.outputs import RunnerOutput, SchedulerPlan


class MockRunner:
    """A runner computable by hand (JetStream mock_engine style), for policy and engine tests.

    Its KV cache holds token ids: a step writes each token into its slot, then
    for each sequence needing logits reads the whole context back through the
    block table; the next token is (context[-1] + 1) % vocab_size, given to the
    real sampler as logits with `peak` at that token. A prompt [5, 6] therefore
    generates 7, 8, 9, ... greedily. `contexts[request_id]` records the last
    context read, so tests can check that prefix-cache hits and slot mappings
    put the right tokens in the right places. With `tiers` (core/kv_tiers.py) it makes the plan's
    block copies as the ModelRunner does: saves (a block's token ids) first, then loads; the saves
    land in the tiers at `collect`.
    """

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int, *, peak: float = 20.0,
                 on_execute: Callable[[SchedulerPlan], None] | None = None, tiers=None):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.peak = peak
        self.cache = np.full(num_blocks * block_size, -1, np.int64)   # token id per slot; -1 = never written
        self.contexts: dict[str, list[int]] = {}
        self.plans: list[SchedulerPlan] = []
        self.on_execute = on_execute
        self.tiers = tiers
        self.steps = 0

    def execute(self, plan: SchedulerPlan) -> RunnerOutput:
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: SchedulerPlan) -> RunnerOutput:
        """Async scheduling's first half: the mock computes the step here, in dispatch order, as a
        device would; `collect` hands its output over. Its block saves are read here, before the step
        writes, and land in the tiers at `collect`, as the ModelRunner's gathers do."""
        self.plans.append(plan)
        if self.on_execute is not None:
            self.on_execute(plan)
        bs = self.block_size
        if self.tiers is not None:
            if plan.kv_saves:
                self.tiers.put_later([h for _, h in plan.kv_saves],
                                     np.stack([self.cache[b * bs:(b + 1) * bs].copy() for b, _ in plan.kv_saves]))
            for b, data in plan.kv_loads:
                self.cache[b * bs:(b + 1) * bs] = data
            self.tiers.loaded += len(plan.kv_loads)
        if plan.is_empty:
            return RunnerOutput({})
        self.steps += 1
        logits = np.zeros((plan.num_rows, self.vocab_size), np.float32)
        row = 0                           # a verified draft takes a row per token (ScheduledSeq.step_rows)
        for s in plan.seqs:
            i, row = row, row + 1 + len(s.draft_token_ids)
            for slot, tok in zip(slots(s.start, len(s.token_ids), s.block_table, bs), s.token_ids):
                if slot // bs == NULL_BLOCK:
                    raise AssertionError(f"{s.request_id}: a real token was written into the null block")
                self.cache[slot] = tok
            if not s.needs_logits:
                continue
            ctx = [int(self.cache[s.block_table[p // bs] * bs + p % bs]) for p in range(s.context_len)]
            self.contexts[s.request_id] = ctx
            for j, p in enumerate(range(s.context_len - 1 - len(s.draft_token_ids), s.context_len)):
                logits[i + j, (ctx[p] + 1) % self.vocab_size] = self.peak
        return sample_plan(plan, logits)

    def collect(self, pending: RunnerOutput) -> RunnerOutput:
        if self.tiers is not None:
            self.tiers.land()
        return pending

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        return 0   # nothing to compile

    def device_memory(self) -> dict[tuple[str, str], int]:
        return {}

    def stats(self) -> dict[str, float]:
        return {"runner_steps_total": self.steps}

    def close(self) -> None:
        pass
