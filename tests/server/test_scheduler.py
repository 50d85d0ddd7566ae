"""Scheduler policy against MockRunner, whose outputs are computable by hand.

MockRunner: next token = (last token + 1) % vocab, read back from its token-id
"KV cache" through the block table. So a prompt [5, 6, 7] generates 8, 9, 10 ...
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from hloserve.server.core.block_manager import BlockManager
from hloserve.server.core.sampling import SamplingParams
from hloserve.runtime.artifact.llm import slots
from hloserve.server.core.outputs import RunnerOutput
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig, chunk_tokens, fit_to_bucket
from tests.support.mock_runner import MockRunner

VOCAB = 64
GREEDY = dict(temperature=0.0)


def make(num_blocks=32, block_size=4, max_num_seqs=4, max_tokens=8, max_model_len=64, watermark=0.0,
         token_buckets=(), step_cost_rows=16, **kw):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                      max_model_len=max_model_len, admission_watermark=watermark,
                                      enable_prefix_caching=True, token_buckets=token_buckets,
                                      step_cost_rows=step_cost_rows), bm,
                      seed_rng=random.Random(0), **kw)
    return sched, MockRunner(VOCAB, num_blocks, block_size)


def run(sched, runner, max_steps=200):
    """Step until idle; returns {request_id: [outputs]} and checks the invariants after every step."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(plan.seqs) <= plan.num_rows <= sched.config.max_num_seqs   # a verified draft: a row per token
        for o in sched.update(plan, runner.execute(plan)):
            outs.setdefault(o.request_id, []).append(o)
        sched.blocks.check_invariants()
    assert not sched.has_unfinished()
    return outs


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_single_request_greedy_by_hand():
    sched, runner = make()
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    outs = run(sched, runner)["a"]
    assert tokens(outs) == [8, 9, 10]
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].finish_reason == "length"
    assert runner.contexts["a"] == [5, 6, 7, 8, 9]          # the last decode read the whole context back
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks


def test_chunked_prefill_does_not_starve_decodes():
    sched, runner = make(max_tokens=8)
    sched.add_request("short", [1, 2], SamplingParams(max_tokens=6, **GREEDY))
    plan = sched.schedule()                                  # step 1: short's whole prompt
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("short", 2)]
    sched.update(plan, runner.execute(plan))
    sched.add_request("long", list(range(20)), SamplingParams(max_tokens=2, **GREEDY))
    shapes, long_tokens = [], []
    for _ in range(4):
        plan = sched.schedule()
        shapes.append([(s.request_id, len(s.token_ids), s.needs_logits) for s in plan.seqs])
        long_tokens += [t for o in sched.update(plan, runner.execute(plan)) if o.request_id == "long"
                        for t in o.new_token_ids]
    # every step: short's decode first (1 token), long's prefill chunk gets the other 7 of the budget of 8
    assert shapes == [
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 6, True)],             # 7 + 7 + 6 = 20: the last chunk samples
        [("short", 1, True), ("long", 1, True)],             # both decoding
    ]
    assert long_tokens == [20, 21]                           # the first token came with the last chunk
    assert runner.contexts["long"] == list(range(21))
    assert tokens(run(sched, runner)["short"]) == [8]        # 3 .. 7 came in the five steps above


def test_positions_and_slot_mapping_follow_the_block_table():
    sched, runner = make(block_size=4, max_tokens=16)
    sched.add_request("a", list(range(10)), SamplingParams(max_tokens=1, **GREEDY))
    plan = sched.schedule()
    (s,) = plan.seqs
    assert s.block_table == (1, 2, 3)
    assert s.start == 0 and len(s.token_ids) == 10 and s.context_len == 10
    assert slots(s.start, len(s.token_ids), s.block_table, 4) == list(range(4, 14))   # block 1 starts at slot 4


def test_max_num_seqs_and_fifo_admission():
    sched, runner = make(max_num_seqs=2, max_tokens=16)
    for r in "abc":
        sched.add_request(r, [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    plan = sched.schedule()
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert sched.num_waiting == 1
    outs = run(sched, runner)
    assert {r: tokens(o) for r, o in outs.items()} == {"a": [4, 5], "b": [4, 5], "c": [4, 5]}


def test_preempt_newest_and_recompute_gives_same_tokens():
    # 5 usable blocks of 2 tokens. a and b each grow to 3 + 6 = 9 tokens = 5 blocks: they cannot both fit.
    sched, runner = make(num_blocks=6, block_size=2, max_num_seqs=4, max_tokens=8, max_model_len=16)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, **GREEDY))
    sched.add_request("b", [10, 11, 12], SamplingParams(max_tokens=6, **GREEDY))
    outs = run(sched, runner)
    assert tokens(outs["a"]) == [4, 5, 6, 7, 8, 9]
    assert tokens(outs["b"]) == [13, 14, 15, 16, 17, 18]      # recomputed after preemption: same tokens
    assert sched.stats.num_preemptions >= 1
    preempted = [rid for p in runner.plans for rid in p.preempted]
    assert set(preempted) == {"b"}                             # always the newest, never the oldest
    assert runner.contexts["b"] == [10, 11, 12, 13, 14, 15, 16, 17]
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks


def test_preemption_count_exact():
    # 4 usable blocks of 2: a (3 prompt + 4 out = 7 tokens = 4 blocks) alone fills the pool
    sched, runner = make(num_blocks=5, block_size=2, max_num_seqs=2, max_tokens=8, max_model_len=16)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    sched.add_request("b", [7], SamplingParams(max_tokens=4, **GREEDY))
    # step 1: a (2 blocks) + b (1 block); step 2: decodes (a at pos 3 fits block 2; b at 1 fits);
    # step 3: a needs block 3 (pos 4) -> 1 free -> ok; b pos 2 needs a block -> none -> b preempts itself.
    outs = run(sched, runner)
    assert tokens(outs["a"]) == [4, 5, 6, 7] and tokens(outs["b"]) == [8, 9, 10, 11]
    assert sched.stats.num_preemptions == 1
    assert [p.preempted for p in runner.plans if p.preempted] == [("b",)]


def test_abort_frees_blocks_at_once():
    sched, runner = make(max_tokens=16)
    sched.add_request("a", list(range(9)), SamplingParams(max_tokens=20, **GREEDY))
    sched.add_request("w", [1], SamplingParams(max_tokens=20, **GREEDY))
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    used = sched.blocks.total_blocks - sched.blocks.num_free_blocks
    assert used == 3 + 1
    out = sched.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert sched.blocks.total_blocks - sched.blocks.num_free_blocks == 1
    assert sched.abort("a") is None                           # already gone
    # abort between schedule and update: the stale plan row is ignored
    plan = sched.schedule()
    sched.abort("w")
    assert sched.update(plan, runner.execute(plan)) == []
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks and not sched.has_unfinished()


def test_abort_waiting_request():
    sched, _ = make(max_num_seqs=1)
    sched.add_request("a", [1], SamplingParams(max_tokens=2))
    sched.add_request("b", [1], SamplingParams(max_tokens=2))
    sched.schedule()
    assert sched.abort("b").finish_reason == "abort" and sched.num_waiting == 0


def test_prefix_cache_hit_skips_computed_blocks():
    sched, runner = make(block_size=4, max_tokens=16)
    prompt = list(range(30, 40))                              # 10 tokens: 2 full blocks
    sched.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))
    run(sched, runner)
    sched.add_request("b", prompt, SamplingParams(max_tokens=2, **GREEDY))
    plan = sched.schedule()
    (s,) = plan.seqs
    assert s.start == 8 and s.token_ids == (38, 39)     # only the last two tokens are computed
    assert sched.stats.prefix_cache_hits == 8 and sched.stats.prefix_cache_queries == 20
    outs = run(sched, runner)
    assert runner.contexts["b"][:10] == prompt                # the revived blocks hold a's tokens
    assert outs["b"][-1].num_cached_tokens == 8
    # 9 tokens: the second full block is computed again rather than leave the last token alone
    sched.add_request("c", prompt[:9], SamplingParams(max_tokens=2, **GREEDY))
    (s,) = sched.schedule().seqs
    assert s.start == 4 and s.token_ids == tuple(prompt[4:9])


@pytest.mark.parametrize("left,budget,want", [(10, 256, 10), (1, 256, 1), (1, 1, 1), (10, 9, 8), (10, 1, 0),
                                              (3, 2, 0), (2, 1, 0), (2, 2, 2), (300, 256, 256), (257, 256, 255)])
def test_a_chunk_is_never_one_token_of_more_nor_leaves_one(left, budget, want):
    """A prompt token cut off alone would take the attention kernel's one-token path, whose sums run in
    another order than a chunk's tile, so its bits (and a greedy answer) would depend on the budget."""
    assert chunk_tokens(left, budget) == want


def test_prompts_are_chunked_without_lone_tokens():
    """Budgets that would cut one token off: every chunk of a prompt of more than one token has two or more."""
    sched, runner = make(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens=5, max_model_len=64)
    prompts = {f"r{i}": n for i, n in enumerate((9, 10, 7, 2, 11))}
    for rid, n in prompts.items():
        sched.add_request(rid, list(range(20, 20 + n)), SamplingParams(max_tokens=3, **GREEDY))
    chunks = []
    while sched.has_unfinished():
        plan = sched.schedule()
        chunks += [len(s.token_ids) for s in plan.seqs if s.start < prompts[s.request_id]]
        sched.update(plan, runner.execute(plan))
    assert len(chunks) > len(prompts) and min(chunks) >= 2     # some prompts were cut, none to one token


@pytest.mark.parametrize("total, chunk, want", [
    (160, 160, 128),    # 128 + 32 + 16 rows < 256: cut
    (200, 200, 200),    # 128 + 128 + 16 >= 256: padded
    (44, 44, 32),       # 32 + 32 + 16 < 128
    (256, 240, 240),    # a bucket already
    (20, 20, 20),       # below the smallest bucket: nothing to cut to
    (150, 20, 20),      # the cut (22) is more than the last chunk can give and keep 2 tokens
    (150, 30, 8),       # 16 decodes + others + a 30-token chunk: cut by 22
])
def test_fit_to_bucket(total, chunk, want):
    assert fit_to_bucket(total, chunk, (32, 128, 256), 16) == want


def test_prompt_chunks_fit_the_token_buckets():
    """With the runner's token buckets given, a prompt that would pad far runs as bucket-sized chunks;
    one that pads little, or whose cut would cost a step more than the padding, is not cut."""
    chunks: dict[str, list[int]] = {}
    for n in (160, 200, 300, 130):
        sched, runner = make(num_blocks=256, block_size=16, max_num_seqs=4, max_tokens=256, max_model_len=512,
                             token_buckets=(32, 128, 256))
        sched.add_request(f"p{n}", list(range(n)), SamplingParams(max_tokens=2, **GREEDY))
        outs = run(sched, runner)
        assert tokens(outs[f"p{n}"]) == [n % VOCAB, (n + 1) % VOCAB]     # the mock's next token: the last + 1
        chunks[n] = [len(q.token_ids) for plan in runner.plans for q in plan.seqs if q.start < n]
    assert chunks == {160: [128, 32], 200: [200], 300: [256, 32, 12], 130: [128, 2]}


def test_a_lone_prompt_uses_the_lone_buckets():
    """A step of one prompt and nothing else is padded to the finer lone buckets, so it is cut against
    those: 150 tokens pad to 160 there, fewer rows than 128 + 32 and a step more (with the coarse
    buckets alone it runs as 128 + 22, test_prompt_chunks_fit_the_token_buckets' rule)."""
    sched, runner = make(num_blocks=256, block_size=16, max_num_seqs=4, max_tokens=256, max_model_len=512,
                         token_buckets=(32, 128, 256))
    sched = Scheduler(dataclasses.replace(sched.config, lone_token_buckets=(32, 64, 96, 128, 160, 192, 224, 256)),
                      sched.blocks, seed_rng=random.Random(0))
    sched.add_request("a", list(range(150)), SamplingParams(max_tokens=2, **GREEDY))
    run(sched, runner)
    assert [len(q.token_ids) for plan in runner.plans for q in plan.seqs if q.start < 150] == [150]


def test_fit_chunks_flag_and_its_default_per_platform():
    from hloserve.server.cli import build_parser
    from hloserve.server.config import ServeConfig
    parse = build_parser("serve").parse_args
    assert parse(["serve", "--fit-chunks-to-buckets"]).fit_chunks_to_buckets is True
    assert parse(["serve", "--no-fit-chunks-to-buckets"]).fit_chunks_to_buckets is False
    assert parse(["serve"]).fit_chunks_to_buckets is None
    assert [ServeConfig().fit_chunks_on(p) for p in ("cpu", "gpu", "tpu")] == [True, False, False]
    assert ServeConfig(fit_chunks_to_buckets=True).fit_chunks_on("tpu")
    assert not ServeConfig(fit_chunks_to_buckets=False).fit_chunks_on("cpu")


def test_eos_and_stop_token_ids():
    sched, runner = make(eos_token_ids=[9])
    sched.add_request("a", [6], SamplingParams(max_tokens=10, **GREEDY))
    sched.add_request("b", [6], SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))
    sched.add_request("c", [1], SamplingParams(max_tokens=10, stop_token_ids=[3], **GREEDY))
    outs = run(sched, runner)
    assert tokens(outs["a"]) == [7, 8, 9] and outs["a"][-1].finish_reason == "stop"
    assert len(tokens(outs["b"])) == 10 and outs["b"][-1].finish_reason == "length"
    assert tokens(outs["c"]) == [2, 3] and outs["c"][-1].finish_reason == "stop"


def test_context_length_and_pool_size_validation():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 32 tokens, but the model's context is 32"):
        sched.add_request("a", [1] * 32, SamplingParams())
    with pytest.raises(ValueError, match=r"lower max_tokens to at most 12"):
        sched.add_request("a", [1] * 20, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="needs 4 KV blocks but the cache has 3"):
        sched.add_request("a", [1] * 10, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request("a", [], SamplingParams())
    sched.add_request("a", [1] * 10, SamplingParams(max_tokens=3))   # 12 computed tokens = 3 blocks: fits
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("a", [1], SamplingParams(max_tokens=2))


def test_config_validation():
    with pytest.raises(ValueError, match="raise the token budget"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64, admission_watermark=0,
                        enable_prefix_caching=True)


def test_seeded_sampling_is_reproducible_across_batches_and_preemption():
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1234)

    def gen(num_blocks, others):
        sched, runner = make(num_blocks=num_blocks, block_size=2, max_tokens=8, max_model_len=16)
        runner.peak = 1.0                                      # flat-ish logits: the draws matter
        sched.add_request("x", [1, 2, 3], params)
        for i in range(others):
            sched.add_request(f"o{i}", [4, 5], SamplingParams(temperature=1.0, max_tokens=6))
        outs = run(sched, runner)
        return tokens(outs["x"]), sched.stats.num_preemptions

    alone, _ = gen(64, 0)
    crowded, preemptions = gen(8, 3)
    assert crowded == alone and preemptions > 0


def test_update_with_many_requests_keeps_invariants():
    sched, runner = make(num_blocks=20, block_size=4, max_num_seqs=6, max_tokens=16, max_model_len=48)
    rng = random.Random(7)
    for i in range(25):
        n = rng.randint(1, 30)
        sched.add_request(f"r{i}", [rng.randrange(VOCAB) for _ in range(n)],
                          SamplingParams(max_tokens=rng.randint(1, 12), **GREEDY))
    outs = run(sched, runner, max_steps=2000)
    assert len(outs) == 25 and all(o[-1].finished for o in outs.values())
    for rid, o in outs.items():                                # tokens are consecutive from the prompt's last
        ts = tokens(o)
        assert all((b - a) % VOCAB == 1 for a, b in zip(ts, ts[1:]))
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks


def test_empty_runner_output_for_prefill_only_plan():
    sched, _ = make(max_tokens=4)
    sched.add_request("a", list(range(10)), SamplingParams(max_tokens=1))
    plan = sched.schedule()
    assert not plan.seqs[0].needs_logits
    assert sched.update(plan, RunnerOutput({})) == []


# -- property test: random workloads with aborts -------------------------------------
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

workload = st.lists(st.tuples(st.integers(1, 24),          # prompt length
                              st.integers(0, 2),           # prompt family (shared prefixes -> cache hits)
                              st.integers(1, 10),          # max_tokens
                              st.integers(0, 40)),         # abort at this step (> 30: never)
                    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(workload, st.integers(8, 24), st.sampled_from([2, 4]), st.sampled_from([(), (2, 4, 8)]))
def test_random_workloads_keep_every_invariant(reqs, num_blocks, block_size, buckets):
    sched, runner = make(num_blocks=num_blocks, block_size=block_size, max_num_seqs=3, max_tokens=8,
                         max_model_len=40, watermark=0.05, token_buckets=buckets, step_cost_rows=0)
    prompts, aborts = {}, {}
    for i, (n, fam, max_tokens, abort_at) in enumerate(reqs):
        prompt = [(fam * 16 + k) % VOCAB for k in range(n)]
        try:
            sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
        except ValueError:
            continue                                          # does not fit the pool: rejected up front
        prompts[f"r{i}"] = (prompt, max_tokens)
        aborts.setdefault(abort_at, []).append(f"r{i}")
    got: dict[str, list[int]] = {}
    finished = {}
    for step in range(2000):
        if not sched.has_unfinished():
            break
        for rid in aborts.get(step, []):
            out = sched.abort(rid)
            if out is not None:
                finished[rid] = out.finish_reason
        plan = sched.schedule()
        assert plan.num_tokens <= 8 and len(plan.seqs) <= 3
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
        for o in sched.update(plan, runner.execute(plan)):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o.finish_reason
        sched.blocks.check_invariants()
        for s in plan.seqs:                                   # the cache held exactly prompt + outputs
            if s.request_id in runner.contexts and s.needs_logits and s.request_id in prompts:
                prompt, _ = prompts[s.request_id]
                ctx = runner.contexts[s.request_id]
                assert ctx == (prompt + got.get(s.request_id, []))[:len(ctx)]
    assert not sched.has_unfinished()
    assert set(finished) == set(prompts)
    for rid, (prompt, max_tokens) in prompts.items():
        toks = got.get(rid, [])
        assert toks == [(prompt[-1] + k) % VOCAB for k in range(1, len(toks) + 1)]
        if finished[rid] == "length":
            assert len(toks) == max_tokens
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks
    event(f"preempted: {sched.stats.num_preemptions > 0}")
    event(f"prefix hits: {sched.stats.prefix_cache_hits > 0}")
    event(f"aborted: {'abort' in finished.values()}")


def test_min_tokens_keeps_eos_out_until_reached():
    """EOS (here token 4, what the mock runner produces after [1, 2, 3]) is suppressed in sampling and
    does not stop the request before min_tokens outputs."""
    sched, runner = make(eos_token_ids=[4])
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, **GREEDY))
    sched.add_request("b", [1, 2, 3], SamplingParams(max_tokens=8, min_tokens=3, **GREEDY))
    outs = run(sched, runner)
    assert tokens(outs["a"]) == [4] and outs["a"][-1].finish_reason == "stop"
    got = tokens(outs["b"])
    assert len(got) >= 3 and 4 not in got[:3]
