"""Reference models shared by test folders."""
from __future__ import annotations

import torch


def hf_with_mixed_linears(hf, dtype=torch.bfloat16, *, kv_dtype=None):
    """`hf` (a transformers model, changed in place) computing every Linear as
    hloserve::mixed_linear does: weights and inputs rounded to `dtype`, products summed in f32
    (forward pre-hooks round the inputs; the weights and embedding tables are rounded once).

    kv_dtype also rounds the k_proj / v_proj outputs, like a KV cache of that dtype. For V that
    is exact; hloserve rounds K after RoPE, this model before it, so K agrees only to rounding.
    """
    round_out = None if kv_dtype is None else (lambda mod, args, out: out.to(kv_dtype).float())
    with torch.no_grad():
        for name, m in hf.named_modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.copy_(m.weight.to(dtype).float())
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda mod, args: (args[0].to(dtype).float(),))
                if round_out is not None and name.endswith(("k_proj", "v_proj")):
                    m.register_forward_hook(round_out)
    return hf
