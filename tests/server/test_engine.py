"""Engine loop thread with MockRunner (next token = last + 1): streams, abort, errors, metrics."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from hloserve.server.core.block_manager import BlockManager
from hloserve.server.core.engine import Engine, EngineError
from hloserve.server.core.metrics import prometheus_text
from hloserve.server.core.sampling import SamplingParams
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig
from tests.support.mock_runner import MockRunner

VOCAB = 100
GREEDY = dict(temperature=0.0)


def make_engine(num_blocks=64, block_size=4, step_delay=0.0, fail_on=None, decoder=None, **cfg):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 128,
                                         "admission_watermark": 0.0,
                                         "enable_prefix_caching": True, **cfg}), bm, seed_rng=random.Random(0))

    def hook(plan):
        if step_delay:
            time.sleep(step_delay)
        if fail_on is not None and fail_on(plan):
            raise RuntimeError("device lost")

    runner = MockRunner(VOCAB, num_blocks, block_size, on_execute=hook)
    return Engine(sched, runner, vocab_size=VOCAB, decoder=decoder)


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_step_by_hand_without_the_thread():
    eng = make_engine()
    stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), request_id="x")
    eng.run_once()   # admits and runs the prompt: token 4
    eng.run_once()   # decode: token 5
    outs = list(stream)
    assert [o.new_token_ids for o in outs] == [(4,), (5,)] and outs[-1].finish_reason == "length"


def test_drain_returns_what_is_queued_without_waiting():
    eng = make_engine()
    stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, **GREEDY), request_id="x")
    assert stream.drain() == []                      # nothing ran yet: returns at once
    eng.run_once()
    eng.run_once()
    assert [o.new_token_ids for o in stream.drain()] == [(4,), (5,)] and not stream.finished
    eng.run_once()
    last = stream.drain()
    assert [o.new_token_ids for o in last] == [(6,)] and stream.finished and stream.drain() == []


def test_sync_streams_from_the_loop_thread():
    with make_engine() as eng:
        streams = [eng.add_request([i, i + 1], SamplingParams(max_tokens=5, **GREEDY)) for i in range(0, 50, 10)]
        results = [[t for o in s for t in o.new_token_ids] for s in streams]
    assert results == [[i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(0, 50, 10)]
    m = eng.metrics()
    assert m.ttft.count == 5 and m.e2e.count == 5 and m.itl.count == 5 * 4
    assert m.finished == {"length": 5} and m.generation_tokens == 25 and m.prompt_tokens == 10
    assert m.kv_free_blocks == m.kv_total_blocks and m.num_running == 0 and m.num_waiting == 0


def test_async_streams_and_cancel_aborts_and_frees_blocks():
    eng = make_engine(step_delay=0.002).start()
    try:
        async def consume(i, got):
            stream = eng.add_request([i], SamplingParams(max_tokens=40, **GREEDY), request_id=f"r{i}")
            async for out in stream:
                got += out.new_token_ids
            return got

        async def leave_early(i):
            async with eng.add_request([i], SamplingParams(max_tokens=40, **GREEDY)) as stream:
                async for out in stream:
                    break          # the handler stops reading: leaving the block aborts

        async def main():
            got = {i: [] for i in range(6)}
            tasks = [asyncio.create_task(consume(i, got[i])) for i in range(6)]
            early = asyncio.create_task(leave_early(50))
            while len(got[1]) < 3 or len(got[3]) < 3:
                await asyncio.sleep(0.001)
            tasks[1].cancel()      # what a client disconnect does to the handler task
            tasks[3].cancel()
            await early
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        for i, r in enumerate(results):
            if i in (1, 3):
                assert isinstance(r, asyncio.CancelledError)
            else:
                assert r == [(i + k) % VOCAB for k in range(1, 41)]
        # the snapshot is taken after each step: wait for the one that saw every ending
        assert wait_until(lambda: eng.metrics().finished == {"abort": 3, "length": 4}), eng.metrics().finished
        m = eng.metrics()
        assert wait_until(lambda: eng.metrics().kv_free_blocks == m.kv_total_blocks)
    finally:
        eng.stop()


def test_abort_by_id_is_handled_at_the_next_step():
    eng = make_engine(step_delay=0.005).start()
    try:
        stream = eng.add_request([1], SamplingParams(max_tokens=100, **GREEDY), request_id="a")
        first = next(stream)
        eng.abort("a")
        rest = list(stream)
        assert first.new_token_ids == (2,) and rest[-1].finish_reason == "abort" and len(rest) < 99
        assert wait_until(lambda: eng.metrics().kv_free_blocks == eng.metrics().kv_total_blocks)
    finally:
        eng.stop()


def test_bad_requests_fail_on_the_callers_thread():
    eng = make_engine()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([5, 100], SamplingParams())
    with pytest.raises(ValueError, match="lower max_tokens to at most 126"):
        eng.add_request([1, 2], SamplingParams(max_tokens=127))


def test_runner_failure_fails_in_flight_requests_and_the_loop_survives():
    fail = threading.Event()
    fail.set()
    eng = make_engine(fail_on=lambda plan: fail.is_set()).start()
    try:
        out = list(eng.add_request([1], SamplingParams(max_tokens=3, **GREEDY)))
        assert out[-1].finish_reason == "error" and "device lost" in out[-1].error
        fail.clear()
        out = list(eng.add_request([1], SamplingParams(max_tokens=3, **GREEDY)))
        assert [t for o in out for t in o.new_token_ids] == [2, 3, 4]
        assert eng.metrics().kv_free_blocks == eng.metrics().kv_total_blocks
    finally:
        eng.stop()


def test_stop_ends_unfinished_requests_with_an_error_and_rejects_new_ones():
    eng = make_engine(step_delay=0.01).start()
    stream = eng.add_request([1], SamplingParams(max_tokens=120, **GREEDY))
    next(stream)
    eng.stop()
    last = list(stream)[-1]
    assert last.finish_reason == "error" and last.error == "the engine stopped"
    with pytest.raises(EngineError, match="stopped"):
        eng.add_request([1], SamplingParams())


def test_stop_with_requests_queued_and_running_ends_every_stream_and_frees_every_block():
    """The loop thread is held inside a step while requests pile up in its inbox; stop() then ends
    the running one, the scheduler's waiting one and every queued AddRequest with an error."""
    entered, go = threading.Event(), threading.Event()

    def hold(plan):
        entered.set()
        go.wait(timeout=60)

    eng = make_engine(max_num_seqs=1)
    eng.runner.on_execute = hold
    streams = [eng.add_request([1, 2], SamplingParams(max_tokens=50, **GREEDY)) for _ in range(2)]
    eng.start()                                           # one runs, the other waits in the scheduler
    assert entered.wait(timeout=60)                       # the first step is running: the loop is busy
    streams += [eng.add_request([3, 4, 5], SamplingParams(max_tokens=50, **GREEDY)) for _ in range(3)]
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    while True:                                           # every request accepted until stop() took effect
        try:
            streams.append(eng.add_request([6], SamplingParams(max_tokens=5, **GREEDY)))
        except EngineError:
            break
    go.set()
    stopper.join(timeout=60)
    for s in streams:
        last = list(s)[-1]                                # each stream ends (a hang would time the test out)
        assert last.finished and last.finish_reason == "error" and last.error == "the engine stopped"
    m = eng.metrics()
    assert m.kv_free_blocks == m.kv_total_blocks and m.num_running == m.num_waiting == 0
    assert m.finished == {"error": 2}                      # the two admitted; the queued ones never started


def test_prometheus_text_uses_vllm_names():
    with make_engine() as eng:
        list(eng.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2, **GREEDY)))
        list(eng.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2, **GREEDY)))
    text = prometheus_text(eng.metrics(), model_name="m")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_preemptions_total"):
        assert name in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 4' in text   # the second request hit one full block
    assert 'vllm:request_success_total{model_name="m",finished_reason="length"} 2' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 2' in text


def test_exposition_parses_and_refuses_a_family_twice():
    from prometheus_client.parser import text_string_to_metric_families

    from hloserve.server.core.metrics import Exposition, engine_families
    with make_engine() as eng:
        list(eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY)))
    exp = Exposition("m")
    engine_families(exp, eng.metrics())
    families = {f.name: f for f in text_string_to_metric_families(exp.text())}
    assert families["vllm:request_success"].samples[0].labels == {"model_name": "m", "finished_reason": "length"}
    assert families["vllm:e2e_request_latency_seconds"].type == "histogram"
    with pytest.raises(ValueError, match="exposed twice"):
        exp.gauge("vllm:num_requests_running", "again", 0)


class CharDecoder:
    """Token i is the letter chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_cuts_text_holds_back_partial_matches_and_frees_blocks():
    eng = make_engine(decoder=CharDecoder())
    a = eng.add_request([0, 1, 2], SamplingParams(max_tokens=10, stop=["ef"], **GREEDY))   # "abc" -> d e f
    b = eng.add_request([0], SamplingParams(max_tokens=4, stop=["zz"], **GREEDY))          # never matches
    for _ in range(10):
        eng.run_once()
    outs_a, outs_b = list(a.drain()), list(b.drain())
    assert tokens(outs_a) == [3, 4, 5]                        # the scheduler stopped it at "f", not max_tokens
    assert [o.new_text for o in outs_a] == ["", "d", ""]      # one char held back while it may start "ef"
    assert outs_a[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs_b) == "bcde" and outs_b[-1].finish_reason == "length"
    assert not eng.scheduler.has_unfinished()
    assert eng.scheduler.blocks.num_free_blocks == eng.scheduler.blocks.total_blocks


def test_stop_strings_need_a_decoder():
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        make_engine().add_request([1], SamplingParams(stop=["x"]))


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


class _Grammar:
    """A matcher over MockRunner's vocabulary (the interface of server/text/grammar.Matcher): it allows
    only the token 50 + (tokens accepted), for 3 tokens, then is done."""

    def __init__(self):
        self.accepted = []

    def allowed(self):
        import numpy as np
        mask = np.zeros(VOCAB, bool)
        mask[50 + len(self.accepted)] = True
        return mask

    def accept(self, token):
        self.accepted.append(token)

    @property
    def done(self):
        return len(self.accepted) == 3


class _Grammars:
    """Compiles every spec to a _Grammar (MockRunner has no tokenizer for llguidance)."""

    def __init__(self):
        self.made = []

    def matcher(self, spec):
        self.made.append(_Grammar())
        return self.made[-1]

    def prepare(self):
        return None


def test_grammar_masks_reach_the_sampler_and_a_complete_grammar_stops_and_frees():
    """Masks are filled between schedule() and execute() for the rows that sample, tokens are accepted
    after update(), and the grammar's completion finishes the request through the one release path."""
    from hloserve.server.text.grammar import GrammarSpec
    plain = make_engine()
    grammars = _Grammars()
    eng = Engine(plain.scheduler, plain.runner, vocab_size=VOCAB, grammars=grammars)
    stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=10, structured=GrammarSpec("json"), **GREEDY))
    free = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))
    for _ in range(5):
        eng.run_once()
    outs = stream.drain()
    assert tokens(outs) == [50, 51, 52] and grammars.made[0].accepted == [50, 51, 52]
    assert outs[-1].finish_reason == "stop" and stream.finished
    assert tokens(free.drain()) == [4, 5, 6]                          # its row is not masked
    assert not eng.scheduler.has_unfinished()
    assert eng.scheduler.blocks.num_free_blocks == eng.scheduler.blocks.total_blocks
