"""Speculative decoding (n-gram prompt lookup): the flag's config, the proposer, the acceptance's
distribution (statistically, on the sampler function), and the scheduler/engine with MockRunner
(next token = last + 1, so a prompt that counts makes every draft right, and outputs are known by
hand). The real model: tests/server/test_model_runner.py (greedy tokens equal transformers' with
speculation) and tests/server/test_serve_spec.py (the default model through the server)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from hloserve.runtime.artifact.errors import HloserveError
from hloserve.server.core.block_manager import BlockManager
from hloserve.server.core.metrics import prometheus_text
from hloserve.server.core.sampling import SamplingParams, sample_row, verify_draft
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig
from hloserve.server.core.spec_decode import DraftLength, NgramProposer, SpeculativeConfig
from tests.support.mock_runner import MockRunner

VOCAB = 100
COUNTING = list(range(10, 30)) + list(range(10, 16))   # ends "13 14 15", seen before: drafts 16, 17, ...


# -- the flag ----------------------------------------------------------------------------------
def test_config_follows_vllms_defaults():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)          # neither given: vLLM's 5 and 5
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (4, 4, 3)
    c = SpeculativeConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
                                    '"prompt_lookup_max": 3, "disable_by_batch_size": 8}')
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == ("ngram", 2, 3, 8)


@pytest.mark.parametrize("text,fragment", [
    ("{method: ngram}", "is not JSON"),
    ("[4]", "is a JSON list"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "a draft model is named by \"model\""),
    ('{"model": "/art", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "the draft_model method's fields"),
    ('{"model": "/art"}', "no 'num_speculative_tokens'"),
    ('{"num_speculative_tokens": 2}', "no 'method'"),
    ('{"method": "ngram"}', "no 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 3}', "unknown field(s) 'prompt_lookup'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens='4'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
])
def test_a_bad_speculative_config_is_one_line_from_the_cli(text, fragment, capsys, tmp_path):
    """Parsed at the edge, before any artifact is read: one line naming the field and the fix, exit 1."""
    from hloserve.server.cli import main
    assert main(["serve", str(tmp_path / "not-read"), "--speculative-config", text]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hloserve: error: ") and fragment in err, err


def test_a_draft_model_is_vllms_model_field():
    c = SpeculativeConfig.from_json('{"model": "/art/draft", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/art/draft", 3)
    c = SpeculativeConfig.from_json('{"method": "draft_model", "model": "smollm2-135m-instruct", '
                                    '"num_speculative_tokens": 2, "disable_by_batch_size": 8}')
    assert (c.method, c.model, c.disable_by_batch_size) == ("draft_model", "smollm2-135m-instruct", 8)


def test_resolve_clamps_the_draft_to_the_steps_rows():
    from hloserve.server.config import ServeConfig

    class Spec:   # the LLMSpec fields resolve reads
        max_tokens, max_seqs, max_context, block_size = 256, 16, 2048, 16
    spec = SpeculativeConfig(num_speculative_tokens=20, prompt_lookup_max=3, prompt_lookup_min=2)
    sched, _, notes = ServeConfig(max_num_seqs=8, speculative_config=spec).resolve(Spec())
    assert sched.speculative.num_speculative_tokens == 7 and "num_speculative_tokens 20 -> 7" in notes[0]
    with pytest.raises(HloserveError, match="raise --max-num-seqs"):
        ServeConfig(max_num_seqs=1, speculative_config=spec).resolve(Spec())


# -- the proposer --------------------------------------------------------------------------------
def test_ngram_proposer_longest_match_at_its_earliest_place():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3))
    assert prop.propose([1, 2, 3, 4, 2, 3], 4) == (4, 2, 3)         # vLLM's docstring example: [2, 3] matches
    assert prop.propose([1, 2, 3, 4, 2, 3], 2) == (4, 2)
    assert prop.propose([7, 2, 3, 9, 1, 2, 3, 5, 1, 2, 3], 2) == (5, 1)   # [1, 2, 3] beats the earlier [2, 3]
    assert prop.propose([2, 3, 8, 2, 3, 9, 2, 3], 1) == (8,)        # earliest of two [2, 3]
    assert prop.propose([1, 2, 3, 4, 5, 6], 4) == ()                 # nothing repeats
    assert prop.propose([5, 3], 4) == () and prop.propose([], 4) == ()
    assert prop.propose([4, 4, 4], 3) == (4,)                        # overlapping: [4, 4] at 0, one token after it


# -- the acceptance's distribution ---------------------------------------------------------------
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
CHI2_999 = {4: 18.47, 5: 20.52}   # 99.9% quantiles of chi-square with 4 and 5 degrees of freedom


def chi2(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


@pytest.mark.parametrize("draft", [0, 3])   # a likely and an unlikely proposed token
def test_rejection_sampling_accepts_with_p_and_resamples_from_p_without_the_draft(draft):
    """20,000 seeded verifications of a one-token draft t: accepted in a fraction p(t) of them (within
    4 standard deviations of the binomial, sqrt(p(1-p)/n) = 0.0035 at p = 0.4); when rejected, the
    token is distributed as p with t removed and renormalized (chi-square, 4 degrees of freedom, below
    its 99.9% quantile). Deterministic (fixed seeds): it fails only on a real bias."""
    x = np.log(PROBS).astype(np.float32)
    rows = np.stack([x, x])
    n = 20000
    params = SamplingParams(temperature=1.0)
    outs = [verify_draft(rows, [draft], params, seed=s, index=0)[0] for s in range(n)]
    accepted = np.array([len(o) == 2 for o in outs])
    p = PROBS[draft]
    assert abs(accepted.mean() - p) < 4 * np.sqrt(p * (1 - p) / n), accepted.mean()
    for o in outs:
        assert (o[0] == draft) == (len(o) == 2)              # one token when rejected, two when accepted
    rejected = np.array([o[0] for o in outs if len(o) == 1])
    others = np.delete(np.arange(6), draft)
    counts = np.bincount(rejected, minlength=6)[others]
    assert chi2(counts, PROBS[others] / PROBS[others].sum()) < CHI2_999[4], counts
    # the token after an accepted draft is drawn from the next position's distribution
    bonus = np.bincount([o[1] for o in outs if len(o) == 2], minlength=6)
    assert chi2(bonus, PROBS) < CHI2_999[5], bonus


def test_each_position_keeps_the_target_distribution():
    """A two-token draft over two different distributions: the first token returned is distributed as
    p1, and the second (returned when the first draft token was accepted) as p2."""
    p1, p2 = PROBS, PROBS[::-1].copy()
    rows = np.log(np.stack([p1, p2, p1])).astype(np.float32)
    n = 20000
    outs = [verify_draft(rows, [1, 4], SamplingParams(temperature=1.0), seed=s, index=0)[0] for s in range(n)]
    assert chi2(np.bincount([o[0] for o in outs], minlength=6), p1) < CHI2_999[5]
    assert chi2(np.bincount([o[1] for o in outs if len(o) > 1], minlength=6), p2) < CHI2_999[5]


def test_verification_draws_what_the_request_draws_without_speculation():
    """Greedy: the argmax tokens. Seeded sampling: position j is the request's draw index + j, so the
    tokens are those of plain sampling, with or without a draft, and the logprobs are per token."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4, 50)).astype(np.float32) * 3
    greedy = SamplingParams(temperature=0, logprobs=2)
    argmax = [int(np.argmax(r)) for r in rows]
    toks, lps = verify_draft(rows, argmax[:3], greedy, seed=0, index=0)
    assert toks == argmax and [lp.token_id for lp in lps] == argmax and len(lps[0].top) == 2
    toks, _ = verify_draft(rows, [argmax[0], (argmax[1] + 1) % 50, 7], greedy, seed=0, index=0)
    assert toks == argmax[:2]                                  # the second draft token is wrong: stop there
    params = SamplingParams(temperature=0.8, top_p=0.9)
    plain = [sample_row(rows[j], params, seed=9, index=5 + j)[0] for j in range(4)]
    toks, _ = verify_draft(rows, plain[:3], params, seed=9, index=5)
    assert toks == plain


# -- the step's rows ---------------------------------------------------------------------------
def test_a_verified_draft_takes_a_row_per_token():
    """Each token of the draft runs as a decode's token runs: a row of its own over the request's
    block table, attending up to its own position; the plan's rows in order."""
    from hloserve.server.core.step_shapes import RunnerConfig, build_step
    from hloserve.server.core.outputs import ScheduledSeq, SchedulerPlan
    cfg = RunnerConfig(token_buckets=(16,), seq_buckets=(8,), block_buckets=(4,), num_blocks=None, kv_cache_bytes=0)
    g = dict(needs_logits=True, sampling=SamplingParams(temperature=0), seed=0, sample_index=0)
    plan = SchedulerPlan.of((ScheduledSeq(request_id="a", token_ids=(9,), start=2, block_table=(2,), **g),
                             ScheduledSeq(request_id="b", token_ids=(5, 6, 7), start=6, block_table=(1, 3, 5),
                                          draft_token_ids=(6, 7), **g)))
    assert plan.num_rows == 4
    step = build_step(plan, cfg, 4)
    x = step.inputs
    assert step.function == "decode" and step.num_seqs == 4                  # T = S: a decode-shaped call
    assert x["tokens"].tolist()[:4] == [9, 5, 6, 7] and x["seq_ids"].tolist()[:4] == [0, 1, 2, 3]
    assert x["positions"].tolist()[:4] == [2, 6, 7, 8] and x["context_lens"].tolist()[:4] == [3, 7, 8, 9]
    assert x["slot_mapping"].tolist()[:4] == [10, 14, 15, 20] and x["block_tables"][1:4, :3].tolist() == [[1, 3, 5]] * 3


# -- scheduler and engine with MockRunner -------------------------------------------------------
def make(spec: SpeculativeConfig | None, *, max_num_seqs=4, budget=32, num_blocks=64, block_size=4, eos=(),
         proposer=None, **kw):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=128,
                                      admission_watermark=0.0, enable_prefix_caching=True, speculative=spec),
                      BlockManager(num_blocks, block_size), eos_token_ids=eos, seed_rng=random.Random(0),
                      proposer=proposer)
    return sched, MockRunner(VOCAB, num_blocks, block_size, **kw)


NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)


def run(sched, runner, requests):
    """Add (id, prompt, params) requests and step until idle (test_scheduler.run: the plans' shapes and
    the block invariants checked each step): {id: [outputs]}; every block is free again."""
    from tests.server.test_scheduler import run as run_all
    for rid, prompt, params in requests:
        sched.add_request(rid, prompt, params)
    outs = run_all(sched, runner, max_steps=300)
    assert sched.blocks.num_free_blocks == sched.blocks.total_blocks
    return outs


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_drafts_are_verified_in_one_step_and_give_the_same_tokens():
    greedy = SamplingParams(temperature=0, max_tokens=12)
    reqs = [("a", COUNTING, greedy), ("b", [3, 4, 5, 6, 3, 4], greedy)]
    plain_sched, plain_runner = make(None, max_num_seqs=8)
    plain = run(plain_sched, plain_runner, reqs)
    sched, runner = make(NGRAM, max_num_seqs=8)
    spec = run(sched, runner, reqs)
    assert tokens(spec["a"]) == tokens(plain["a"]) == list(range(16, 28))
    assert tokens(spec["b"]) == tokens(plain["b"]) == list(range(5, 17))
    assert [len(o.new_token_ids) for o in spec["a"]] == [1, 5, 5, 1]   # 4 drafts accepted + 1 drawn, twice
    # the older request drafts first: "a" 4 tokens (rows 2 + 4), "b" the 2 rows left: after its first
    # token "3 4 5" proposes 6 3: 6 accepted, then 7 drawn; after "5 6 7" nothing repeats
    assert [len(o.new_token_ids) for o in spec["b"]] == [1, 2] + [1] * 9
    assert spec["a"][-1].num_output_tokens == 12 and spec["a"][-1].finish_reason == "length"
    s = sched.stats.spec
    assert s.num_drafts >= 2 and s.num_accepted_tokens >= 8 and s.accepted_per_pos[0] >= 2
    assert sched.stats.generation_tokens == plain_sched.stats.generation_tokens == 24


def test_rejected_drafts_rewind_and_their_slots_are_written_again():
    """The prompt "7 8 20 7" makes the model draw 8; then "7 8" seen earlier proposes 20 7 8, but the
    model counts on (9): the draft is rejected, the request's computed length rewinds, and later
    steps write those slots again (the mock reads every token back from its cache, so a stale slot
    would change the tokens)."""
    greedy = SamplingParams(temperature=0, max_tokens=6)
    sched, runner = make(NGRAM)
    outs = run(sched, runner, [("b", [7, 8, 20, 7], greedy)])
    assert tokens(outs["b"]) == [8, 9, 10, 11, 12, 13]
    assert runner.plans[1].seqs[0].token_ids == (8, 20, 7, 8)
    assert runner.contexts["b"] == [7, 8, 20, 7, 8, 9, 10, 11, 12]
    s = sched.stats.spec
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 3, 0)


def test_max_tokens_eos_and_logprobs_with_several_tokens_a_step():
    """Never past max_tokens (the draft is sized to it), EOS inside an accepted draft ends the request
    there, and each token has its logprobs entry."""
    sched, runner = make(NGRAM, eos=(19,))
    outs = run(sched, runner, [("len", COUNTING, SamplingParams(temperature=0, max_tokens=3, logprobs=1)),
                               ("eos", COUNTING, SamplingParams(temperature=0, max_tokens=50))])
    assert tokens(outs["len"]) == [16, 17, 18] and outs["len"][-1].finish_reason == "length"
    assert [lp.token_id for o in outs["len"] for lp in o.logprobs] == [16, 17, 18]
    assert tokens(outs["eos"]) == [16, 17, 18, 19] and outs["eos"][-1].finish_reason == "stop"
    assert outs["eos"][-1].num_output_tokens == 4


def test_a_stop_string_inside_a_multi_token_step_drops_the_tokens_after_it():
    from tests.server.test_engine import CharDecoder, make_engine
    eng = make_engine(decoder=CharDecoder(), speculative=NGRAM)
    s = eng.add_request(COUNTING, SamplingParams(temperature=0, max_tokens=20, stop=["st"]))  # 16, 17, ... = q, r, s, t
    for _ in range(10):
        eng.run_once()
    outs = list(s.drain())
    assert max(len(o.new_token_ids) for o in outs) > 1                 # several tokens came in one step
    assert tokens(outs) == [16, 17, 18, 19] and "".join(o.new_text for o in outs) == "qr"
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == 4
    m = eng.metrics()
    assert m.kv_free_blocks == m.kv_total_blocks
    text = prometheus_text(m)
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f"{name}{{" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="model",position="3"}' in text


class SkewedDraft(MockRunner):
    """A draft model that counts on as the target does, except that it guesses t + 2 after every t
    divisible by 5: its proposals are accepted up to there, the target's token replaces the guess."""

    def execute(self, plan):
        out = super().execute(plan)
        for rid, toks in out.sampled.items():
            out.sampled[rid] = tuple(t + 1 if (t - 1) % 5 == 0 else t for t in toks)
        return out


def make_draft(draft_runner, max_rows=1, **kw):
    from hloserve.server.core.draft_model import DraftModelProposer
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)
    proposer = DraftModelProposer(draft_runner, max_chunk=8, max_rows=max_rows)
    return *make(spec, proposer=proposer, **kw), proposer


@pytest.mark.parametrize("draft", [MockRunner, SkewedDraft])
def test_a_draft_model_proposes_through_the_targets_block_tables(draft):
    """A draft model (a second MockRunner with its own cache, as many blocks, the target's tables):
    greedy tokens equal the plain run's; a right draft is accepted whole, a skewed one up to its miss
    (its cache then catches up on the tokens the target kept, read back through the block tables: a
    stale or misplaced slot would change its next proposal); blocks all free at the end."""
    greedy = SamplingParams(temperature=0, max_tokens=20)
    reqs = [("a", list(range(10, 32)), greedy), ("b", [3, 4, 5], greedy)]   # "a" catches up in 3 chunks of <= 8
    plain = run(*make(None, max_num_seqs=8), reqs)
    draft_runner = draft(VOCAB, 64, 4)
    sched, runner, proposer = make_draft(draft_runner, max_num_seqs=8)
    spec = run(sched, runner, reqs)
    assert {k: tokens(v) for k, v in spec.items()} == {k: tokens(v) for k, v in plain.items()}
    s = sched.stats.spec
    assert s.num_drafts > 0 and max(len(p.seqs[0].token_ids) for p in draft_runner.plans) == 8
    if draft is MockRunner:
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert max(len(o.new_token_ids) for o in spec["a"]) == 5
    else:
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert not proposer._states                                       # forgotten as each request finished


@pytest.mark.parametrize("draft", [MockRunner, SkewedDraft])
def test_a_draft_model_proposes_for_a_steps_requests_in_shared_calls(draft):
    """Three requests proposing together with a draft runner of 4 rows: the same greedy tokens as the
    plain run and as one request a call, in fewer draft calls; the calls mix catch-up chunks (up to
    max_chunk tokens in all) and one-token rows of several requests."""
    greedy = SamplingParams(temperature=0, max_tokens=20)
    reqs = [("a", list(range(10, 32)), greedy), ("b", [3, 4, 5], greedy), ("c", list(range(40, 52)), greedy)]
    plain = {k: tokens(v) for k, v in run(*make(None, max_num_seqs=16), reqs).items()}
    calls = {}
    for rows in (1, 4):
        draft_runner = draft(VOCAB, 96, 4)
        sched, runner, proposer = make_draft(draft_runner, max_rows=rows, max_num_seqs=16, num_blocks=96)
        assert {k: tokens(v) for k, v in run(sched, runner, reqs).items()} == plain, rows
        assert sched.stats.spec.num_drafts > 0 and not proposer._states
        plans = draft_runner.plans
        assert max(len(p.seqs) for p in plans) == min(rows, 3) and max(p.num_tokens for p in plans) <= 8
        calls[rows] = len(plans)
    assert 2 * calls[4] <= calls[1], calls                             # 48 -> 24 calls when written
    assert any(len(p.seqs) > 1 and p.num_tokens > len(p.seqs) for p in plans)     # catch-ups shared a call


def test_seeded_sampling_with_a_draft_model_draws_the_same_tokens():
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(3)]
    reqs = [(f"r{i}", COUNTING, p) for i, p in enumerate(params)]
    plain = run(*make(None, max_num_seqs=8, peak=3.0), reqs)
    sched, runner, _ = make_draft(MockRunner(VOCAB, 64, 4), max_num_seqs=8, peak=3.0)
    spec = run(sched, runner, reqs)
    assert {k: tokens(v) for k, v in spec.items()} == {k: tokens(v) for k, v in plain.items()}
    assert sched.stats.spec.num_accepted_tokens > 0


def test_large_batches_do_not_speculate_and_drafts_fit_the_rows():
    greedy = SamplingParams(temperature=0, max_tokens=8)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3,
                             disable_by_batch_size=2)
    sched, runner = make(spec, max_num_seqs=8)
    run(sched, runner, [(f"r{i}", COUNTING, greedy) for i in range(3)])
    # all three were admitted together and ran to the end together: more than 2 running, no drafts
    assert sched.stats.spec.num_drafts == 0 and not any(s.draft_token_ids for p in runner.plans for s in p.seqs)
    sched, runner = make(NGRAM, max_num_seqs=6)
    outs = run(sched, runner, [(f"r{i}", COUNTING, greedy) for i in range(3)])
    assert all(tokens(o) == list(range(16, 24)) for o in outs.values())
    drafted = [sum(len(s.draft_token_ids) for s in p.seqs) for p in runner.plans if len(p.seqs) == 3]
    assert max(drafted) == 3                                            # 6 rows - 3 sequences


def test_seeded_sampling_draws_the_same_tokens_with_and_without_speculation():
    """A flat-ish mock distribution (peak 3): the draws vary, and each position's draw is the one the
    request makes without speculation, so the tokens are equal."""
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(4)]
    reqs = [(f"r{i}", COUNTING, p) for i, p in enumerate(params)]
    plain_sched, plain_runner = make(None, max_num_seqs=8, peak=3.0)
    plain = run(plain_sched, plain_runner, reqs)
    sched, runner = make(NGRAM, max_num_seqs=8, peak=3.0)
    spec = run(sched, runner, reqs)
    assert {k: tokens(v) for k, v in spec.items()} == {k: tokens(v) for k, v in plain.items()}
    assert sched.stats.spec.num_drafts > 0


def test_requests_whose_positions_depend_on_each_other_do_not_speculate():
    sched, runner = make(NGRAM)
    run(sched, runner, [("pen", COUNTING, SamplingParams(temperature=0, max_tokens=6, presence_penalty=0.5)),
                        ("min", COUNTING, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))])
    assert sched.stats.spec.num_drafts == 0


def test_draft_length_adapts_to_each_requests_acceptance():
    d = DraftLength(4)
    assert d.take() == 4
    d.observe(4, 2, 4)
    assert d.take() == 3                       # accepted in part: the accepted tokens + 1
    d.observe(3, 3, 4)
    assert d.take() == 4                       # accepted whole: doubled, up to K
    d.observe(4, 0, 4)                         # rejected outright: half as long, after waiting 2 steps
    assert [d.take() for _ in range(3)] == [0, 0, 2]
    d.observe(2, 0, 4)
    assert [d.take() for _ in range(5)] == [0, 0, 0, 0, 1]
    d.observe(1, 1, 4)
    assert d.take() == 2 and d.misses == 0


def test_proposals_that_keep_missing_cost_few_steps():
    """Every suffix "t t+1" of the output was followed by 99 in the prompt, and the model counts on:
    each proposal is wrong. The request proposes less and less often (waits 2, 4, 8 steps), so the 19
    decoding steps of 20 tokens verify 4 proposals (at steps 1, 4, 9, 18), not 19; the tokens are the
    model's."""
    prompt = [x for t in range(50, 70) for x in (t, t + 1, 99)] + [50]
    sched, runner = make(NGRAM)
    outs = run(sched, runner, [("r", prompt, SamplingParams(temperature=0, max_tokens=20))])
    assert tokens(outs["r"]) == list(range(51, 71))
    s = sched.stats.spec
    assert s.num_accepted_tokens == 0 and s.num_drafts == 4, s
