"""`hloserve export ... --dtype bfloat16`: a small random-init decoder (module:factory
source) and the real all-MiniLM-L6-v2 (HF directory source, slow) exported by the CLI
in bf16 match torch eager in bf16.

Tolerance: both sides compute in bf16 (8 bits of mantissa) with different op
orders and fusions, so outputs differ by a few bf16 ulps; we require the max abs
difference to stay below 3% of the outputs' max magnitude and the mean below 0.5%,
and the bf16 artifact to be as close to the f32 model as torch's own bf16 run is
(within 1.5x).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch.export import Dim

from hloserve.server.cli import main
from hloserve.runtime import load


class TinyDecoder(torch.nn.Module):
    """Embedding, one pre-norm causal attention + SiLU-gated MLP block, LM head."""

    def __init__(self, vocab=256, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norm1, self.norm2, self.norm_f = (torch.nn.RMSNorm(dim) for _ in range(3))
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.gate_up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):                 # (B, S) -> (B, S, vocab)
        h = self.emb(input_ids)                                              # (B, S, D)
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        h = h + self.down(torch.nn.functional.silu(gate) * up)
        return self.head(self.norm_f(h))


def tiny_decoder():
    """module:factory source: (module, args, dynamic_shapes), built in f32 (the CLI casts to --dtype)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 8))
    return TinyDecoder().eval(), (ids,), {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)}}


def test_cli_bf16_export_matches_eager_bf16(tmp_path):
    out = str(tmp_path / "art")
    assert main(["export", f"{__name__}:tiny_decoder", "-o", out, "--dtype", "bfloat16", "-q"]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["model"]["dtype"] == "bfloat16"
    assert {w["dtype"] for w in manifest["weights"].values()} == {"bf16"}
    assert manifest["functions"]["forward"]["outputs"][0]["dtype"] == "bf16"
    with open(os.path.join(out, "functions", "forward.mlir")) as f:
        text = f.read()
    assert "bf16" in text and "tensor<?x?xi32>" in text

    fn = load(out).functions["forward"]
    f32_model = tiny_decoder()[0]
    bf16_model = tiny_decoder()[0].to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for batch, seq in [(1, 5), (3, 17)]:
        ids = torch.randint(0, 256, (batch, seq), generator=g)
        with torch.no_grad():
            want = bf16_model(ids).float().numpy()
            exact = f32_model(ids).numpy()
        got = np.asarray(fn(input_ids=ids.numpy())["output"]).astype(np.float32)
        assert got.shape == want.shape
        scale = np.abs(want).max()
        diff = np.abs(got - want)
        assert diff.max() <= 0.03 * scale, (diff.max(), scale)
        assert diff.mean() <= 0.005 * scale, (diff.mean(), scale)
        # no worse than torch's own bf16 rounding against f32
        assert np.abs(got - exact).mean() <= 1.5 * np.abs(want - exact).mean()


@pytest.mark.slow
def test_minilm_cli_bf16_matches_eager_bf16(tmp_path, minilm_dir):
    """The real checkpoint through the HF-directory source, same tolerances."""
    import transformers
    out = str(tmp_path / "art")
    assert main(["export", "all-minilm-l6-v2", "-o", out, "--dtype", "bfloat16", "-q"]) == 0
    fn = load(out).functions["forward"]
    ref = transformers.AutoModel.from_pretrained(minilm_dir, dtype=torch.bfloat16).eval()
    exact_ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    g = torch.Generator().manual_seed(3)
    for batch, seq in [(1, 7), (3, 33)]:
        ids = torch.randint(1000, 29000, (batch, seq), generator=g)
        mask, tt = torch.ones_like(ids), torch.zeros_like(ids)
        if batch > 1:
            mask[-1, seq // 2:] = 0  # a padded row
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.float().numpy()
            exact = exact_ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.numpy()
        got = fn(input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=tt.numpy())
        got = np.asarray(got["last_hidden_state"]).astype(np.float32)
        scale, diff = np.abs(want).max(), np.abs(got - want)
        assert diff.max() <= 0.03 * scale, (diff.max(), scale)
        assert diff.mean() <= 0.005 * scale, (diff.mean(), scale)
        assert np.abs(got - exact).mean() <= 1.5 * np.abs(want - exact).mean()


class MixedLinear(torch.nn.Module):
    """hloserve::mixed_linear over a bf16 weight (with and without bias) on f32 activations."""

    def __init__(self, bias: bool):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(48, 32, generator=g).to(torch.bfloat16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False) if bias else None

    def forward(self, x):                         # (B, S, 32) f32 -> (B, S, 48) f32
        from hloserve.exporter.composites import layer_linear  # noqa: F401
        return torch.ops.hloserve.mixed_linear(x, self.weight, self.bias)


@pytest.mark.parametrize("bias", [False, True])
def test_mixed_linear_matches_its_eager_definition(tmp_path, bias):
    """The lowering (bf16 dot, f32 sums; one row padded to two) against the op's eager form (f32
    linear over bf16-rounded operands: the products are exact, only the summation order differs),
    for 1 row, a few rows and a 3-D input, through a dynamic batch and sequence."""
    from hloserve.exporter.export import EntryPoint, export_artifact
    module = MixedLinear(bias).eval()
    x = torch.randn(2, 3, 32)
    dyn = ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)},)
    export_artifact(str(tmp_path / "art"), [EntryPoint("forward", module, (x,), dyn, input_names=["x"])],
                    source="mixed-linear", model={"task": "generic"})
    fn = load(str(tmp_path / "art")).functions["forward"]
    g = torch.Generator().manual_seed(4)
    for shape in [(1, 1, 32), (1, 5, 32), (3, 7, 32)]:
        xs = torch.randn(*shape, generator=g)
        with torch.no_grad():
            want = module(xs).numpy()
            f32 = torch.nn.functional.linear(xs, module.weight.float(), module.bias).numpy()
        got = np.asarray(fn(x=xs.numpy())["output"])
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # and it is a real rounding of the activations: not the f32 product
        assert np.abs(got - f32).max() > 1e-4
