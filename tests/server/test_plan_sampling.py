"""Sampling on the device (core/plan_sampling.py DeviceSampler) against the host's sampler
(sampling.py through `sample_plan`), row for row.

Both draw at the same u = rng_for(seed, index).random(); the device sums the filtered probabilities
in f32, the host in f64. So greedy rows, logprobs' token ids and drafts' acceptance must be equal,
and a sampled token may differ only where u lies within the f32 sum's rounding of a boundary
between two neighbouring candidates: every such difference is checked to be that, and rare.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from hloserve.server.core.outputs import ScheduledSeq, SchedulerPlan
from hloserve.server.core.plan_sampling import DeviceSampler, sample_plan
from hloserve.server.core.sampling import RowContext, SamplingParams, _candidates, rng_for

VOCAB = 3000
PARAMS = [SamplingParams(temperature=0),
          SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7),
          SamplingParams(temperature=1.0, top_k=40),
          SamplingParams(temperature=0.8, top_p=0.9),
          SamplingParams(temperature=1.3, top_p=0.5, top_k=100),
          SamplingParams(temperature=1.0, min_p=0.05),
          SamplingParams(temperature=0.6, top_k=1000, top_p=0.95, min_p=0.01)]


@pytest.fixture(scope="module")
def sampler():
    return DeviceSampler()


def seq(i, params, seed, index=0, draft=(), context=RowContext()) -> ScheduledSeq:
    return ScheduledSeq(request_id=f"r{i}", token_ids=(1,) + tuple(draft), start=5, block_table=(1,),
                        needs_logits=True, sampling=params, seed=seed, sample_index=index, context=context,
                        draft_token_ids=tuple(draft))


def logits_like_a_model(rng, rows) -> np.ndarray:
    """Rows of logits with a trained model's spread: a few likely tokens over a long tail."""
    x = rng.standard_normal((rows, VOCAB)).astype(np.float32) * rng.uniform(1.5, 4.0, (rows, 1)).astype(np.float32)
    x[np.arange(rows)[:, None], rng.integers(0, VOCAB, (rows, 5))] += rng.uniform(4, 10, (rows, 5)).astype(np.float32)
    return x


def on_device(x):
    import jax
    return jax.device_put(x)


def near_boundary(logits_row, params, seed, index, host_token, device_token) -> bool:
    """Whether the two tokens are neighbouring candidates with u within f32 rounding of the cdf between them."""
    ids, w = _candidates(logits_row, params)
    cdf = np.cumsum(w, dtype=np.float64)
    target = rng_for(seed, index).random() * cdf[-1]
    a, b = (int(np.flatnonzero(ids == t)[0]) for t in (host_token, device_token))
    if abs(a - b) != 1:
        return False
    return abs(cdf[min(a, b)] - target) <= 1e-5 * cdf[-1]


def test_device_rows_draw_what_the_host_draws(sampler):
    _draws_match(sampler)


@pytest.mark.gpu
def test_on_the_accelerator_the_draws_are_the_hosts(sampler):
    """The same rows sampled by the GPU's (or TPU's) compile of the sampler (benchmarks/gpu_check.sh
    runs the gpu-marked tests)."""
    import jax
    if jax.default_backend() == "cpu":
        pytest.skip("needs an accelerator")
    _draws_match(sampler)
    x = logits_like_a_model(np.random.default_rng(9), 4)
    plan = SchedulerPlan.of(tuple(seq(i, SamplingParams(temperature=0, logprobs=3), seed=i) for i in range(4)))
    got, host = sampler.sample_plan(plan, on_device(x), lambda: None), sample_plan(plan, x)
    assert got.sampled == host.sampled
    for rid, (h,) in host.logprobs.items():
        assert abs(got.logprobs[rid][0].logprob - h.logprob) <= 1e-4 * max(1.0, abs(h.logprob)), rid


def _draws_match(sampler):
    rng = np.random.default_rng(0)
    rows, differ, total = 16, 0, 0
    for round_ in range(12):
        x = logits_like_a_model(rng, rows)
        seqs = tuple(seq(i, PARAMS[(i + round_) % len(PARAMS)], seed=1000 * round_ + i, index=round_)
                     for i in range(rows))
        plan = SchedulerPlan.of(seqs)
        host = sample_plan(plan, x)
        got = sampler.sample_plan(plan, on_device(x), lambda: pytest.fail("no row needs the host"))
        for i, s in enumerate(seqs):
            h, d = host.sampled[s.request_id], got.sampled[s.request_id]
            total += 1
            if h == d:
                continue
            assert not s.sampling.greedy, (i, h, d)
            assert near_boundary(x[i], s.sampling, s.seed, s.sample_index, h[0], d[0]), (i, s.sampling, h, d)
            differ += 1
    assert differ <= total // 50, f"{differ} of {total} draws differ"


def test_the_device_keeps_the_hosts_candidates(sampler, monkeypatch):
    """The filtered set (top-k, top-p, min-p) is the host's: a draw at u = 0 takes the first candidate
    in vocabulary order, one at u just below 1 the last, on both sides."""
    import hloserve.server.core.plan_sampling as plan_sampling
    rng = np.random.default_rng(1)
    x = logits_like_a_model(rng, len(PARAMS))
    plan = SchedulerPlan.of(tuple(seq(i, p, seed=i) for i, p in enumerate(PARAMS)))
    for u in (0.0, 1 - 1e-9):
        monkeypatch.setattr(plan_sampling, "rng_for", lambda seed, index: _Fixed(u))
        got = sampler.sample_plan(plan, on_device(x), lambda: None)
        for i, p in enumerate(PARAMS):
            if not p.greedy:
                ids, _ = _candidates(x[i], p)
                assert got.sampled[f"r{i}"] == (int(ids[0] if u == 0 else ids[-1]),), (p, u, len(ids))


class _Fixed:
    """A draw that is always u."""
    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_logprobs_and_greedy_rows(sampler):
    rng = np.random.default_rng(2)
    x = logits_like_a_model(rng, 8)
    x[3, 17] = x[3, 40] = x[3].max() + 1          # a tie: both take the lower id
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.9, logprobs=0),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=20)]
    seqs = tuple(seq(i, params[i % 4], seed=7 + i) for i in range(8))
    plan = SchedulerPlan.of(seqs)
    host = sample_plan(plan, x)
    got = sampler.sample_plan(plan, on_device(x), lambda: pytest.fail("no row needs the host"))
    assert got.sampled == host.sampled and got.sampled["r3"] == (17,)
    assert set(got.logprobs) == set(host.logprobs) == {"r0", "r1", "r3", "r4", "r5", "r7"}
    for rid, (h,) in host.logprobs.items():
        (d,) = got.logprobs[rid]
        assert d.token_id == h.token_id and abs(d.logprob - h.logprob) <= 1e-5 * max(1.0, abs(h.logprob))
        assert [t for t, _ in d.top] == [t for t, _ in h.top]
        np.testing.assert_allclose([v for _, v in d.top], [v for _, v in h.top], rtol=1e-5, atol=1e-5)
    # all greedy without logprobs: the argmax variant
    plain = SchedulerPlan.of(tuple(seq(i, SamplingParams(temperature=0), seed=i) for i in range(8)))
    assert sampler.sample_plan(plain, on_device(x), lambda: None).sampled == sample_plan(plain, x).sampled


def test_drafts_are_accepted_while_the_draws_equal_them(sampler):
    """Speculative rows: row j is draw index + j; the draft is accepted while each draw equals it and
    the first draw that differs ends the tokens, as sampling.verify_draft (greedy and seeded)."""
    rng = np.random.default_rng(3)
    x = logits_like_a_model(rng, 12)
    best = x.argmax(-1)
    greedy, seeded = SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, top_k=50)
    assert best[2] != 5
    seqs = (seq(0, greedy, 1, index=4, draft=(int(best[0]), int(best[1]), 5)),     # rows 0-3: 2 accepted, then 1
            seq(1, greedy, 2, index=0, draft=(int(best[4]), int(best[5]))),       # rows 4-6: all accepted + 1
            seq(2, seeded, 3, index=9, draft=(11, 12, 13)),                       # rows 7-10
            seq(3, greedy, 4))                                                    # row 11
    plan = SchedulerPlan.of(seqs)
    host = sample_plan(plan, x)
    got = sampler.sample_plan(plan, on_device(x), lambda: pytest.fail("no row needs the host"))
    assert got.sampled == host.sampled
    assert got.sampled["r0"] == (int(best[0]), int(best[1]), int(best[2])) and len(got.sampled["r1"]) == 3
    assert [lp.token_id for lp in got.logprobs["r0"]] == list(got.sampled["r0"])


def test_processed_and_masked_rows_are_sampled_on_the_host(sampler):
    rng = np.random.default_rng(4)
    x = logits_like_a_model(rng, 6)
    allowed = np.zeros(VOCAB, bool)
    allowed[[5, 9, 300]] = True
    seqs = (seq(0, SamplingParams(temperature=0, logit_bias=((77, 100.0),)), 1),
            seq(1, SamplingParams(temperature=0.9, repetition_penalty=1.3), 2,
                context=RowContext(prompt=(1, 2, 3), output=(int(x[1].argmax()),))),
            seq(2, SamplingParams(temperature=0), 3, context=RowContext(allowed=allowed)),
            seq(3, SamplingParams(temperature=0), 4, context=RowContext(suppress=(int(x[3].argmax()),))),
            seq(4, SamplingParams(temperature=0.7, top_p=0.8), 5),
            seq(5, SamplingParams(temperature=0), 6))
    plan = SchedulerPlan.of(seqs)
    fetched = []

    def host_logits():
        fetched.append(1)
        return x
    got = sampler.sample_plan(plan, on_device(x), host_logits)
    host = sample_plan(plan, x)
    assert fetched == [1]
    assert got.sampled["r0"] == (77,) and got.sampled["r2"][0] in (5, 9, 300)
    assert {k: got.sampled[k] for k in ("r0", "r1", "r2", "r3", "r5")} == \
        {k: host.sampled[k] for k in ("r0", "r1", "r2", "r3", "r5")}
    assert got.sampled["r4"] == host.sampled["r4"] or near_boundary(
        x[4], seqs[4].sampling, 5, 0, host.sampled["r4"][0], got.sampled["r4"][0])


def test_the_flag_and_its_default_per_platform():
    from hloserve.server.cli import build_parser
    from hloserve.server.config import ServeConfig
    parse = build_parser("serve").parse_args
    assert parse(["serve", "--sample-on-device"]).sample_on_device is True
    assert parse(["serve", "--no-sample-on-device"]).sample_on_device is False
    assert parse(["serve"]).sample_on_device is None
    default = ServeConfig()
    assert [default.sample_on_device_on(p) for p in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert ServeConfig(sample_on_device=True).sample_on_device_on("cpu")
    assert not ServeConfig(sample_on_device=False).sample_on_device_on("gpu")


# -- the real runner: a tiny exported Llama, through the engine -------------------------------------
REAL_VOCAB = 256


@pytest.fixture(scope="module")
def tiny_art(tmp_path_factory):
    from tests.support.tiny_llama import tiny_llama
    _, art = tiny_llama(str(tmp_path_factory.mktemp("tiny-llm")), heads=4, kv_heads=2, max_position=256,
                        block_size=8, max_context=128)
    return art


@pytest.fixture(scope="module")
def runners(tiny_art):
    """The same tiny artifact loaded twice: one runner samples on the host, the other on the device."""
    from hloserve.server.core.model_runner import ModelRunner
    from hloserve.server.core.step_shapes import RunnerConfig
    art = tiny_art
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(2, 4), block_buckets=(16,), num_blocks=40,
                       kv_cache_bytes=0)
    out = []
    for device in (False, True):
        r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
        if device:
            r.sample_on_device()
        r.warmup()
        out.append(r)
    return out


def test_real_runner_host_and_device_sampling_give_the_same_streams(runners):
    from hloserve.server.core.block_manager import BlockManager
    from hloserve.server.core.engine import Engine
    from hloserve.server.core.scheduler import Scheduler, SchedulerConfig
    from tests.server.test_async_scheduling import drive

    rng = random.Random(5)
    prompts = [[rng.randrange(3, REAL_VOCAB) for _ in range(n)] for n in (5, 21, 9, 30, 14)]
    requests = [("g0", prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                ("s1", prompts[1], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)),
                ("s2", prompts[2], SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=5, ignore_eos=True,
                                                  logprobs=3)),
                ("p3", prompts[3], SamplingParams(max_tokens=10, temperature=0.7, presence_penalty=1.0, seed=2,
                                                  ignore_eos=True)),
                ("m4", prompts[4], SamplingParams(max_tokens=10, temperature=1.0, min_p=0.02, min_tokens=4, seed=9,
                                                  ignore_eos=True))]
    results = []
    for r in runners:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                          admission_watermark=0.0, enable_prefix_caching=True),
                          BlockManager(r.num_blocks, r.block_size), eos_token_ids=[2], seed_rng=random.Random(0))
        results.append(drive(Engine(sched, r, vocab_size=REAL_VOCAB), requests))
    host, device = results
    assert device == host
    assert all(len(host[rid][0]) == n for rid, n in (("g0", 12), ("s1", 16), ("s2", 16), ("p3", 10), ("m4", 10)))
    assert runners[1].sampler.compiles() == 4     # both variants at both row buckets, compiled at warm-up
    assert runners[1].stats()["compiles_after_warmup_total"] == 0    # and nothing after (the sampler counted):
    odd = SchedulerPlan.of((seq(0, SamplingParams(temperature=0), 1),))  # logits of 3 rows: a shape never warmed
    runners[1].sampler.sample_plan(odd, on_device(np.zeros((3, REAL_VOCAB), np.float32)), lambda: None)
    assert runners[1].stats()["compiles_after_warmup_total"] == 1


def test_the_full_sampler_sorts_no_vocabulary():
    """Top-k and top-p find their thresholds without a sort of each row (XLA's CPU sort of 16 x 49,152
    took ~150 ms a step; lax.top_k of the logits stays XLA's TopK, not a sort)."""
    import jax
    from hloserve.server.core.plan_sampling import _sample_fn
    S, V = 4, 49152
    args = (jax.ShapeDtypeStruct((S, V), np.float32), np.ones(S, bool), np.ones(S, np.float32),
            np.zeros(S, np.int32), np.ones(S, np.float32), np.zeros(S, np.float32), np.zeros(S, np.float32))
    hlo = _sample_fn(True).lower(*args).compile().as_text()
    assert " sort(" not in hlo


def test_build_engine_samples_on_the_device_when_asked(tiny_art):
    """ServeConfig's choice reaches the runner: on a CPU, off unless asked."""
    from hloserve.server.config import ServeConfig
    from hloserve.server.wiring import build_engine
    for asked, want in ((None, False), (True, True)):
        engine, _ = build_engine(tiny_art, ServeConfig(sample_on_device=asked, max_num_seqs=2, max_model_len=64,
                                                       num_blocks=16, enable_prefix_caching=False))
        assert (engine.runner.sampler is not None) == want
