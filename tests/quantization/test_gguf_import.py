"""GGUF Q8_0 / Q4_0 / Q4_1 blocks imported without a float round trip, checked bit for bit
against the gguf package's own dequantization (gguf.quants.dequantize), in NumPy, in the torch
eager op, in the jax lowering, and through an exported artifact run by hloserve.runtime.

Real data: SmolLM2-135M-Instruct's Q4_1 file (layers Q4_1, tied embedding Q8_0). Q4_0, which
that file lacks, comes from gguf.quants.quantize on random data."""
from __future__ import annotations

import dataclasses

import gguf
import jax
import numpy as np
import pytest
import torch

from hloserve.exporter.lowerings import quantized as lowering
from hloserve.exporter.models.gguf import GGUFTensor, load_gguf
from hloserve.exporter.models import gguf_quant
from hloserve.exporter.models.llama import fused_row_order
from hloserve.quantization import convert, modules, primitives
from hloserve.quantization.schemes import QuantConfig
from hloserve.runtime.artifact.llm import LLMSpec, pack_step


@pytest.fixture(scope="module")
def ckpt():
    from hloserve.exporter import presets
    return load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _check_bit_exact(t: GGUFTensor) -> None:
    stored = gguf_quant.gguf_blocks(t)
    scheme = gguf_quant.GGUF_SCHEMES[t.ggml_type]
    ref = t.dequantize()                                              # gguf.quants.dequantize
    qa = primitives.QuantizedArray(stored["qweight"], stored["scale"], stored.get("min"), scheme, t.shape)
    assert stored["qweight"].dtype == (np.int8 if scheme.bits == 8 else np.uint8)
    assert stored["scale"].dtype == np.float16 and stored["scale"].shape == (t.shape[0], t.shape[1] // 32)
    np.testing.assert_array_equal(_bits(primitives.dequantize(qa)), _bits(ref), err_msg=t.name)
    tt = {k: torch.from_numpy(v) for k, v in stored.items()}
    got_t = modules.dequantize(tt["qweight"], tt["scale"], tt.get("min"), scheme.bits, 32).numpy()
    np.testing.assert_array_equal(_bits(got_t), _bits(ref), err_msg=t.name)
    got_j = jax.jit(lambda q, s, m: lowering.dequantize(q, s, m, scheme.bits, 32))(
        stored["qweight"], stored["scale"], stored.get("min"))
    np.testing.assert_array_equal(_bits(got_j), _bits(ref), err_msg=t.name)


@pytest.mark.parametrize("layer", [0, 29])
def test_smollm2_file_blocks_bit_exact(ckpt, layer):
    names = [n for n in ckpt.tensors if n.startswith(f"model.layers.{layer}.") and n.endswith("proj.weight")]
    assert len(names) == 7 and {ckpt.tensors[n].ggml_type for n in names} == {"Q4_1"}
    for n in names:     # q/k rows are un-permuted (row_perm): whole rows of blocks move, still exact
        _check_bit_exact(ckpt.tensors[n])


def test_smollm2_embedding_q8_0_bit_exact(ckpt):
    t = ckpt.tensors["model.embed_tokens.weight"]
    assert t.ggml_type == "Q8_0"
    _check_bit_exact(t)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_synthetic_blocks_bit_exact(qtype):
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 3, (16, 1))).astype(np.float32)
    w[3, :32] = 0.0                                                    # an all-zero block
    raw = gguf.quants.quantize(w, kind)                                # uint8 [16, row bytes]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    t = GGUFTensor("w", "blk.0.w", qtype, int(kind), (16, 256), block, size, raw, None, 0)
    _check_bit_exact(t)


def test_through_artifact_bit_exact(ckpt, tmp_path):
    """QuantizedEmbedding over imported Q4_1 and Q8_0 tables, exported and run: rows == gguf's."""
    from hloserve.exporter.export import EntryPoint, export_artifact
    from hloserve.runtime import load

    class Rows(torch.nn.Module):
        def __init__(self, tensors):
            super().__init__()
            self.q = modules.QuantizedEmbedding(*tensors["q"][1], gguf_quant.GGUF_SCHEMES["Q4_1"], tensors["q"][0],
                                                torch.float32)
            self.e = modules.QuantizedEmbedding(*tensors["e"][1], gguf_quant.GGUF_SCHEMES["Q8_0"], tensors["e"][0],
                                                torch.float32)

        def forward(self, i, j):
            return self.q(i), self.e(j)

    tq, te = ckpt.tensors["model.layers.3.self_attn.q_proj.weight"], ckpt.tensors["model.embed_tokens.weight"]
    blocks = {k: ({r: torch.from_numpy(a) for r, a in gguf_quant.gguf_blocks(t).items()}, t.shape)
              for k, t in (("q", tq), ("e", te))}
    i = torch.tensor([0, 5, 575, 100], dtype=torch.int32)
    j = torch.tensor([0, 1, 49151, 1234, 7], dtype=torch.int32)
    export_artifact(str(tmp_path), [EntryPoint("rows", Rows(blocks), (i, j), input_names=["i", "j"],
                                               output_names=["q", "e"])], source="gguf rows")
    out = load(str(tmp_path)).functions["rows"](i=i.numpy(), j=j.numpy())
    np.testing.assert_array_equal(_bits(out["q"]), _bits(tq.dequantize()[i.numpy()]))
    np.testing.assert_array_equal(_bits(out["e"]), _bits(te.dequantize()[j.numpy()]))


def test_llama_from_gguf_keeps_the_files_blocks(ckpt):
    from hloserve.exporter.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf(dict(ckpt.config))
    record = convert.QuantRecord()
    w = gguf_quant.llama_from_gguf(cfg, ckpt, QuantConfig.parse("gguf"), record)
    # the layers' blocks interleaved by 16 rows (quant_linear version 2); the tied table row by row
    assert w.schemes["qkv_proj"] == dataclasses.replace(gguf_quant.GGUF_SCHEMES["Q4_1"], rows=16)
    assert w.schemes["embed_tokens"] == gguf_quant.GGUF_SCHEMES["Q8_0"]
    # tied: the head reads the table's Q8_0 blocks again, interleaved by 16 rows (the table's gathers need rows)
    assert w.schemes["lm_head"] == dataclasses.replace(gguf_quant.GGUF_SCHEMES["Q8_0"], rows=16)
    head, head_scale, _ = modules.rows_in_order(w.lm_head, w.lm_head_scale, None, 8)
    assert torch.equal(head, w.embed_tokens) and torch.equal(head_scale, w.embed_tokens_scale)
    L, rows = cfg.num_layers, cfg.q_size + 2 * cfg.kv_size
    assert tuple(w.layers["qkv_proj"].shape) == (L, rows // 16, 8 * cfg.hidden_size)
    assert tuple(w.layers["qkv_proj_scale"].shape) == (L, rows // 16, cfg.hidden_size // 32, 16)
    assert w.layers["qkv_proj"].dtype == torch.uint8 and w.layers["qkv_proj_min"].dtype == torch.float16
    assert w.layers["input_layernorm"].dtype == torch.float32
    i = 17   # one layer's slice of the stacked storage dequantizes to the file's q, k, v rows exactly
    q, s, m = modules.rows_in_order(w.layers["qkv_proj"][i], w.layers["qkv_proj_scale"][i], w.layers["qkv_proj_min"][i], 4)
    got = modules.dequantize(q, s, m, 8, 32)
    want = np.concatenate([ckpt.tensors[f"model.layers.{i}.self_attn.{p}_proj.weight"].dequantize() for p in "qkv"])
    want = want[fused_row_order(cfg, "qkv_proj").numpy()]             # grouped by KV head (FUSED_ROWS)
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(want))
    entry = record("model.layers.gate_up_proj_min", w.layers["gate_up_proj_min"])
    assert entry == {"scheme": "int4", "group": 32, "symmetric": False, "scale_dtype": "f16", "rounding": "minmax", "rows": 16,
                     "role": "min",
                     "of": "model.layers.gate_up_proj", "shape": [L, 2 * cfg.intermediate_size, cfg.hidden_size]}


@pytest.mark.slow
def test_native_export_matches_the_dequantized_model(tmp_path):
    """SmolLM2 exported with --quantize gguf (decode only) vs torch eager of the f32 dequantized step:
    the same weights bit for bit, but the quantized linears multiply int8 activations (the
    `hloserve.quant_linear` contract: x quantized per block of 32, error <= max|x_block| / 254 per
    element), which compounds over the 211 linears of 30 layers to a few percent of the logits'
    largest magnitude (measured 3.3%; the perplexity cost, +0.5%, is in docs/quantization.md).
    Bound, on logits centered on their mean (a common shift changes no probability): 6% of the
    largest logit, 1% on average, the same argmax."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.models.llama_source import from_gguf
    from hloserve.exporter import presets
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    src = load_source("smollm2-135m-instruct", quantize="gguf")
    entries = [e for e in src.entries if e.name == "decode"]
    manifest = export_artifact(str(tmp_path), entries, source="smollm2 gguf", model=src.model,
                               weight_quant=src.weight_quant)
    assert manifest.weights["model.layers.down_proj"].quant["symmetric"] is False
    assert manifest.weights["model.embed_tokens"].dtype == "i8"
    prompt = [1, 504, 3458, 282, 260, 1345, 28, 253, 2114, 1953, 30]
    inputs = pack_step([(prompt, 0, [1])], 16)
    model = load(str(tmp_path), buckets={"num_tokens": [16], "num_seqs": [1], "max_blocks": [1]})
    cache = np.zeros(LLMSpec.from_json(manifest.model["llm"]).kv_cache.concrete_shape(2), np.float32)   # [30, 2, 3, 2, 16, 64]
    got = np.asarray(model.functions["decode"](**inputs, kv_cache=cache)["logits"])
    args = {k: torch.from_numpy(v) for k, v in inputs.items()}
    ref = from_gguf(presets.resolve("smollm2-135m-instruct", quiet=True)).entries[1].module
    with torch.no_grad():
        want, _ = ref(**args, kv_cache=torch.from_numpy(cache))
    want = want.numpy()
    top = np.abs(want).max()
    diff = np.abs((got - got.mean()) - (want - want.mean()))
    assert diff.max() < 0.06 * top and diff.mean() < 0.01 * top, (diff.max(), diff.mean(), top)
    assert int(got.argmax()) == int(want.argmax())
