"""Small modules for export tests, importable as `factories:NAME` (module:factory sources)."""
from __future__ import annotations

import torch
from torch.export import Dim


class TwoDims(torch.nn.Module):
    """Independent batch and seq dims plus a derived input (2*seq) and an offset one (seq+1)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, pairs, shifted):
        # x: (B, S, 16); pairs: (B, 2*S, 16); shifted: (B, S+1, 16)
        h = self.proj(x)
        p = pairs.reshape(x.shape[0], x.shape[1], 2, 16).sum(2)   # (B, S, 16)
        return h + p + shifted[:, 1:], h.mean()


def two_dims():
    b, s = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    args = (torch.randn(2, 5, 16), torch.randn(2, 10, 16), torch.randn(2, 6, 16))
    return TwoDims(), args, {"x": {0: b, 1: s}, "pairs": {0: b, 1: 2 * s}, "shifted": {0: b, 1: s + 1}}


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.head = torch.nn.Linear(32, 100, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("table", torch.randn(600, 4))  # 9.6 KB: must not become a constant

    def forward(self, ids):
        return self.head(self.emb(ids)) + self.table[:100, 0]


def tied():
    return Tied(), (torch.randint(0, 100, (2, 7)),), {"ids": {0: Dim("batch", min=1, max=8)}}


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def mlp():
    return Mlp(), (torch.randn(3, 8),), {"x": {0: Dim("batch", min=1, max=32)}}


@torch.library.custom_op("hloserve_test::frobnicate_cli", mutates_args=())
def frobnicate(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@frobnicate.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("hloserve_test::twiddle_cli", mutates_args=())
def twiddle(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@twiddle.register_fake
def _(x):
    return torch.empty_like(x)


class Exotic(torch.nn.Module):
    """Two ops hloserve has no lowering for (custom ops), to test the error listing."""

    def forward(self, x):
        return twiddle(frobnicate(x) + 1)


def exotic():
    return Exotic(), (torch.randn(2, 3),)
