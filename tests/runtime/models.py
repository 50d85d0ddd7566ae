"""Small torch modules exported by the runtime tests (torch is used only to export them)."""
from __future__ import annotations

import torch
from torch.export import Dim


class MlpBlock(torch.nn.Module):
    """x + down(relu(up(x))): up is the column-parallel layer, down the row-parallel one."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))   # (B, d)


class TwoLayerMlp(torch.nn.Module):
    """Two Megatron-style MLP blocks; d=64, hidden=256 so every split weight divides by 4."""

    def __init__(self, d: int = 64, hidden: int = 256):
        super().__init__()
        self.layers = torch.nn.ModuleList([MlpBlock(d, hidden) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mlp_entry():
    """TwoLayerMlp with batch in [1, 64], paddable (rows are independent)."""
    from hloserve.exporter.export import EntryPoint
    torch.manual_seed(0)
    b = Dim("batch", min=1, max=64)
    return EntryPoint("forward", TwoLayerMlp().eval(), (torch.randn(2, 64),), ({0: b},),
                      input_names=["x"], output_names=["y"], paddable=("batch",))


class KvUpdate(torch.nn.Module):
    """A KV-cache-like step: write `values` at `slots` of the flat `state` in place."""

    def forward(self, state, slots, values):
        state.index_copy_(0, slots, values)   # state: (N,), slots: (K,), values: (K,)
        return values.sum()


def state_entry():
    """KvUpdate with a symbolic state size n (so tests pick the size at call time), state donated."""
    from hloserve.exporter.export import EntryPoint
    n = Dim("n", min=16, max=1 << 30)
    k = Dim("k", min=1, max=1024)
    args = (torch.zeros(64), torch.arange(4), torch.ones(4))
    return EntryPoint("step", KvUpdate(), args, ({0: n}, {0: k}, {0: k}),
                      input_names=["state", "slots", "values"], output_names=["total"], donated=("state",))
