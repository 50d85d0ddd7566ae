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
from hloserve.exporter.models.llama_quant import QuantizedLlamaWeights
from hloserve.quantization.convert import quantize_module
from hloserve.quantization.modules import QuantizedEmbedding, QuantizedLinear
from hloserve.quantization.schemes import QuantConfig, QuantizationError
from hloserve.runtime import load
from tests.exporter.test_llama import Paged, _hf_model, _prompts

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
    # the tied head reads its own copy, interleaved by 16 rows (the table gathers rows): the same values
    assert model.head.scheme.rows == 16 and model.embed.scheme.rows == 0
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
    assert w["head.weight"].quant["rows"] == 16 and "rows" not in w["embed.weight"].quant
    # the StableHLO takes the stored integers as arguments: i8 (int8) or ui8 (packed int4)
    mlir = open(tmp_path / "functions" / "forward.mlir").read()
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", mlir, re.S).group(1)
    assert ("xi8>" if bits == 8 else "xui8>") in main
    with open(tmp_path / "manifest.json") as f:
        assert json.load(f)["weights"]["embed.weight"]["quant"]["scheme"] == f"int{bits}"


@pytest.mark.parametrize("spec", ["int8", "int4:32:asym"])
def test_large_weight_runs_in_row_blocks(spec, tmp_path):
    """A 66000 x 64 head (> BLOCK_ABOVE) is dequantized block by block inside a loop."""
    from hloserve.exporter.lowerings.quantized import BLOCK_ABOVE, _block_rows

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
    hf = _hf_model("llama")
    root = tmp_path_factory.mktemp("qllm")
    hf.save_pretrained(str(root / "hf"))
    return hf, str(root / "hf")


@pytest.mark.parametrize("spec", ["int8", "int4:32:asym"])
def test_llama_step_quantized_matches_eager(spec, hf_llama, tmp_path):
    """The stacked, scanned Llama step with quantized stacked weights: runtime == torch eager of the
    same quantized step (prefill and decode, a ragged batch), and the scan survives (one while)."""
    from hloserve.exporter.models.llama import LlamaStep
    from hloserve.runtime.artifact.llm import pack_step
    from hloserve.exporter.sources import load_source

    hf, path = hf_llama
    src = load_source(path, quantize=spec, llm_step="llama")
    step = src.entries[0].module
    assert isinstance(step, LlamaStep) and isinstance(step.model, QuantizedLlamaWeights)
    assert src.entries[1].module.model is step.model            # prefill and decode share the weights
    export_artifact(str(tmp_path), src.entries, source="tiny", model=src.model, weight_quant=src.weight_quant)
    model = load(str(tmp_path), buckets={"num_tokens": [1, 8, 64], "num_seqs": [1, 8], "max_blocks": [8]})
    prompts = _prompts([5, 17, 30])
    paged = Paged(model)
    got = paged.step("prefill", dict(enumerate(prompts)))
    got_decode = paged.step("decode", {0: [7], 1: [9]})

    # eager: the same step module on the same inputs (fresh cache, one step per call as above)
    cfg = step.model.cfg
    kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 40, 16, cfg.head_dim)   # [L, 2, KV, N, BS, D]
    tables, free, chunks = [], list(range(39, 0, -1)), []
    for p in prompts:
        t = [free.pop() for _ in range(-(-len(p) // 16))]
        tables.append(t)
        chunks.append((p, 0, t))
    eager = {n: torch.from_numpy(v) for n, v in pack_step(chunks, 16).items()}
    with torch.no_grad():
        want, kv = src.entries[0].module(**eager, kv_cache=kv)
        for i, nxt in ((0, 7), (1, 9)):
            if (len(prompts[i]) + 1) > 16 * len(tables[i]):
                tables[i].append(free.pop())
        dec = {n: torch.from_numpy(v) for n, v in pack_step(
            [([7], len(prompts[0]), tables[0]), ([9], len(prompts[1]), tables[1])], 16).items()}
        want_decode, _ = src.entries[1].module(**dec, kv_cache=kv)
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_decode, want_decode.numpy(), atol=ATOL, rtol=0)
    # vs the float model: quantization changes logits, but the argmax mostly survives int8
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[2]])).logits[0, -1].numpy()
    rel = np.abs(got[2] - ref).max() / np.abs(ref).max()
    assert rel < (0.05 if spec == "int8" else 0.5), rel

    m = model.manifest
    assert m.model["quantization"]["spec"] == spec
    qkv = m.weights["model.layers.qkv_proj"]
    L, rows, hidden = 2, 64 + 2 * 2 * 16, 64
    assert qkv.quant["shape"] == [L, rows, hidden]                  # stays stacked over layers
    # interleaved by 16 rows for the quant_linear version 2 kernel: [L, rows / 16, 16 hidden | 8 hidden]
    assert qkv.quant["rows"] == 16
    assert qkv.shape == ((L, rows // 16, 16 * hidden) if spec == "int8" else (L, rows // 16, 8 * hidden))
    assert m.weights["model.layers.input_layernorm"].quant is None
    mlir = open(tmp_path / "functions" / "decode.mlir").read()
    assert mlir.count("stablehlo.while") == 1                       # dequantized one layer per iteration


def test_cli_quantize(hf_llama, tmp_path):
    from hloserve.server.cli import main

    _, path = hf_llama
    out = str(tmp_path / "art")
    assert main(["export", path, "-o", out, "--quantize", "int4:32", "--quantize-skip", "lm_head",
                 "--function", "decode", "--llm-step", "llama", "-q"]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        man = json.load(f)
    assert man["model"]["quantization"] == {"spec": "int4:32", "scheme": "int4", "group": 32, "symmetric": False,
                                            "scale_dtype": "f16", "rounding": "minmax", "skip": ["lm_head"],
                                            "native": False}
    assert man["weights"]["model.lm_head"]["dtype"] == "f32" and "quant" not in man["weights"]["model.lm_head"]
    assert man["weights"]["model.layers.down_proj"]["quant"]["group"] == 32
    assert main(["export", path, "-o", str(tmp_path / "x"), "--quantize", "int5", "-q"]) == 1
    assert main(["export", path, "-o", str(tmp_path / "x"), "--quantize", "gguf", "-q"]) == 1
