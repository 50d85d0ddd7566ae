"""ModelRunner on a real exported artifact: a tiny random-init Llama, greedy tokens vs transformers.

The artifact is exported with hloserve.exporter.llm.hf_causal (2 layers,
hidden 64, vocab 256, block size 8, f32) and run through hloserve.runtime in
strict mode (any compile after warm-up raises). The scheduler runs it with
chunked prefill, prefix-cache hits and a pool small enough to force
preemption; every request's greedy tokens must equal transformers' greedy
decoding of the same weights token for token (weights scaled x3 so logits have
no near-ties at f32 noise).
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from hloserve.server.core.block_manager import BlockManager
from hloserve.server.core.engine import Engine
from hloserve.server.core.model_runner import ModelRunner
from hloserve.server.core.step_shapes import RunnerConfig, build_step, warmup_shapes
from hloserve.server.core.sampling import SamplingParams
from hloserve.server.core.outputs import ScheduledSeq, SchedulerPlan
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig

VOCAB = 256
BLOCK = 8
GEN = 10


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from tests.support.tiny_llama import tiny_llama
    return tiny_llama(str(tmp_path_factory.mktemp("tiny-llm")), heads=4, kv_heads=2, max_position=256,
                      block_size=BLOCK, max_context=128)


@pytest.fixture(scope="module")
def runner(tiny_llm):
    _, art = tiny_llm
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(16,), num_blocks=14,
                       kv_cache_bytes=0)
    r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
    assert r.warmup() == len(r.warmup_shapes()) == 3      # decode (4,4) + prefill (16,4), (32,4)
    return r


def test_kernel_runner_compiles_one_table_width(tiny_llm):
    """Where decode's attention runs as the CPU kernel (it reads only the blocks in use), every
    step is one decode call and only the widest block table is compiled."""
    _, art = tiny_llm
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(8, 16), num_blocks=14,
                       kv_cache_bytes=0)
    r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
    if not r.one_call:
        pytest.skip("the CPU kernels are off here (no C++ compiler): every width is compiled")
    assert r.cfg.block_buckets == (16,)
    assert sorted(r.warmup_shapes()) == [("decode", 4, 4, 16), ("decode", 16, 4, 16), ("decode", 32, 4, 16)]


def hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def test_step_arrays_padding():
    cfg = RunnerConfig(token_buckets=(16,), seq_buckets=(4,), block_buckets=(8,), num_blocks=None, kv_cache_bytes=0)
    g = dict(needs_logits=True, sampling=SamplingParams(temperature=0), seed=0, sample_index=0)
    seqs = (ScheduledSeq(request_id="a", token_ids=(5,), start=9, block_table=(2, 3), **g),
            ScheduledSeq(request_id="b", token_ids=(7, 8, 9), start=0, block_table=(5,), **g))
    a = build_step(SchedulerPlan.of(seqs), cfg, BLOCK)
    assert a.function == "prefill" and a.num_seqs == 2
    x = a.inputs
    assert x["tokens"].tolist() == [5, 7, 8, 9] + [0] * 12
    assert x["seq_ids"].tolist() == [0, 1, 1, 1] + [3] * 12            # padding tokens -> padding row 3
    assert x["slot_mapping"].tolist() == [25, 40, 41, 42] + [0] * 12    # ... writing into the null block
    assert x["block_tables"].tolist() == [[2, 3] + [0] * 6, [5] + [0] * 7, [0] * 8, [0] * 8]
    assert x["context_lens"].tolist() == [10, 3, 0, 0] and x["last_token"].tolist() == [0, 3, 0, 0]
    d = build_step(SchedulerPlan.of(seqs[:1]), cfg, BLOCK)
    assert d.function == "decode" and d.inputs["tokens"].shape == (4,)  # decode: T = S bucket
    assert sorted(warmup_shapes(RunnerConfig(token_buckets=(16, 64), seq_buckets=(1, 2, 4, 32), block_buckets=(8,),
                                             num_blocks=None, kv_cache_bytes=0))) == sorted([
        ("decode", 1, 1, 8), ("decode", 2, 2, 8), ("decode", 4, 4, 8), ("decode", 32, 32, 8),
        ("prefill", 16, 1, 8), ("prefill", 64, 1, 8), ("prefill", 16, 2, 8), ("prefill", 64, 2, 8),
        ("prefill", 16, 4, 8), ("prefill", 64, 4, 8),                 # 5..32 seqs padded to 32 rows, with
        ("prefill", 16, 32, 8), ("prefill", 64, 32, 8)])                # 6+ tokens: T bucket 16 or 64


def test_lone_token_buckets_pad_one_sequence_finer():
    """with_lone_buckets: a prompt step of one sequence pads to the next 32 tokens; a step of two or more
    sequences keeps the coarse buckets; warm-up compiles exactly the shapes build_step can produce."""
    cfg = RunnerConfig(token_buckets=(32, 128, 256), seq_buckets=(1, 2), block_buckets=(64,), num_blocks=None,
                       kv_cache_bytes=0).with_lone_buckets(32)
    assert cfg.lone_token_buckets == (32, 64, 96, 128, 160, 192, 224, 256)
    assert cfg.with_lone_buckets(32) == cfg
    one = ScheduledSeq(request_id="a", token_ids=tuple(range(150)), start=0, block_table=tuple(range(1, 11)),
                       needs_logits=True, sampling=SamplingParams(), seed=0, sample_index=0)
    two = [dataclasses.replace(one, token_ids=one.token_ids[:100]),
           dataclasses.replace(one, request_id="b", token_ids=one.token_ids[:50])]
    assert build_step(SchedulerPlan.of([one]), cfg, 16).inputs["tokens"].shape == (160,)
    assert build_step(SchedulerPlan.of(two), cfg, 16).inputs["tokens"].shape == (256,)
    shapes = warmup_shapes(cfg)
    assert sorted(t for f, t, s, _ in shapes if f == "prefill" and s == 1) == list(cfg.lone_token_buckets)
    assert sorted(t for f, t, s, _ in shapes if f == "prefill" and s == 2) == [32, 128, 256]


def test_step_policy_is_chosen_by_layout_and_kernel_support_before_load(monkeypatch):
    """The runner picks its functions by the layouts the contract records (not by their names) and
    makes every step one call only where the runtime will run the per-token layout's composite."""
    from hloserve.runtime.artifact import LLMSpec
    from hloserve.runtime import kernels as runtime_kernels
    from hloserve.runtime.kernels import CpuBackend, Decompositions, pallas
    from hloserve.runtime.kernels.cpu.build import Library
    from hloserve.server.core.step_shapes import StepPolicy
    raw = {"block_size": 8, "max_blocks": 8, "max_seqs": 4, "max_tokens": 32, "vocab_size": VOCAB,
           "kv_cache": {"dtype": "f32", "shape": [2, 2, 2, "num_blocks", 8, 8]},
           "step": {"functions": {"wide": "flat: ...", "narrow": "gather: ..."}}}
    llm = LLMSpec.from_json(raw)
    kernels, none = CpuBackend(Library("libhloserve_cpu.so", "digest")), Decompositions()
    assert StepPolicy.choose(llm, ["wide", "narrow"], kernels, "a") == StepPolicy(
        decode_fn="narrow", prefill_fn="narrow", one_call=True)
    assert StepPolicy.choose(llm, ["wide", "narrow"], none, "a") == StepPolicy(
        decode_fn="narrow", prefill_fn="wide", one_call=False)
    cfg = RunnerConfig(token_buckets=(16,), seq_buckets=(4,), block_buckets=(2, 4, 8), num_blocks=None,
                       kv_cache_bytes=0)
    assert StepPolicy.choose(llm, ["wide", "narrow"], kernels, "a").buckets(cfg).block_buckets == (8,)
    assert StepPolicy.choose(llm, ["wide", "narrow"], none, "a").buckets(cfg) == cfg
    # a GPU or TPU whose Pallas kernel runs the attention composite: one call, one width (20
    # executables, not 100: an H200 compiled each in ~3.4 s), as on the CPU
    for platform in ("gpu", "tpu"):
        backend = runtime_kernels.support(platform, mesh=False)
        assert StepPolicy.choose(llm, ["wide", "narrow"], backend, "a").buckets(cfg).block_buckets == (8,)
        assert runtime_kernels.support(platform, mesh=True).composites == frozenset()
    monkeypatch.setenv(pallas.ENV, "0")
    assert not StepPolicy.choose(llm, ["wide", "narrow"], runtime_kernels.support("gpu", mesh=False), "a").one_call
    paged = LLMSpec.from_json({**raw, "step": {"functions": {"decode": "paged: ...", "prefill": "flat: ..."}}})
    assert not StepPolicy.choose(paged, ["prefill", "decode"], kernels, "a").one_call   # no composite to run
    unnamed = LLMSpec.from_json({**raw, "step": {}})                  # an artifact that records no layout
    assert StepPolicy.choose(unnamed, ["prefill", "decode"], kernels, "a") == StepPolicy(
        decode_fn="decode", prefill_fn="prefill", one_call=False)
    with pytest.raises(ValueError, match="neither a 'decode' nor a 'prefill'"):
        StepPolicy.choose(unnamed, ["forward"], kernels, "a")


@pytest.fixture(scope="module")
def portable_runner(tiny_llm):
    """The runner with the CPU kernels turned off (HLOSERVE_CPU_KERNELS=0 at load): every composite
    runs the decomposition the artifact carries, and decode and prefill are separate calls."""
    import os

    from hloserve.runtime.kernels.cpu import build as kernels
    _, art = tiny_llm
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(16,), num_blocks=14,
                       kv_cache_bytes=0)
    old = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "0"
    try:
        r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
    finally:
        if old is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = old
    assert not r.one_call and r.warmup() == len(r.warmup_shapes())
    return r


@pytest.mark.slow
def test_greedy_tokens_match_transformers_with_chunking_prefix_hits_and_preemption(tiny_llm, runner):
    greedy_tokens_match_transformers(tiny_llm, runner)


@pytest.mark.slow
def test_greedy_tokens_match_transformers_with_the_kernels_off(tiny_llm, portable_runner):
    greedy_tokens_match_transformers(tiny_llm, portable_runner)


def test_greedy_tokens_match_transformers_with_chunks_cut_to_buckets(tiny_llm, runner):
    """The scheduler cutting a prompt's chunk back to a token bucket (SchedulerConfig.token_buckets):
    20 tokens run as 16 + 4, 18 as 16 + 2, 9 as one chunk; the same greedy tokens as transformers'."""
    hf, _ = tiny_llm
    rng = random.Random(4)
    for n, chunks in ((20, [16, 4]), (18, [16, 2]), (9, [9])):
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                          admission_watermark=0.0, enable_prefix_caching=False,
                                          token_buckets=(4, 16, 32), step_cost_rows=0),
                          BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False))
        sched.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
        got, ran = [], []
        while sched.has_unfinished():
            plan = sched.schedule()
            ran += [len(q.token_ids) for q in plan.seqs if q.start < n]
            for o in sched.update(plan, runner.execute(plan)):
                got += o.new_token_ids
        assert ran == chunks
        assert got == hf_greedy(hf, prompt, GEN), f"prompt length {n}"


def greedy_tokens_match_transformers(tiny_llm, runner):
    """Chunked prefill, prefix-cache hits and preemption on `runner`: every request's greedy tokens
    equal transformers' on the same weights; nothing compiles after warm-up, every block comes back."""
    hf, _ = tiny_llm
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(17)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 30, 9)]
    prompts += [shared + [5, 6], shared + [7]]                 # two full shared blocks -> prefix hits
    # 13 usable blocks (104 slots) for 5 requests needing 77 prompt + 50 generated tokens: preemption
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                      admission_watermark=0.0, enable_prefix_caching=True),
                      BlockManager(runner.num_blocks, runner.block_size))
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    got = {}
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, greedy)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        for o in sched.update(plan, runner.execute(plan)):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        assert steps < 500
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, GEN), f"request r{i} (prompt length {len(p)})"
    assert sched.stats.num_preemptions >= 1 and sched.stats.prefix_cache_hits >= 16
    assert runner.stats()["compiles_after_warmup_total"] == 0
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks


@pytest.mark.parametrize("which", ["runner", "portable_runner"])
def test_greedy_tokens_match_transformers_with_speculation(tiny_llm, which, request):
    """Speculative decoding on the real step (a row per verified token; one call where the kernels
    run, the decode call otherwise): prompts that repeat themselves, so the n-gram proposer drafts and the
    model accepts some drafts and rejects others; every token equals transformers' greedy one."""
    from hloserve.server.core.spec_decode import SpeculativeConfig
    runner = request.getfixturevalue(which)
    hf, _ = tiny_llm
    rng = random.Random(5)
    motif = [rng.randrange(3, VOCAB) for _ in range(6)]
    prompts = [motif * 3 + motif[:2], [rng.randrange(3, VOCAB) for _ in range(9)]]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                      admission_watermark=0.0, enable_prefix_caching=True, speculative=spec),
                      BlockManager(runner.num_blocks, runner.block_size))
    n = 24
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    got: dict[str, list] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        for o in sched.update(plan, runner.execute(plan)):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, n), f"request r{i}"
    s = sched.stats.spec
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert runner.stats()["compiles_after_warmup_total"] == 0
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks


@pytest.mark.slow
def test_engine_thread_on_the_real_artifact(tiny_llm, runner):
    hf, _ = tiny_llm
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                      admission_watermark=0.01, enable_prefix_caching=True),
                      BlockManager(runner.num_blocks, runner.block_size), eos_token_ids=[2])
    prompts = [[9, 8, 7, 6, 5], list(range(40, 61))]
    with Engine(sched, runner, vocab_size=VOCAB) as eng:
        streams = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)) for p in prompts]
        seeded = [eng.add_request(prompts[0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=GEN, seed=7))
                  for _ in range(2)]
        outs = [[t for o in s for t in o.new_token_ids] for s in streams]
        samples = [[t for o in s for t in o.new_token_ids] for s in seeded]
    assert outs == [hf_greedy(hf, p, GEN) for p in prompts]
    assert samples[0] == samples[1] and len(samples[0]) >= 1    # same seed, same tokens (EOS may end early)
    m = eng.metrics()
    assert m.runner["compiles_after_warmup_total"] == 0 and m.kv_free_blocks == m.kv_total_blocks
    assert np.isfinite(m.ttft.sum) and m.ttft.count == 4


def test_stopping_the_engine_ends_queued_waiting_and_running_requests(runner):
    """stop() on the real runner with one request running (its blocks filled by a real step), one
    waiting in the scheduler and one still in the inbox: each stream ends with an error, every
    block goes back to the free pool."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=128,
                                      admission_watermark=0.0, enable_prefix_caching=True),
                      BlockManager(runner.num_blocks, runner.block_size))
    eng = Engine(sched, runner, vocab_size=VOCAB)
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    running, waiting = (eng.add_request(list(range(10, 30)), greedy) for _ in range(2))
    eng.run_once()                                   # admits both; the first runs its prompt
    assert [len(o.new_token_ids) for o in running.drain()] == [1] and sched.num_waiting == 1
    assert sched.blocks.num_free_blocks < sched.blocks.total_blocks
    queued = eng.add_request([5, 6, 7], greedy)      # never handled: still in the inbox
    eng.stop()
    for stream in (running, waiting, queued):
        last = stream.drain()[-1]
        assert stream.finished and last.finish_reason == "error" and last.error == "the engine stopped"
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks and not sched.has_unfinished()


@pytest.mark.slow
def test_build_engine_wires_an_artifact(tiny_llm, monkeypatch):
    from hloserve.runtime.artifact import HloserveError, LLMSpec, Manifest, read_manifest
    from hloserve.server.config import ServeConfig
    from hloserve.server.wiring import build_engine
    hf, art = tiny_llm
    with pytest.raises(HloserveError, match="exceeds the artifact's max_context 128"):
        build_engine(art, ServeConfig(max_model_len=256))
    sched, runner, notes = ServeConfig(max_num_seqs=16, max_num_batched_tokens=128).resolve(
        LLMSpec.of(read_manifest(art), art))                    # clamped to the artifact once, and said so
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (8, 64) and len(notes) == 2
    assert runner.seq_buckets[-1] == 8 and runner.token_buckets[-1] == 64
    reads = []                               # spies (the real methods run): the artifact is read and typed once
    for cls in (Manifest, LLMSpec):
        real = cls.from_json.__func__
        monkeypatch.setattr(cls, "from_json", classmethod(
            lambda c, *a, _real=real, **k: (reads.append(c.__name__), _real(c, *a, **k))[1]))
    eng, tok = build_engine(art, ServeConfig(max_num_seqs=1, max_num_batched_tokens=32, block_buckets=1,
                                             min_token_bucket=16, prefill_growth=2, num_blocks=32, platform="cpu"))
    assert sorted(reads) == ["LLMSpec", "Manifest"]
    assert tok is None                                         # save_pretrained of a bare model ships no tokenizer
    assert eng.scheduler.config.max_model_len == 128 and eng.scheduler.eos_token_ids == {2}
    assert eng.warmup() == 3                                   # decode (1,1) + prefill (16,1), (32,1), width 16
    with eng:
        out = list(eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)))
    assert [t for o in out for t in o.new_token_ids] == hf_greedy(hf, [4, 5, 6], GEN)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request([1], SamplingParams(stop=["x"]))


def test_block_saves_keep_what_the_plan_saw_and_land_after_dispatch(tiny_llm):
    """Prefix-cache tiers on the real runner: a plan's saves are gathers sent with its step, in the tiers
    only from `collect` (dispatch does not read them back), holding each block as it was when the plan
    asked though the same step overwrites it; a lookup while the step runs finds them so too; loaded
    back into other blocks in the next step, they give the token computing them gave."""
    from hloserve.runtime.artifact.llm import NUM_BLOCKS
    from hloserve.server.core.block_manager import hash_block
    from hloserve.server.core.kv_tiers import HostBlockCache, KVTiers
    _, art = tiny_llm
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(16,), num_blocks=14,
                       kv_cache_bytes=0)
    r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
    tiers = KVTiers(HostBlockCache(1 << 20), None)
    r.attach_tiers(tiers)
    r.warmup()
    axis = list(r.llm.kv_cache.shape).index(NUM_BLOCKS)

    def blocks(ids):                                   # the cache's blocks as the tiers keep them
        return np.moveaxis(np.take(np.asarray(r.kv_cache), ids, axis=axis), axis, 0)

    def seq(rid, tokens, start, table):
        return ScheduledSeq(request_id=rid, token_ids=tuple(tokens), start=start, block_table=table,
                            needs_logits=True, sampling=SamplingParams(temperature=0), seed=0, sample_index=0)

    def chain(tokens):
        h0 = hash_block(b"", tokens[:BLOCK])
        return [h0, hash_block(h0, tokens[BLOCK:2 * BLOCK])]

    rng = random.Random(11)
    a, b, d = ([rng.randrange(3, VOCAB) for _ in range(n)] for n in (17, 16, 16))
    first = r.execute(SchedulerPlan.of((seq("a", a, 0, (1, 2, 3)),)))
    want = blocks([1, 2])
    # blocks 1 and 2 saved and, in the same step, written with b's prompt (freed and reused)
    plan = dataclasses.replace(SchedulerPlan.of((seq("b", b, 0, (1, 2)),)), kv_saves=tuple(zip((1, 2), chain(a))))
    pending = r.dispatch(plan)
    assert all(tiers.holds(h) for h in chain(a)) and len(tiers.host) == 0   # sent, not read back
    r.collect(pending)
    assert not np.array_equal(blocks([1, 2]), want)                         # the step overwrote them...
    for h, w in zip(chain(a), want):                                        # ...after the save read them
        np.testing.assert_array_equal(tiers.host.get(h), w)
    # a's blocks loaded into 5, 6 to decode its last token; b's saved and overwritten by d's prompt
    mid = blocks([1, 2])
    loads = tuple((blk, tiers.get(h)[0]) for blk, h in zip((5, 6), chain(a)))
    plan = dataclasses.replace(SchedulerPlan.of((seq("c", a[16:], 16, (5, 6, 7)), seq("d", d, 0, (1, 2)))),
                               kv_saves=tuple(zip((1, 2), chain(b))), kv_loads=loads)
    pending = r.dispatch(plan)
    found = [tiers.get(h)[0] for h in chain(b)]          # looked up while the step runs (as async scheduling does)
    out = r.collect(pending)
    assert out.sampled["c"] == first.sampled["a"]
    assert not np.array_equal(blocks([1, 2]), mid)
    for f, w in zip(found, mid):
        np.testing.assert_array_equal(f, w)
    r.close()
