"""Reference models shared by test folders."""
from __future__ import annotations

import torch


def hf_with_mixed_linears(hf, dtype=torch.bfloat16):
    """`hf` (a transformers model, changed in place) computing every Linear as
    hloserve::mixed_linear does: weights and inputs rounded to `dtype`, products summed in f32
    (forward pre-hooks round the inputs; the weights and embedding tables are rounded once)."""
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.copy_(m.weight.to(dtype).float())
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda mod, args: (args[0].to(dtype).float(),))
    return hf
