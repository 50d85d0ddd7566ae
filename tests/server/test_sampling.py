"""Sampling: greedy, top-k, top-p, seeded reproducibility, the sampled distribution, logprobs, validation."""
from __future__ import annotations

import numpy as np
import pytest

from hloserve.server.core.sampling import SamplingParams, filtered_probs, sample, sample_row


def _logits(seed=0, vocab=50):
    return np.random.default_rng(seed).normal(size=(vocab,)).astype(np.float32) * 2


def test_greedy_is_argmax_and_ignores_top_k_p():
    rows = np.stack([_logits(i) for i in range(5)])
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 5
    tokens, lps = sample(rows, params, [0] * 5, [0] * 5)
    assert tokens == list(np.argmax(rows, axis=-1)) and lps == [None] * 5


def test_rows_read_in_place_equal_the_rows_copied():
    """`rows=` reads each request's row where it lies (the runner's logits, drafted rows between them);
    greedy and sampled rows draw what they draw from the same rows copied out first."""
    logits = np.stack([_logits(i, 300) for i in range(7)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)]
    rows, seeds, indexes = [0, 2, 3, 6], [1, 2, 3, 4], [0, 5, 1, 2]
    got, _ = sample(logits, params, seeds, indexes, rows=rows)
    want, _ = sample(logits[rows], params, seeds, indexes)
    assert got == want
    assert got[0] == int(np.argmax(logits[0])) and got[2] == int(np.argmax(logits[3]))


def test_top_k_1_is_greedy_at_any_temperature():
    for i in range(10):
        x = _logits(i)
        for temp in (0.5, 1.0, 3.0):
            tok, _ = sample_row(x, SamplingParams(temperature=temp, top_k=1), seed=i, index=0)
            assert tok == int(np.argmax(x))


def test_seeded_draws_reproduce_and_differ_by_seed_and_index():
    x = np.zeros(1000, np.float32)   # uniform: collisions are unlikely
    p = SamplingParams(temperature=1.0)
    a = [sample_row(x, p, seed=42, index=i)[0] for i in range(20)]
    assert a == [sample_row(x, p, seed=42, index=i)[0] for i in range(20)]
    assert a != [sample_row(x, p, seed=43, index=i)[0] for i in range(20)]
    assert len(set(a)) > 10          # the index moves the stream: not the same token 20 times
    # batch composition does not matter: row 0 samples the same alone or with others
    batch = np.stack([x, _logits(1, 1000), _logits(2, 1000)])
    toks, _ = sample(batch, [p, p, p], [42, 7, 8], [3, 0, 0])
    assert toks[0] == a[3]


def test_top_k_and_top_p_candidate_sets():
    x = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))
    ids, p = filtered_probs(x, SamplingParams(top_k=2))
    assert list(ids) == [0, 1] and np.allclose(p, [0.5 / 0.7, 0.2 / 0.7])
    ids, _ = filtered_probs(x, SamplingParams(top_p=0.7))       # 0.5 + 0.2 reaches 0.7
    assert list(ids) == [0, 1]
    ids, _ = filtered_probs(x, SamplingParams(top_p=0.71))
    assert list(ids) == [0, 1, 2]
    ids, _ = filtered_probs(x, SamplingParams(top_p=0.01))      # always at least one token
    assert list(ids) == [0]
    ids, p = filtered_probs(x, SamplingParams(top_k=4, top_p=0.8))   # top-k first, then top-p on the rest
    assert list(ids) == [0, 1, 2] and np.isclose(p.sum(), 1)


def test_top_p_over_a_large_vocab_matches_a_full_sort():
    # the nucleus-probe shortcut (64 candidates) must give the same set as sorting everything
    rng = np.random.default_rng(3)
    for flat in (0.1, 3.0):          # peaked (nucleus in the probe) and flat (nucleus beyond it)
        x = (rng.normal(size=5000) * flat).astype(np.float32)
        for top_p in (0.3, 0.9):
            ids, _ = filtered_probs(x, SamplingParams(top_p=top_p))
            order = np.argsort(-x.astype(np.float64), kind="stable")
            pr = np.exp(x[order] - x.max())
            pr /= pr.sum()
            keep = int(np.searchsorted(np.cumsum(pr), top_p)) + 1
            assert set(ids) == set(order[:keep])


def test_sampled_frequencies_match_the_distribution():
    """Chi-square goodness of fit: 20,000 seeded draws from a 6-token distribution.

    With 5 degrees of freedom the 99.9% quantile of chi-square is 20.5; the draws
    are seeded, so this test is deterministic and fails only on a real bias.
    """
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    x = np.log(probs).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    n = 20000
    counts = np.bincount([sample_row(x, p, seed=11, index=i)[0] for i in range(n)], minlength=6)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 20.5, (counts, chi2)
    # temperature 2 flattens: sampled from softmax(log p / 2) = sqrt(p) / sum(sqrt(p))
    q = np.sqrt(probs) / np.sqrt(probs).sum()
    counts = np.bincount([sample_row(x, SamplingParams(temperature=2.0), seed=5, index=i)[0] for i in range(n)],
                         minlength=6)
    chi2 = float(((counts - n * q) ** 2 / (n * q)).sum())
    assert chi2 < 20.5, (counts, chi2)


def test_logprobs_are_raw_log_softmax():
    x = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    tok, lp = sample_row(x, SamplingParams(temperature=0.0, logprobs=2), seed=0, index=0)
    ref = x - np.log(np.exp(x).sum())
    assert tok == 0 and lp.token_id == 0 and lp.logprob == pytest.approx(ref[0], abs=1e-6)
    assert [t for t, _ in lp.top] == [0, 1] and lp.top[1][1] == pytest.approx(ref[1], abs=1e-6)
    _, lp = sample_row(x, SamplingParams(temperature=5.0, logprobs=0), seed=0, index=0)
    assert lp.top == () and lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature=-0.1: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), r"top_p=0.0: must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-2), "top_k=-2: must be an integer >= 1, or 0/-1/None"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(max_tokens=0), "max_tokens=0: must be an integer >= 1"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(stop=["ok", ""]), "every stop sequence must be a non-empty string"),
    (dict(seed="x"), "seed='x': must be an integer"),
    (dict(logprobs=21), r"logprobs=21: must be an integer in \[0, 20\]"),
    (dict(n=2), "n=2: only n=1 is supported"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalization():
    p = SamplingParams(stop="END", top_k=0)
    assert p.stop == ("END",) and p.top_k is None
    assert SamplingParams(stop=None).stop == ()


def test_repetition_penalty_and_min_p_match_transformers():
    """repetition_penalty as transformers' RepetitionPenaltyLogitsProcessor (over prompt and output),
    min_p as its MinPLogitsWarper, presence/frequency penalties as OpenAI defines them."""
    import torch
    import transformers

    from hloserve.server.core.sampling import RowContext, _candidates, process_logits
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(64).astype(np.float32) * 3
    prompt, output = (3, 5, 5, 9), (9, 12, 12, 12)
    p = SamplingParams(repetition_penalty=1.7)
    got = process_logits(logits, p, RowContext(prompt=prompt, output=output))
    want = transformers.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]),
                                                              torch.tensor(logits)[None])[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = process_logits(logits, p, RowContext(output=output))
    want = logits.copy()
    for t in set(output):
        want[t] -= 0.5 + 0.25 * output.count(t)
    np.testing.assert_allclose(got, want, rtol=1e-6)

    p = SamplingParams(temperature=1.0, min_p=0.2)
    ids, _ = _candidates(logits, p)
    warped = transformers.MinPLogitsWarper(0.2)(None, torch.tensor(logits)[None])[0].numpy()
    assert ids.tolist() == np.flatnonzero(np.isfinite(warped)).tolist()


def test_logit_bias_and_min_tokens_suppression():
    from hloserve.server.core.sampling import RowContext, process_logits, sample
    logits = np.zeros((1, 10), np.float32)
    logits[0, 2] = 5.0                                     # token 2 (say EOS) is the greedy choice
    p = SamplingParams(temperature=0, logit_bias={7: 3.0})
    assert process_logits(logits[0], p, RowContext())[7] == 3.0
    tokens, _ = sample(logits, [p], [0], [0], [RowContext(suppress=(2,))])
    assert tokens == [7]                                   # EOS suppressed before min_tokens; the bias wins
    tokens, _ = sample(logits, [p], [0], [0])
    assert tokens == [2]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
