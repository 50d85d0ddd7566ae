"""Small dynamic-shape models for the SavedModel tests (torch is used only to export them)."""
from __future__ import annotations

import torch
from torch.export import Dim


class QuantEncoder(torch.nn.Module):
    """Embedding + an int8 weight with per-column scales; token ids int64 (narrowed to int32 in the artifact).

    Outputs a derived dim (2*seq) and an integer tensor, so the SavedModel has a
    `None` that is not an input dim and an int32 output.
    """

    def __init__(self, vocab: int = 100, d: int = 16, h: int = 32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, d)
        torch.nn.init.normal_(self.emb.weight, generator=g)
        self.register_buffer("w_q", torch.randint(-127, 128, (d, h), generator=g, dtype=torch.int8))
        self.register_buffer("w_scale", torch.rand(h, generator=g) * 0.02)
        self.register_buffer("offsets", torch.arange(h, dtype=torch.int64))

    def forward(self, tokens, x):
        # tokens: (B, S) int64; x: (B, S, d)
        h = x + self.emb(tokens)                                      # (B, S, d)
        y = torch.relu(h @ (self.w_q.to(torch.float32) * self.w_scale))  # (B, S, h)
        y = y + self.offsets.to(torch.float32) * 0.01
        return torch.cat([y, y.flip(1)], dim=1), tokens + self.offsets[:1]   # (B, 2S, h), (B, S)


class Pool(torch.nn.Module):
    """Masked mean over seq, then a projection: a second function of the same artifact."""

    def __init__(self, h: int = 32, out: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.proj = torch.nn.Parameter(torch.randn(h, out, generator=g))

    def forward(self, y, mask):
        # y: (B, S, h); mask: (B, S) int64
        m = mask.to(y.dtype).unsqueeze(-1)                           # (B, S, 1)
        pooled = (y * m).sum(1) / m.sum(1).clamp(min=1.0)            # (B, h)
        return pooled @ self.proj                                    # (B, out)


def entries():
    """Two entry points over one symbol scope: batch in [1, 16], seq in [2, 64]."""
    from hloserve.exporter.export import EntryPoint
    b, s = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    enc = EntryPoint("encode", QuantEncoder().eval(), (torch.randint(0, 100, (2, 5)), torch.randn(2, 5, 16)),
                     ({0: b, 1: s}, {0: b, 1: s}), input_names=["tokens", "x"], output_names=["y", "ids"])
    pool = EntryPoint("pool", Pool().eval(), (torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.int64)),
                      ({0: b, 1: s}, {0: b, 1: s}), input_names=["y", "mask"], output_names=["embedding"])
    return [enc, pool]
