"""Async scheduling (core/engine.py `Engine._step_ahead`): step N+1 planned while step N runs.

Every case runs the same requests through a serial engine and an async one, driven by hand turn by
turn (the same turns, the same aborts), and compares what each stream received: tokens, text, finish
reasons. First over MockRunner (fast; its cache holds token ids, so a placeholder that reached a step
would show), then over the real runner on a tiny exported Llama, greedy and seeded sampling, where
a preemption happens under a small KV cache, and the step metrics keep their meaning.
"""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from hloserve.server.core.block_manager import BlockManager
from hloserve.server.core.engine import Engine
from hloserve.server.core.sampling import SamplingParams
from hloserve.server.core.request import PLACEHOLDER
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig
from tests.support.mock_runner import MockRunner

VOCAB = 100


class CharDecoder:
    """Token t is the character chr(ord('a') + t % 26) (the Decoder interface, for stop strings)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def mock_engine(async_scheduling: bool, *, num_blocks=64, max_num_seqs=8, decoder=None, speculative=None,
                on_execute=None) -> Engine:
    block_size = 4
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32, max_model_len=64,
                                      admission_watermark=0.0, enable_prefix_caching=True, speculative=speculative),
                      BlockManager(num_blocks, block_size), eos_token_ids=[99], seed_rng=random.Random(0))

    def no_placeholder(plan):
        assert all(PLACEHOLDER not in s.token_ids for s in plan.seqs), plan
        if on_execute is not None:
            on_execute(plan)

    runner = MockRunner(VOCAB, num_blocks, block_size, on_execute=no_placeholder)
    return Engine(sched, runner, vocab_size=VOCAB, decoder=decoder, async_scheduling=async_scheduling)


def drive(eng: Engine, requests, *, abort_after: dict[str, int] | None = None, turns=400):
    """Run `requests` ((id, prompt, params)) turn by turn; abort a request once it has received
    `abort_after[id]` tokens. Returns id -> (tokens, text, finish reason), after checking that every
    block is free again."""
    abort_after = abort_after or {}
    streams = {rid: eng.add_request(prompt, params, request_id=rid) for rid, prompt, params in requests}
    got = {rid: ([], [], None) for rid in streams}
    for _ in range(turns):
        if all(s.finished for s in streams.values()):
            break
        eng.run_once()
        for rid, stream in streams.items():
            for out in stream.drain():
                got[rid][0].extend(out.new_token_ids)
                got[rid][1].append(out.new_text)
                got[rid] = (got[rid][0], got[rid][1], out.finish_reason)
            if rid in abort_after and len(got[rid][0]) >= abort_after[rid]:
                del abort_after[rid]
                eng.abort(rid)
    assert all(s.finished for s in streams.values())
    for _ in range(3):      # a step still in flight for a finished request ends without output
        eng.run_once()
    assert not eng.scheduler.has_unfinished() and eng._in_flight is None
    assert eng.scheduler.blocks.num_free_blocks == eng.scheduler.blocks.total_blocks
    return {rid: (tuple(t), "".join(x), str(r)) for rid, (t, x, r) in got.items()}


def both(requests, **kw):
    """The serial engine's results and the async one's (each engine made by `kw`)."""
    abort = kw.pop("abort_after", None)
    serial = drive(mock_engine(False, **kw), requests, abort_after=dict(abort or {}))
    ahead = drive(mock_engine(True, **kw), requests, abort_after=dict(abort or {}))
    return serial, ahead


def test_mock_mixed_lengths_stop_tokens_stop_strings_and_an_abort_match_the_serial_engine():
    g = dict(temperature=0.0)
    requests = [("len3", [1, 2], SamplingParams(max_tokens=3, **g)),
                ("len9", [10], SamplingParams(max_tokens=9, **g)),
                ("eos", [95], SamplingParams(max_tokens=20, **g)),                 # 96 97 98 99=EOS
                ("stopid", [40], SamplingParams(max_tokens=20, stop_token_ids=[44], **g)),
                ("stopstr", [0, 1, 2], SamplingParams(max_tokens=20, stop=["fg"], **g)),
                ("abort", [60], SamplingParams(max_tokens=30, **g)),
                ("long", [3] * 30, SamplingParams(max_tokens=12, **g))]           # a chunked prompt
    serial, ahead = both(requests, abort_after={"abort": 4}, decoder=CharDecoder())
    assert ahead == serial
    assert serial["eos"][0] == (96, 97, 98, 99) and serial["eos"][2] == "stop"
    assert serial["stopid"][0][-1] == 44 and serial["stopstr"][1].endswith("e") and serial["stopstr"][2] == "stop"
    assert serial["abort"][2] == "abort" and len(serial["abort"][0]) == 4
    assert serial["len9"][2] == "length" and len(serial["len9"][0]) == 9


def test_mock_preemption_under_a_small_cache_matches_the_serial_engine():
    requests = [(f"r{i}", [i * 7 % 50 + 1] * 9, SamplingParams(max_tokens=14 + i, temperature=0.0))
                for i in range(6)]
    eng = mock_engine(True, num_blocks=16)
    ahead = drive(eng, requests)
    assert eng.scheduler.stats.num_preemptions > 0
    assert ahead == drive(mock_engine(False, num_blocks=16), requests)


def test_mock_async_turns_overlap_and_a_grammar_runs_serially():
    """A turn sends the next step before emitting the last one's outputs; with a live grammar the
    engine plans each step after the last one's tokens are known (no step left in flight)."""
    from hloserve.server.text.grammar import GrammarSpec

    from .test_engine import _Grammars
    eng = mock_engine(True)
    stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    eng.run_once()                                 # the prompt is sent, nothing read back yet
    assert eng._in_flight is not None and stream.drain() == []
    eng.run_once()                                 # its token read, the first decode already sent
    assert [o.new_token_ids for o in stream.drain()] == [(4,)] and eng._in_flight is not None
    plain = mock_engine(True)
    eng = Engine(plain.scheduler, plain.runner, vocab_size=VOCAB, grammars=_Grammars(), async_scheduling=True)
    stream = eng.add_request([1, 2, 3], SamplingParams(max_tokens=10, structured=GrammarSpec("json"),
                                                       temperature=0.0))
    for _ in range(3):
        eng.run_once()
        assert eng._in_flight is None
    assert [t for o in stream.drain() for t in o.new_token_ids] == [50, 51, 52] and stream.finished


def test_mock_speculative_decoding_runs_serially_with_the_same_tokens():
    """With a proposer every step is planned after the last one's tokens are known (a draft reads
    them): nothing stays in flight between turns, and the drafts are verified as in the serial loop."""
    from hloserve.server.core.spec_decode import SpeculativeConfig
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    requests = [(f"r{i}", [5, 6, 7, 5, 6], SamplingParams(max_tokens=10 + i, temperature=0.0)) for i in range(3)]
    eng = mock_engine(True, speculative=spec)
    eng.add_request([1, 2], SamplingParams(max_tokens=2, temperature=0.0))
    eng.run_once()
    assert eng._in_flight is None
    serial, ahead = both(requests, speculative=spec)
    assert ahead == serial and serial["r0"][0][:4] == (7, 8, 9, 10)


def test_mock_loop_thread_streams_and_aborts_with_async_scheduling():
    """The loop thread in the async mode: every stream complete, an abort by id ends its stream, all
    blocks free afterwards."""
    import threading
    aborted = threading.Event()

    def hold_gone(plan):      # "gone" runs its third step only once the abort is sent: it cannot end by length first
        if any(s.request_id == "gone" and s.start >= 3 for s in plan.seqs):
            assert aborted.wait(30)

    eng = mock_engine(True, on_execute=hold_gone).start()
    try:
        streams = [eng.add_request([i, i + 1], SamplingParams(max_tokens=5 + i, temperature=0.0)) for i in range(5)]
        gone = eng.add_request([70], SamplingParams(max_tokens=25, temperature=0.0), request_id="gone")
        first = next(gone)
        eng.abort("gone")
        aborted.set()
        rest = list(gone)
        got = [[t for o in s for t in o.new_token_ids] for s in streams]
    finally:
        eng.stop()
    assert got == [list(range(i + 2, i + 7 + i)) for i in range(5)]
    assert first.new_token_ids == (71,) and rest[-1].finish_reason == "abort"
    assert eng.metrics().kv_free_blocks == eng.metrics().kv_total_blocks


class TimedRunner(MockRunner):
    """MockRunner whose step "runs on a device" for `seconds` from its dispatch: collect waits until
    then (the host is free meanwhile), as a jax step's logits would."""

    def __init__(self, *a, seconds: float, **k):
        super().__init__(*a, **k)
        self.seconds = seconds

    def dispatch(self, plan):
        return MockRunner.dispatch(self, plan), time.perf_counter() + self.seconds

    def collect(self, pending):
        out, done = pending
        time.sleep(max(0.0, done - time.perf_counter()))
        return dataclasses.replace(out, ready_at=time.perf_counter())

    def execute(self, plan):
        t = time.perf_counter()
        out = self.collect(self.dispatch(plan))
        return dataclasses.replace(out, device_seconds=time.perf_counter() - t)


class SlowDecoder(CharDecoder):
    """Detokenizing costs `seconds` a call: host work of the engine's own, after each step."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def decode(self, ids, skip_special_tokens=True):
        time.sleep(self.seconds)
        return super().decode(ids, skip_special_tokens)


def test_step_metrics_split_host_and_device_in_both_modes():
    """hloserve:step_device_seconds is a step's dispatch to its logits on the host, step_host_seconds the
    engine's work the device waits for. Detokenizing (10 ms an output here) is host work the serial
    loop pays between steps; the async loop does it while the next step runs, so it leaves its host time."""
    hosts = {}
    for mode in (False, True):
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                                          admission_watermark=0.0, enable_prefix_caching=True),
                          BlockManager(64, 4), seed_rng=random.Random(0))
        runner = TimedRunner(VOCAB, 64, 4, seconds=0.03)
        eng = Engine(sched, runner, vocab_size=VOCAB, decoder=SlowDecoder(0.01), async_scheduling=mode)
        drive(eng, [("a", [1, 2], SamplingParams(max_tokens=8, temperature=0.0))])
        m = eng.metrics()
        assert m.step_device.count == m.step_host.count == runner.steps == 8   # one per step the model ran
        assert m.step_device.sum >= 8 * 0.03                                  # each step's device time
        hosts[mode] = m.step_host.sum
    assert hosts[False] >= 7 * 0.01          # serial: each output's detokenizing before the next step
    assert hosts[True] < hosts[False]        # async: the detokenizing hidden behind the next step


# -- the real runner: a tiny exported Llama ----------------------------------------------------------
REAL_VOCAB = 256


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The step of a tiny random-init Llama (block 8) with 14 blocks: six requests preempt each other."""
    from hloserve.server.core.model_runner import ModelRunner
    from hloserve.server.core.step_shapes import RunnerConfig
    from tests.support.tiny_llama import tiny_llama
    _, art = tiny_llama(str(tmp_path_factory.mktemp("tiny-llm")), heads=4, kv_heads=2, max_position=256,
                        block_size=8, max_context=128)
    cfg = RunnerConfig(token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(16,), num_blocks=14,
                       kv_cache_bytes=0)
    r = ModelRunner.from_artifact(art, cfg, platform="cpu", strict=True)
    r.warmup()
    return r


def real_engine(runner, async_scheduling: bool) -> Engine:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                      admission_watermark=0.0, enable_prefix_caching=True),
                      BlockManager(runner.num_blocks, runner.block_size), eos_token_ids=[2],
                      seed_rng=random.Random(0))
    return Engine(sched, runner, vocab_size=REAL_VOCAB, async_scheduling=async_scheduling)


def test_real_runner_greedy_and_seeded_requests_match_the_serial_engine_through_preemption(runner):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, REAL_VOCAB) for _ in range(n)] for n in (5, 21, 9, 30, 14, 17)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = [("g0", prompts[0], SamplingParams(max_tokens=6, **greedy)),
                ("g1", prompts[1], SamplingParams(max_tokens=20, **greedy)),
                ("s2", prompts[2], SamplingParams(max_tokens=18, temperature=1.0, top_p=0.9, seed=11)),
                ("s3", prompts[3], SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=5, ignore_eos=True)),
                ("ab", prompts[4], SamplingParams(max_tokens=24, **greedy)),
                ("g5", prompts[5], SamplingParams(max_tokens=16, **greedy))]
    serial = real_engine(runner, False)
    want = drive(serial, requests, abort_after={"ab": 3})
    ahead = real_engine(runner, True)
    got = drive(ahead, requests, abort_after={"ab": 3})
    assert got == want
    assert want["ab"][2] == "abort" and len(want["ab"][0]) == 3 and len(want["g1"][0]) == 20
    for eng in (serial, ahead):
        assert eng.scheduler.stats.num_preemptions > 0
    # a stop token: the greedy request's 5th token ends a copy of it there, in both modes
    stop = want["g1"][0][4]
    again = [("stop", prompts[1], SamplingParams(max_tokens=20, stop_token_ids=[stop], **greedy))]
    first = want["g1"][0].index(stop) + 1
    for mode in (False, True):
        assert drive(real_engine(runner, mode), again)["stop"] == (want["g1"][0][:first], "", "stop")
    assert runner.stats()["compiles_after_warmup_total"] == 0


def test_the_flag_and_its_default_per_platform():
    """--async-scheduling / --no-async-scheduling reach ServeConfig as vLLM names them; without either,
    on for GPU and TPU, off on the CPU (docs/performance.md "Async scheduling")."""
    from hloserve.server.cli import build_parser
    from hloserve.server.config import ServeConfig
    parse = build_parser("serve").parse_args
    assert parse(["serve", "--async-scheduling"]).async_scheduling is True
    assert parse(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert parse(["serve"]).async_scheduling is None
    default = ServeConfig()
    assert [default.async_scheduling_on(p) for p in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert ServeConfig(async_scheduling=True).async_scheduling_on("cpu")
    assert not ServeConfig(async_scheduling=False).async_scheduling_on("gpu")


@pytest.mark.slow
def test_served_with_async_scheduling_equal_to_transformers_with_stop_strings(tiny_chat_llm):
    """`hloserve serve --async-scheduling` on loopback, the openai client: concurrent greedy requests of
    different lengths answer transformers' greedy text, and a stop string taken from one of them ends
    its answer there ("stop") beside them."""
    import concurrent.futures

    import openai

    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    from .servers import hf_greedy, running_server
    hf, art = tiny_chat_llm
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    prompts = [f"Note {i}: the robot painted the sea" for i in range(4)]
    lengths = [5, 12, 20, 9]
    want = [tok.decode(hf_greedy(hf, tok.encode(p), n)) for p, n in zip(prompts, lengths)]
    stop = want[2][len(want[2]) // 2:][:3]          # three characters from the middle of the longest answer
    assert stop.strip(), want[2]
    with running_server(art, "--async-scheduling", "--max-num-seqs", "4", "--max-model-len", "128",
                        "--served-model-name", "m") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def one(i, **extra):
            r = client.completions.create(model="m", prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                          extra_body={"ignore_eos": True}, **extra)
            return r.choices[0].text, r.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            stopping = pool.submit(one, 2, stop=[stop])
            plain = list(pool.map(one, range(4)))
            stopped = stopping.result()
    assert plain == [(w, "length") for w in want]
    assert stopped == (want[2][:want[2].index(stop)], "stop")
