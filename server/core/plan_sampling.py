"""A plan's rows sampled: on the host from logits copied back (`sample_plan`, sampling.py row by row),
or where the logits are (`DeviceSampler`, issue #37): a step's tokens chosen on the device, so only
token ids (and the logprobs a request asked for) come back, not S x vocab f32 logits.

It keeps sampling.py's contract, row for row: the same order of operations (temperature -> top-k ->
top-p -> min-p -> draw), the same draw (the host makes u = rng_for(seed, index).random() exactly as
sampling.py does and sends it; the device takes the inverse CDF of the filtered probabilities at u,
in vocabulary order), logprobs of the raw logits. So a seeded request draws the same tokens on
either side, except where two differences of arithmetic move a boundary: the device sums the
cumulative probabilities in f32 where the host sums in f64 (a draw within ~1e-6 of a boundary may
pick the neighbour), and top-k keeps every token tied with the k-th where the host keeps exactly k.
Greedy rows are the same argmax on both sides.

What stays on the host (sampling.py, the rows' logits copied back): rows whose logits are processed
or masked (logit_bias, penalties, min_tokens, structured output), which read host state. A step
with such a row copies its logits whole and samples those rows as before.

A drafted sequence's rows (speculative decoding) are drawn here like any other row (draw index +
j for row j), and the host accepts the draft while the draws equal it: sampling.verify_draft's rule,
read off token ids.

Two compiled variants per row bucket (warm-up compiles both): greedy-only (each row's top token) and the full
sampler (top-k / top-p without sorting the vocabulary, `_sample_fn`; log-softmax and the top 20
logprobs).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .outputs import RunnerOutput, SchedulerPlan
from .sampling import MAX_LOGPROBS, TokenLogprobs, rng_for, sample, verify_draft


def _first_rows(plan: SchedulerPlan) -> np.ndarray:
    """Each sequence's first row of the step (one row a sequence, one more per drafted token), and the
    row count last."""
    return np.cumsum([0] + [1 + len(s.draft_token_ids) for s in plan.seqs])


def sample_plan(plan: SchedulerPlan, logits: np.ndarray) -> RunnerOutput:
    """Sample the rows of `logits` (f32[>= plan.num_rows, vocab], the plan's rows in order: one per
    sequence, one per token of a verified draft) that need a token; a drafted sequence's rows are
    verified together (sampling.verify_draft)."""
    logits = np.asarray(logits)
    first = _first_rows(plan)
    rows = [i for i, s in enumerate(plan.seqs) if s.needs_logits and not s.draft_token_ids]
    sampled: dict[str, tuple[int, ...]] = {}
    logprobs: dict[str, tuple] = {}
    if rows:
        seqs = [plan.seqs[i] for i in rows]
        tokens, lps = sample(logits, [s.sampling for s in seqs], [s.seed for s in seqs],
                             [s.sample_index for s in seqs], [s.context for s in seqs], rows=first[rows])
        sampled.update((s.request_id, (t,)) for s, t in zip(seqs, tokens))
        logprobs.update((s.request_id, (lp,)) for s, lp in zip(seqs, lps) if lp is not None)
    for i, s in enumerate(plan.seqs):
        if s.draft_token_ids and s.needs_logits:
            tokens, lps = verify_draft(logits[first[i]:first[i + 1]], s.draft_token_ids, s.sampling, s.seed,
                                       s.sample_index, s.context)
            sampled[s.request_id] = tuple(tokens)
            if lps[0] is not None:
                logprobs[s.request_id] = tuple(lps)
    return RunnerOutput(sampled, logprobs)


_PROBE = 64   # top-k and top-p first look at each row's 64 most likely tokens, as sampling.py's nucleus probe


def _sample_fn(full: bool):
    """The jitted sampler: logits f32[S, V] and per-row parameters -> (tokens int32[S], chosen logprob
    f32[S], top ids int32[S, 20], top logprobs f32[S, 20]) (tokens only when not `full`).

    No sort of the vocabulary (XLA's CPU sort of 16 x 49,152 took 155 ms): the 64 most likely tokens
    (lax.top_k) give the k-th value of a top-k of at most 64 and the nucleus when those 64 hold it; a
    row beyond either has its threshold found by bisection over the values' order (32 passes of a count
    or a masked sum, run only when some row needs it). Thresholds compare as sortable integer keys."""
    import jax
    import jax.numpy as jnp

    def key(v):      # f32 -> uint32 in the same order (negatives flipped, positives above them)
        b = jax.lax.bitcast_convert_type(v, jnp.uint32)
        return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))

    def largest(ok):
        """Per row, the largest uint32 t with ok(t) (ok: [S] bools, true at 0, false from some t on)."""
        def body(_, c):
            lo, hi = c
            d = hi - lo
            mid = lo + d // 2 + (d & 1)
            yes = ok(mid)
            return jnp.where(yes, mid, lo), jnp.where(yes, hi, mid - 1)
        S = ok(jnp.zeros(1, jnp.uint32)).shape[0]
        lo, _ = jax.lax.fori_loop(0, 32, body, (jnp.zeros(S, jnp.uint32), jnp.full(S, 0xFFFFFFFF, jnp.uint32)))
        return lo

    def greedy_only(logits):     # lax.top_k's first: the lowest id among ties, as argmax (in ~half its time on a CPU)
        return jax.lax.top_k(logits.astype(jnp.float32), 1)[1][:, 0].astype(jnp.int32)

    def sample(logits, greedy, temperature, top_k, top_p, min_p, u):
        x = logits.astype(jnp.float32)
        V = x.shape[-1]
        P = min(_PROBE, V)
        z = x / temperature[:, None]
        zkey = key(z)
        head, head_ids = jax.lax.top_k(x, P)       # each row's P largest, largest first (of x: XLA's CPU
        head = head / temperature[:, None]         # sorted the whole row when asked for z's; the same order)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        # top-k: the k-th largest value's key; every token tied with it is kept
        kth = key(jnp.take_along_axis(head, (jnp.minimum(k, P) - 1)[:, None], axis=-1)[:, 0])
        deep = (k > P) & (k < V)
        kth = jax.lax.cond(deep.any(), lambda: jnp.where(
            deep, largest(lambda t: (zkey >= t[:, None]).sum(axis=-1) >= k), kth), lambda: kth)
        kth = jnp.where(k >= V, jnp.uint32(0), kth)
        in_k = zkey >= kth[:, None]
        e = jnp.where(in_k, jnp.exp(z - head[:, :1]), 0.0)        # unnormalized, the most likely 1
        ekey = key(e)
        target = top_p * e.sum(axis=-1)
        # top-p: the least probability of the nucleus (the most likely tokens whose mass reaches top_p)
        e_head = jnp.take_along_axis(e, head_ids, axis=-1)       # the same values (not an exp computed again)
        cum = jax.lax.associative_scan(jnp.add, e_head, axis=1)
        first = jnp.minimum((cum < target[:, None]).sum(axis=-1), P - 1)
        cut = key(jnp.take_along_axis(e_head, first[:, None], axis=-1)[:, 0])
        wide = (top_p < 1.0) & (cum[:, -1] < target)
        cut = jax.lax.cond(wide.any(), lambda: jnp.where(
            wide, largest(lambda t: jnp.where(ekey >= t[:, None], e, 0.0).sum(axis=-1) >= target), cut),
            lambda: cut)
        keep = in_k & ((top_p[:, None] >= 1.0) | (ekey >= cut[:, None])) & (e >= min_p[:, None])
        cdf = jax.lax.associative_scan(jnp.add, jnp.where(keep, e, 0.0), axis=1)   # (4x jnp.cumsum's speed on a
        # CPU, plain StableHLO on every platform; a tree of sums, no less exact than a running one)
        drawn = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=-1)   # inverse CDF: the first cdf above u
        last = jnp.where(keep, jnp.arange(V)[None, :], 0).max(axis=-1)   # u at the very top: the last candidate
        token = jnp.where(greedy, jnp.argmax(x, axis=-1), jnp.minimum(drawn, last)).astype(jnp.int32)
        lp = jax.nn.log_softmax(x, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return token, jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    return jax.jit(sample if full else greedy_only)


@dataclasses.dataclass(frozen=True)
class _Row:
    """One row the device samples: its place in the logits, the sequence it belongs to, its draw."""
    row: int
    seq: Any          # ScheduledSeq
    index: int        # the draw's index (sample_index, + j for a draft's row j)


class DeviceSampler:
    """Samples a plan's rows from logits left on the device (ModelRunner.collect)."""

    def __init__(self):
        self._greedy = _sample_fn(False)
        self._full = _sample_fn(True)

    def warmup(self, logits) -> None:
        """Compile both variants for logits shaped as `logits` (a device array of one row bucket)."""
        S = logits.shape[0]
        self._greedy(logits).block_until_ready()
        ones = np.ones(S, np.float32)
        self._full(logits, np.ones(S, bool), ones, np.zeros(S, np.int32), ones, np.zeros(S, np.float32),
                   np.zeros(S, np.float32))[0].block_until_ready()

    def compiles(self) -> int:
        """Executables the two variants hold (jit's cache: one per shape and placement of the logits)."""
        return self._greedy._cache_size() + self._full._cache_size()

    def sample_plan(self, plan: SchedulerPlan, logits, host_logits) -> RunnerOutput:
        """The tokens of `plan`'s rows from `logits` (device f32[>= plan.num_rows, vocab]); rows the host
        must sample (processed or masked logits) get them from `host_logits()` (the logits on the host,
        called once, only when such a row exists). As sample_plan returns them."""
        first = _first_rows(plan)
        rows: list[_Row] = []
        host_seqs, host_rows = [], []    # sequences the host samples, and their rows' [start, end)
        for i, s in enumerate(plan.seqs):
            if not s.needs_logits:
                continue
            if s.sampling.processes_logits or s.context.masks:
                host_seqs.append(s)
                host_rows.append((first[i], first[i + 1]))
            else:
                rows += [_Row(int(first[i]) + j, s, s.sample_index + j) for j in range(len(s.draft_token_ids) + 1)]
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple] = {}
        if rows:
            tokens, lps = self._run(logits, rows)
            by_seq: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}
            for r, t, lp in zip(rows, tokens, lps):
                by_seq.setdefault(r.seq.request_id, []).append((t, lp))
            for s in {r.seq.request_id: r.seq for r in rows}.values():
                drawn = by_seq[s.request_id]
                n = next((j + 1 for j, d in enumerate(s.draft_token_ids) if drawn[j][0] != d), len(drawn))
                sampled[s.request_id] = tuple(t for t, _ in drawn[:n])      # the draft accepted while draws equal it
                if s.sampling.logprobs is not None:
                    logprobs[s.request_id] = tuple(lp for _, lp in drawn[:n])
        if host_seqs:
            x = host_logits()
            part = sample_plan(SchedulerPlan.of(tuple(host_seqs)), np.concatenate([x[a:b] for a, b in host_rows]))
            sampled.update(part.sampled)
            logprobs.update(part.logprobs)
        return RunnerOutput(sampled, logprobs)

    def _run(self, logits, rows: list[_Row]) -> tuple[list[int], list[TokenLogprobs | None]]:
        S = logits.shape[0]
        if all(r.seq.sampling.greedy and r.seq.sampling.logprobs is None for r in rows):
            ids = np.asarray(self._greedy(logits))
            return [int(ids[r.row]) for r in rows], [None] * len(rows)
        greedy = np.ones(S, bool)
        temperature, top_p = np.ones(S, np.float32), np.ones(S, np.float32)
        top_k, min_p, u = np.zeros(S, np.int32), np.zeros(S, np.float32), np.zeros(S, np.float32)
        for r in rows:
            p = r.seq.sampling
            if p.greedy:
                continue
            greedy[r.row] = False
            temperature[r.row], top_p[r.row], min_p[r.row] = p.temperature, p.top_p, p.min_p
            top_k[r.row] = p.top_k or 0
            u[r.row] = rng_for(r.seq.seed, r.index).random()
        token, chosen, top_ids, top_lp = self._full(logits, greedy, temperature, top_k, top_p, min_p, u)
        token = np.asarray(token)
        if any(r.seq.sampling.logprobs is not None for r in rows):
            chosen, top_ids, top_lp = np.asarray(chosen), np.asarray(top_ids), np.asarray(top_lp)
        lps = []
        for r in rows:
            k = r.seq.sampling.logprobs
            lps.append(None if k is None else TokenLogprobs(
                int(token[r.row]), float(chosen[r.row]),
                tuple((int(t), float(v)) for t, v in zip(top_ids[r.row, :k], top_lp[r.row, :k]))))
        return [int(token[r.row]) for r in rows], lps
