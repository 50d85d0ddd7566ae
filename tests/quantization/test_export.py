"""Quantized models through the emitter: export, run through hloserve.runtime, compare with the
torch eager forward of the SAME quantized module (the custom ops' eager implementations
dequantize in float32 and call F.linear / F.embedding). Tolerance 1e-4 absolute on logits
(float32; only the summation order of the matmuls differs). Also checks what the artifact
stores (dtypes, manifest schemes, StableHLO argument types) and the CLI's --quantize."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from hloserve.exporter.export import EntryPoint, export_artifact
from hloserve.quantization.convert import quantize_module
from hloserve.quantization.modules import QuantizedEmbedding, QuantizedLinear
from hloserve.quantization.schemes import QuantConfig, QuantizationError
from hloserve.runtime import load
from tests.exporter.step_driver import hf_model

ATOL = 1e-4


class TinyLM(torch.nn.Module):
    """Embedding -> 2 Linear (one with bias) -> tied head: every quantized op, a dynamic seq dim."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(112, 64)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)
        self.head = torch.nn.Linear(64, 112, bias=False)
        self.head.weight = self.embed.weight                             # tied

    def forward(self, ids):
        h = self.embed(ids)                                              # [B, S, 64]
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)                                              # [B, S, 112]


@pytest.mark.parametrize("spec", ["int8", "int8:32", "int4:32:sym", "int4:64"])
def test_module_swap_exports_and_matches_eager(spec, tmp_path):
    model = TinyLM().eval()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_float = model(ids).numpy()
    record = quantize_module(model, QuantConfig.parse(spec))
    assert isinstance(model.embed, QuantizedEmbedding) and isinstance(model.up, QuantizedLinear)
    # the tied head and the table read one stored copy, interleaved by 16 rows for the head's kernel
    # (the table gathers its rows where they lie)
    assert model.head.scheme.rows == 16 and model.embed.scheme == model.head.scheme
    assert model.head.weight is model.embed.weight and model.head.weight_scale is model.embed.weight_scale
    with torch.no_grad():
        want = model(ids).numpy()
    seq = torch.export.Dim("seq", min=1, max=64)
    manifest = export_artifact(str(tmp_path), [EntryPoint("forward", model, (ids,), ({1: seq},), input_names=["ids"])],
                               source="tiny", weight_quant=record)
    got = load(str(tmp_path)).functions["forward"](ids=ids.numpy().astype(np.int32))["output"]
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    # quantization error is real but bounded: the float model's logits are within a few percent
    err = np.abs(want - want_float).max() / np.abs(want_float).max()
    assert 0 < err < (0.02 if spec.startswith("int8") else 0.2), err

    bits = int(spec[3])
    w = manifest.weights
    assert w["up.weight"].dtype == ("i8" if bits == 8 else "u8")
    # linear layers are stored interleaved by 16 rows (quant_linear version 2): [128/16, 16 * 64 | 8 * 64]
    assert w["up.weight"].shape == ((8, 1024) if bits == 8 else (8, 512))
    assert w["up.weight"].quant["role"] == "qweight" and w["up.weight"].quant["shape"] == [128, 64]
    assert w["up.weight"].quant["rows"] == 16 and w["up.weight_scale"].shape[-1] == 16
    assert w["up.weight_scale"].quant == {**w["up.weight"].quant, "role": "scale"}
    assert w["up.bias"].quant is None and w["up.bias"].dtype == "f32"
    assert ("up.weight_min" in w) == (bits == 4 and not spec.endswith("sym"))
    table = [n for n in ("embed.weight", "head.weight") if n in w]
    assert len(table) == 1 and w[table[0]].quant["rows"] == 16, table      # stored once
    # the StableHLO takes the stored integers as arguments: i8 (int8) or ui8 (packed int4)
    mlir = open(tmp_path / "functions" / "forward.mlir").read()
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", mlir, re.S).group(1)
    assert ("xi8>" if bits == 8 else "xui8>") in main
    with open(tmp_path / "manifest.json") as f:
        assert json.load(f)["weights"][table[0]]["quant"]["scheme"] == f"int{bits}"


def test_chunks_round_to_bf16_except_in_a_batch_invariant_export(tmp_path):
    """An export writes quant_linear version 6 (bf16_rows 64: calls of 64 rows and more round x and
    the dequantized weights to bf16); a batch-invariant one keeps version 2, whose result does not
    depend on the row count. At 7 rows the two artifacts agree within ATOL (only summation order
    differs); at 80 rows they differ by the rounding: more than ATOL, under 2% of the largest logit
    (bf16 keeps 8 significant bits, as the activations' int8 blocks do); where this CPU's kernels raise
    bf16_rows (no AMX: tests/support/quant_contract.py) they agree at 80 rows too."""
    from tests.support.quant_contract import step_rows
    model = TinyLM().eval()
    record = quantize_module(model, QuantConfig.parse("int8"))
    seq = torch.export.Dim("seq", min=1, max=128)
    got = {}
    for invariant in (False, True):
        out = str(tmp_path / f"invariant-{invariant}")
        entry = EntryPoint("forward", model, (torch.zeros((1, 7), dtype=torch.int64),), ({1: seq},), input_names=["ids"])
        export_artifact(out, [entry], source="tiny", weight_quant=record, batch_invariant=invariant)
        mlir = open(os.path.join(out, "functions", "forward.mlir")).read()
        versions = set(re.findall(r'stablehlo.composite "hloserve.quant_linear"[^\n]*?version = (\d+)', mlir))
        assert versions == ({"2"} if invariant else {"6"}), versions
        assert invariant or "bf16_rows = 64" in mlir
        fn = load(out).functions["forward"]
        for n in (7, 80):
            ids = (np.arange(n, dtype=np.int32)[None] * 7) % 100
            got[invariant, n] = np.asarray(fn(ids=ids)["output"])
    np.testing.assert_allclose(got[False, 7], got[True, 7], atol=ATOL, rtol=0)
    if step_rows(80) == 0:   # this CPU's kernels raise bf16_rows: version 2's product at 80 rows too
        np.testing.assert_allclose(got[False, 80], got[True, 80], atol=ATOL, rtol=0)
        return
    diff, top = np.abs(got[False, 80] - got[True, 80]).max(), np.abs(got[True, 80]).max()
    assert ATOL < diff < 0.02 * top, (diff, top)


@pytest.mark.parametrize("spec", ["int8", "int4:32:asym"])
def test_large_weight_runs_in_row_blocks(spec, tmp_path):
    """A 66000 x 64 head (> BLOCK_ABOVE) is dequantized block by block inside a loop."""
    from hloserve.exporter.composites.quant_linear import BLOCK_ABOVE, _block_rows

    assert 66000 * 64 > BLOCK_ABOVE and _block_rows(66000, 64) == 13200   # 5 blocks
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 66000)).eval()
    x = torch.randn(3, 64)
    record = quantize_module(model, QuantConfig.parse(spec))
    with torch.no_grad():
        want = model(x).numpy()
    export_artifact(str(tmp_path), [EntryPoint("forward", model, (x,))], source="head", weight_quant=record)
    got = load(str(tmp_path)).functions["forward"](**{"input": x.numpy()})["output"]
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    assert open(tmp_path / "functions" / "forward.mlir").read().count("stablehlo.while") == 1


def test_skip_patterns_leave_modules_float():
    model = TinyLM()
    quantize_module(model, QuantConfig.parse("int8", skip=("embed",)))
    assert isinstance(model.embed, torch.nn.Embedding) and isinstance(model.down, QuantizedLinear)
    with pytest.raises(QuantizationError, match="not a multiple of group 48"):
        quantize_module(TinyLM(), QuantConfig.parse("int4:48"))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    hf = hf_model("llama")
    root = tmp_path_factory.mktemp("qllm")
    hf.save_pretrained(str(root / "hf"))
    return hf, str(root / "hf")


def test_cli_quantize(hf_llama, tmp_path):
    """`hloserve export DIR --quantize int4:32 --quantize-skip lm_head`: the manifest records the
    config; each layer's linears stay stacked over the layers of the one scanned body (one while),
    interleaved by 16 rows for the quant_linear version 2 kernel; the skipped head and the norms stay
    float. Bad specs are one line, exit 1."""
    from hloserve.server.cli import main

    _, path = hf_llama
    out = str(tmp_path / "art")
    assert main(["export", path, "-o", out, "--quantize", "int4:32", "--quantize-skip", "lm_head",
                 "--function", "decode", "-q"]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        man = json.load(f)
    assert man["model"]["quantization"] == {"spec": "int4:32", "scheme": "int4", "group": 32, "symmetric": False,
                                            "scale_dtype": "f16", "rounding": "minmax", "skip": ["lm_head"],
                                            "native": False}
    weights = man["weights"]
    (head,) = [w for n, w in weights.items() if n.endswith("lm_head.weight")]
    assert head["dtype"] == "f32" and "quant" not in head
    (q,) = [w for n, w in weights.items() if n.endswith("q_proj__weight")]
    L, rows, hidden = 2, 64, 64
    assert q["quant"]["shape"] == [L, rows, hidden] and q["quant"]["group"] == 32 and q["quant"]["rows"] == 16
    assert q["shape"] == [L, rows // 16, 8 * hidden]                # [L, rows / 16, 16 rows of hidden / 2 bytes]
    assert all("quant" not in w for n, w in weights.items() if "layernorm" in n)
    assert open(os.path.join(out, "functions", "decode.mlir")).read().count("stablehlo.while") == 1
    assert main(["export", path, "-o", str(tmp_path / "x"), "--quantize", "int5", "-q"]) == 1
    assert main(["export", path, "-o", str(tmp_path / "x"), "--quantize", "gguf", "-q"]) == 1
