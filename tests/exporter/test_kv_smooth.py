"""The int8 KV cache's key smoothing (exporter/llm/kv_smooth.py): exact for the attention, and its
calibration's statistics. The served accuracy it buys: tests/server/test_kv_cache_int8.py."""
from __future__ import annotations

import torch


def test_smoothed_keys_give_every_query_the_same_attention():
    """softmax(q s . (k - m) / s) == softmax(q . k): the shift is a constant per query, the scale cancels
    (grouped queries: 6 heads over 2 KV heads). f32 rounding of scores O(10): within 1e-5."""
    from hloserve.exporter.llm.kv_smooth import smooth_keys

    gen = torch.Generator().manual_seed(0)
    T, H, KV, D, L = 9, 6, 2, 16, 3
    q, k = torch.randn(T, H, D, generator=gen), torch.randn(T, KV, D, generator=gen) + 3.0
    smooth = torch.stack([torch.randn(L, KV, D, generator=gen) * 4, torch.rand(L, KV, D, generator=gen) + 0.5], 1)

    def probs(q, k):
        scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(H // KV, 1))
        return scores.softmax(-1)

    qs, ks = smooth_keys(q, k, smooth, torch.tensor(1, dtype=torch.int32))
    torch.testing.assert_close(probs(qs, ks), probs(q, k), atol=1e-5, rtol=0)
    m, s = smooth[1]
    torch.testing.assert_close(ks, (k - m) / s)       # layer 1's (m, s), not another layer's
    assert smooth_keys(q, k, None, torch.tensor(0)) == (q, k)


def test_statistics_center_the_keys_after_the_first_token():
    """m: the keys' mean without token 0 (the attention sink); s: positive, mean 1 per head, larger
    where the keys vary more against the queries."""
    from hloserve.exporter.llm.kv_smooth import statistics

    gen = torch.Generator().manual_seed(1)
    T, H, KV, D = 200, 4, 2, 8
    spread = torch.tensor([1.0] * 4 + [8.0] * 4)
    k = torch.randn(T, KV, D, generator=gen) * spread + 5.0
    k[0] = 1000.0                                                         # the sink: left out
    q = torch.randn(T, H, D, generator=gen)
    m, s = statistics(q, k)
    torch.testing.assert_close(m, k[1:].mean(0))
    assert (s > 0).all()
    torch.testing.assert_close(s.mean(-1), torch.ones(KV))
    assert (s[:, 4:].min(-1).values > s[:, :4].max(-1).values).all()     # sqrt(8) x, give or take the noise
