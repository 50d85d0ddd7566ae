"""GGUF blocks imported without a float round trip, checked against the gguf package's own
dequantization (gguf.quants.dequantize): Q8_0 / Q4_0 / Q4_1 / Q5_0 bit for bit, in NumPy, in the
torch eager op, in the jax lowering, and through an exported artifact run by hloserve.runtime;
K-quants (Q4_K, Q6_K) kept as blocks in linears (tests/runtime/test_kquant_kernels.py checks their values),
converted within the bounds their conversion derives where an embedding table holds them (docs/quantization.md).

Real data: SmolLM2-135M-Instruct's Q4_1 file (layers Q4_1, tied embedding Q8_0). Q4_0 and Q5_0,
which that file lacks, come from gguf.quants.quantize on random data; K-quants (gguf-py cannot
quantize them) are random bytes with realistic f16 scales, written into a tiny Llama GGUF file."""
from __future__ import annotations

import os

import gguf
import jax
import numpy as np
import pytest
import torch

from hloserve.exporter.composites import quant_linear as lowering
from hloserve.exporter.gguf.checkpoint import load_gguf
from hloserve.exporter.gguf.tensor import GGUFTensor
from hloserve.exporter.gguf import quant as gguf_quant
from hloserve.quantization import modules, primitives
from hloserve.quantization.schemes import QuantConfig, WeightScheme
from hloserve.runtime.artifact.llm import LLMSpec, pack_step


@pytest.fixture(scope="module")
def ckpt():
    from hloserve.exporter import presets
    return load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _check_bit_exact(t: GGUFTensor) -> None:
    stored, scheme = gguf_quant.gguf_blocks(t)
    ref = t.dequantize()                                              # gguf.quants.dequantize
    qa = primitives.QuantizedArray(stored["qweight"], stored["scale"], stored.get("min"), scheme, t.shape)
    assert stored["qweight"].dtype == (np.uint8 if scheme.bits == 4 else np.int8)   # int5 row by row: a byte each
    assert stored["scale"].dtype == np.float16 and stored["scale"].shape == (t.shape[0], t.shape[1] // 32)
    np.testing.assert_array_equal(_bits(primitives.dequantize(qa)), _bits(ref), err_msg=t.name)
    tt = {k: torch.from_numpy(v) for k, v in stored.items()}
    got_t = modules.dequantize(tt["qweight"], tt["scale"], tt.get("min"), scheme.bits, 32).numpy()
    np.testing.assert_array_equal(_bits(got_t), _bits(ref), err_msg=t.name)
    got_j = jax.jit(lambda q, s, m: lowering.dequantize(q, s, m, scheme.bits, 32))(
        stored["qweight"], stored["scale"], stored.get("min"))
    np.testing.assert_array_equal(_bits(got_j), _bits(ref), err_msg=t.name)
    if scheme.bits == 5:   # Q5_0 kept: a linear layer's version 4 layout holds the same values and scales
        linear = scheme.for_linear(t.shape)
        assert linear.rows == 16
        q, sc, _ = primitives.rows_in_order(*primitives.interleave_rows(stored["qweight"], stored["scale"], None, 5), 5)
        np.testing.assert_array_equal(q, stored["qweight"])
        np.testing.assert_array_equal(sc, stored["scale"])


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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
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
    blocks = {k: ({r: torch.from_numpy(a) for r, a in gguf_quant.gguf_blocks(t)[0].items()}, t.shape)
              for k, t in (("q", tq), ("e", te))}
    i = torch.tensor([0, 5, 575, 100], dtype=torch.int32)
    j = torch.tensor([0, 1, 49151, 1234, 7], dtype=torch.int32)
    export_artifact(str(tmp_path), [EntryPoint("rows", Rows(blocks), (i, j), input_names=["i", "j"],
                                               output_names=["q", "e"])], source="gguf rows")
    out = load(str(tmp_path)).functions["rows"](i=i.numpy(), j=j.numpy())
    np.testing.assert_array_equal(_bits(out["q"]), _bits(tq.dequantize()[i.numpy()]))
    np.testing.assert_array_equal(_bits(out["e"]), _bits(te.dequantize()[j.numpy()]))


def test_stored_by_module_keeps_the_files_blocks(ckpt):
    """`--quantize gguf`'s module swap input for SmolLM2 (a transformers Llama built on the meta
    device from the file's config: only its module names matter): every linear and the table the
    file holds, each from its own blocks (Q4_1 layers int4 g32 asymmetric, the Q8_0 table int8),
    dequantizing to gguf's values bit for bit; the tied head is not in the file, so the swap gives it
    the table's blocks."""
    import transformers

    from hloserve.exporter.gguf.checkpoint import hf_config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(ckpt)))
    given = gguf_quant.stored_by_module(model, ckpt, QuantConfig.parse("gguf"))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(given) == (linears - {"lm_head"}) | {"model.embed_tokens"}
    assert given["model.embed_tokens"][1] == gguf_quant.GGUF_SCHEMES["Q8_0"]
    stored, scheme = given["model.layers.17.self_attn.k_proj"]
    assert scheme == gguf_quant.GGUF_SCHEMES["Q4_1"] and stored["qweight"].dtype == torch.uint8
    got = modules.dequantize(stored["qweight"], stored["scale"], stored["min"], 4, 32)
    want = ckpt.tensors["model.layers.17.self_attn.k_proj.weight"].dequantize()   # HF row order (un-permuted)
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(want))


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
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    src = load_source("smollm2-135m-instruct", quantize="gguf")
    entries = [e for e in src.entries if e.name == "decode"]
    manifest = export_artifact(str(tmp_path), entries, source="smollm2 gguf", model=src.model,
                               weight_quant=src.weight_quant)
    down = [w for n, w in manifest.weights.items() if "down_proj" in n and w.quant and w.quant["role"] == "qweight"]
    assert len(down) == 1 and down[0].quant["symmetric"] is False and down[0].quant["scheme"] == "int4"   # Q4_1
    table = [w for n, w in manifest.weights.items() if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert [w.dtype for w in table] == ["i8"]      # the table's Q8_0 blocks once, interleaved, read by the tied head too
    prompt = [1, 504, 3458, 282, 260, 1345, 28, 253, 2114, 1953, 30]
    inputs = pack_step([(prompt, 0, [1])], 16)
    model = load(str(tmp_path), buckets={"num_tokens": [16], "num_seqs": [1], "max_blocks": [1]})
    cache = np.zeros(LLMSpec.from_json(manifest.model["llm"]).kv_cache.concrete_shape(2), np.float32)   # [30, 2, 3, 2, 16, 64]
    got = np.asarray(model.functions["decode"](**inputs, kv_cache=cache)["logits"])
    args = {k: torch.from_numpy(v) for k, v in inputs.items()}
    ref = next(e.module for e in load_source("smollm2-135m-instruct", dtype="float32").entries if e.name == "decode")
    with torch.no_grad():
        want, _ = ref(**args, kv_cache=torch.from_numpy(cache))
    want = want.numpy()
    top = np.abs(want).max()
    diff = np.abs((got - got.mean()) - (want - want.mean()))
    assert diff.max() < 0.06 * top and diff.mean() < 0.01 * top, (diff.max(), diff.mean(), top)
    assert int(got.argmax()) == int(want.argmax())


# -- K-quants: a tiny Llama GGUF whose layers are Q4_K / Q6_K / Q5_0 blocks ----------------------
# HF name (layer i) -> ggml type of layer 0, layer 1. Rows of K-quants are whole super-blocks of 256.
K_LAYERS = {
    "self_attn.q_proj.weight": ("Q4_K", "Q4_K"), "self_attn.k_proj.weight": ("Q4_K", "Q4_K"),
    "self_attn.v_proj.weight": ("Q4_K", "Q4_K"), "self_attn.o_proj.weight": ("Q4_K", "Q4_K"),
    "mlp.gate_proj.weight": ("Q4_K", "Q4_K"),
    "mlp.up_proj.weight": ("Q6_K", "Q6_K"),
    "mlp.down_proj.weight": ("Q6_K", "Q5_0"),    # layer 0 keeps its Q6_K blocks, layer 1's Q5_0 is int8 g32
}
K_EMBED = "Q6_K"


def _k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks uint8 [rows, cols / 256 * size]: every bit random but the f16 scales,
    drawn so the values are ~0.05 in size. Q6_K's first two pairs of sub-blocks get opposite scales
    and a q of -32 in both sub-blocks (the one case that clips) or only in the second."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)      # [rows, nb, size]

    def f16(lo: float, hi: float, signed: bool) -> np.ndarray:
        v = rng.uniform(lo, hi, b.shape[:2]) * (rng.choice([-1.0, 1.0], b.shape[:2]) if signed else 1.0)
        return v.astype(np.float16)[..., None].view(np.uint8)                 # [rows, nb, 2]

    if kind == "Q4_K":
        b[..., 0:2], b[..., 2:4] = f16(5e-5, 2e-4, False), f16(5e-5, 2e-4, False)   # d, dmin
    else:
        b[..., 208:210] = f16(5e-6, 2e-5, True)                                       # d
        # pair 0 (sub-blocks 0, 1): opposite scales and q = -32 in both (elements 0 and 16): one clips
        b[0, 0, 192:194] = np.array([50, -50], np.int8).view(np.uint8)
        b[0, 0, [0, 16]] &= 0xF0                                                      # low 4 bits 0
        b[0, 0, [128, 128 + 16]] &= 0xFC                                              # high 2 bits 0: q = -32
        # pair 1 (sub-blocks 2, 3): opposite scales, q = -32 only in sub-block 3 (element 48): r is its
        b[0, 0, 194:196] = np.array([40, -40], np.int8).view(np.uint8)
        b[0, 0, 128:128 + 16] |= 0x04                                                 # elements 32-47: q >= -16
        b[0, 0, 48] &= 0xF0
        b[0, 0, 128 + 16] &= 0xF3                                                     # element 48: q = -32
    return b.reshape(rows, -1)


def write_k_gguf(path: str, layers: dict[str, tuple[str, ...]] = K_LAYERS) -> str:
    """A tiny Llama GGUF (hidden 256, 4 heads, 2 KV heads, byte-level vocabulary of 258, tied
    embedding; as many layers as `layers` gives types) whose matrices are `layers`'s / K_EMBED's
    blocks; returns path."""
    import transformers

    from tests.exporter.test_gguf import _write_gguf
    n = len(next(iter(layers.values())))
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=256, intermediate_size=256, num_hidden_layers=n,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    rng = np.random.default_rng(0)
    raw = {"model.embed_tokens.weight": (_k_blocks(K_EMBED, 258, 256, rng), K_EMBED)}
    for part, kinds in layers.items():
        for i, kind in enumerate(kinds):
            name = f"model.layers.{i}.{part}"
            rows, cols = state[name].shape
            blocks = (gguf.quants.quantize(state[name], gguf.GGMLQuantizationType[kind]) if kind == "Q5_0"
                      else _k_blocks(kind, rows, cols, rng))
            raw[name] = (blocks, kind)
    _write_gguf(path, "llama", cfg, state, raw=raw)
    return path


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory) -> str:
    return write_k_gguf(str(tmp_path_factory.mktemp("kquant") / "tiny-k.gguf"))


@pytest.fixture(scope="module")
def k_ckpt(k_gguf):
    return load_gguf(k_gguf)


def _k_tensors(ckpt, kind: str) -> list[GGUFTensor]:
    found = [t for t in ckpt.tensors.values() if t.ggml_type == kind]
    assert found, kind
    return found


def test_k_quant_fields_give_gguf_values(k_ckpt):
    """Q4_K / Q6_K block fields (sub-block scales unpacked from 6 bits, bit planes joined) give
    gguf.quants.dequantize bit for bit with the documented formulas; so does Q4_K's f32 scale/min."""
    for t in _k_tensors(k_ckpt, "Q4_K") + _k_tensors(k_ckpt, "Q6_K"):
        f = t.block_fields()
        per = 32 if t.ggml_type == "Q4_K" else 16
        q = f["q"].astype(np.float32).reshape(*f["sc"].shape, per)          # [out, nb, sub, per]
        ds = (f["d"].astype(np.float32)[..., None] * f["sc"].astype(np.float32))[..., None]
        got = ds * q
        if t.ggml_type == "Q4_K":
            got = got - (f["dmin"].astype(np.float32)[..., None] * f["m"].astype(np.float32))[..., None]
            q4, scale, mn = gguf_quant._q4_k(f)                              # as stored with f32 scales
            again = q4.astype(np.float32).reshape(q.shape) * scale[..., None] + mn[..., None]
            np.testing.assert_array_equal(_bits(again.reshape(t.shape)), _bits(t.dequantize()), err_msg=t.name)
        np.testing.assert_array_equal(_bits(got.reshape(t.shape)), _bits(t.dequantize()), err_msg=t.name)


def _dequantized(stored: dict, scheme, shape) -> np.ndarray:
    return primitives.dequantize(primitives.QuantizedArray(stored["qweight"], stored["scale"], stored.get("min"),
                                                           scheme, tuple(shape))).astype(np.float64)


def test_q4_k_import_within_f16_rounding(k_ckpt):
    """Q4_K -> int4 g32 asymmetric, f16 scale and min: q is kept; scale d*sc and min -dmin*m are
    exact in f32 and rounded once to f16 (relative error <= 2^-11; absolute <= 2^-25 below f16's
    normal range). So |ours - gguf| <= 15 e(scale) + e(min), plus one f32 rounding of each side."""
    rounded = False
    for t in _k_tensors(k_ckpt, "Q4_K"):
        stored, scheme = gguf_quant.gguf_blocks(t)
        assert scheme == gguf_quant.GGUF_SCHEMES["Q4_K"] == WeightScheme(4, 32, False, "f16")
        assert stored["scale"].dtype == stored["min"].dtype == np.float16
        ref = t.dequantize().astype(np.float64)
        got = _dequantized(stored, scheme, t.shape)
        f = t.block_fields()
        scale = np.abs(f["d"].astype(np.float64)[..., None] * f["sc"]).reshape(t.shape[0], -1)   # [out, in/32]
        mn = np.abs(f["dmin"].astype(np.float64)[..., None] * f["m"]).reshape(t.shape[0], -1)

        def e(x):
            return np.maximum(x * 2.0**-11, 2.0**-25)

        bound = np.repeat(15 * e(scale) + e(mn), 32, -1) + 2.0**-23 * 2 * np.abs(ref)
        err = np.abs(got - ref)
        assert (err <= bound).all(), (t.name, (err - bound).max())
        rounded |= bool((err > 0).any())
    assert rounded                                      # f16 rounding happened: the bound was tested


def test_q6_k_import_within_half_a_step(k_ckpt):
    """Q6_K -> int8 g32, f32 scale d*r/4 per pair of sub-blocks (r: the pair's scale of larger
    magnitude): the r sub-block is exact (q8 = 4q), the other within scale/2 of gguf's value
    (plus one f32 rounding of each side), one scale where sc = -r and q = -32 clips 128 to 127: only
    when both sub-blocks hold a -32 (else r is taken from the one that does)."""
    for t in _k_tensors(k_ckpt, "Q6_K"):
        stored, scheme = gguf_quant.gguf_blocks(t)
        assert scheme == WeightScheme(8, 32, True, "f32") and stored["scale"].dtype == np.float32
        ref = t.dequantize()
        got = _dequantized(stored, scheme, t.shape)
        f = t.block_fields()
        sc = f["sc"].astype(np.int64).reshape(t.shape[0], -1, 2)             # [out, groups, 2]
        has32 = (f["q"].reshape(t.shape[0], -1, 2, 16) == -32).any(-1)      # [out, groups, 2]
        swap = (sc[..., 1] == -sc[..., 0]) & has32[..., 1] & ~has32[..., 0]  # r from the one with a -32
        first = (np.abs(sc[..., 0]) >= np.abs(sc[..., 1])) & ~swap           # [out, groups]: r is sub-block 0
        exact = np.stack([first, ~first], -1).repeat(16, -1).reshape(t.shape)
        np.testing.assert_array_equal(_bits(got[exact].astype(np.float32)), _bits(ref[exact]), err_msg=t.name)
        step = np.abs(stored["scale"].astype(np.float64)).repeat(32, -1)    # [out, in]
        q = f["q"].reshape(t.shape)
        r = np.where(first, sc[..., 0], sc[..., 1]).repeat(32, -1)
        own = sc.repeat(16, -1).reshape(t.shape)
        clips = (own == -r) & (q == -32) & (r != 0) & ~exact
        err = np.abs(got - ref.astype(np.float64))
        slack = 2.0**-23 * 2 * np.abs(ref)
        assert (err[~clips] <= step[~clips] / 2 + slack[~clips]).all(), t.name
        assert (err[clips] <= step[clips] + slack[clips]).all(), t.name
        assert clips[0, 16] and err[0, 16] > step[0, 16] / 2, t.name        # the planted cases, seen
        assert swap[0, 1] and exact[0, 48] and not clips[0, 32:64].any(), t.name


def test_k_quant_gguf_keeps_its_blocks_per_role(k_gguf, k_ckpt, tmp_path):
    """`--llm-step generic --quantize gguf`: each layer's linears keep their own blocks: q/k/v/o and
    gate Q4_K, up Q6_K (kept as K-quant blocks), down Q6_K in layer 0 and Q5_0 (kept as 5-bit values,
    int5 g32, f16 scales, bit-exact to the file) in layer 1, so the layers differ and the scan's period is 2; the runtime's
    logits equal torch eager of the same quantized step (1e-4; summation order)."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    src = load_source(k_gguf, quantize="gguf", llm_step="generic")
    entries = [e for e in src.entries if e.name == "decode"]
    manifest = export_artifact(str(tmp_path), entries, source="tiny k-quant gguf", model=src.model,
                               weight_quant=src.weight_quant)
    quant = {n: w.quant for n, w in manifest.weights.items() if w.quant and w.quant["role"] == "qweight"}
    want = {"q_proj": ["Q4_K", "Q4_K"], "o_proj": ["Q4_K", "Q4_K"], "gate_proj": ["Q4_K", "Q4_K"],
            "up_proj": ["Q6_K", "Q6_K"], "down_proj": ["Q6_K", "int5"]}
    for role, schemes in want.items():
        found = [q["scheme"] for n, q in sorted(quant.items()) if role in n]
        assert found == schemes, (role, found)
    stacked = dict(entries[0].module.model.named_buffers())          # one stack per layer: [1, ...]
    q, s = (stacked[f"model.layers.stack.1.mlp__down_proj__weight{suffix}"] for suffix in ("", "_scale"))
    rows = modules.rows_in_order(q[0], s[0], None, 5)                 # layer 1 (Q5_0, 5-bit values)
    got = modules.dequantize(*rows, 8, 32).numpy()
    np.testing.assert_array_equal(_bits(got), _bits(k_ckpt.tensors["model.layers.1.mlp.down_proj.weight"].dequantize()))
    prompt = [257, 100, 7, 42, 255, 3, 99]
    inputs = pack_step([(prompt, 0, [1])], 16)
    model = load(str(tmp_path), buckets={"num_tokens": [16], "num_seqs": [1], "max_blocks": [1]})
    cache = np.zeros(LLMSpec.from_json(manifest.model["llm"]).kv_cache.concrete_shape(2), np.float32)
    got = np.asarray(model.functions["decode"](**inputs, kv_cache=cache)["logits"])
    with torch.no_grad():
        ref, _ = entries[0].module(**{k: torch.from_numpy(v) for k, v in inputs.items()},
                                   kv_cache=torch.from_numpy(cache))
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)


def test_a_k_quant_mix_along_the_layers_is_scanned_by_segments(tmp_path):
    """Eight layers whose down matrices are Q6_K where llama.cpp's Q4_K_M gives more bits (layers 0, 3,
    6, 7) and Q4_K elsewhere: no period short of 8 fits, so one scan would trace all eight layers;
    the step is two scans instead (layers 0-5 by a period of 3, 6-7 by 1: four layer bodies, four
    attention calls in the StableHLO, each layer's blocks kept in its stack), and its logits equal
    torch eager of the model's own unrolled layers over the same blocks (1e-4; summation order),
    which also checks that each scanned layer reads and writes its own layer of the cache."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.llm import hf_layers
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load
    from tests.support.kquants import more_bits

    n = 8
    down = tuple("Q6_K" if more_bits(i, n) else "Q4_K" for i in range(n))
    layers = {part: (down if part == "mlp.down_proj.weight" else (kinds[0],) * n) for part, kinds in K_LAYERS.items()}
    src = load_source(write_k_gguf(str(tmp_path / "mix.gguf"), layers), quantize="gguf", llm_step="generic")
    entries = [e for e in src.entries if e.name == "decode"]
    manifest = export_artifact(str(tmp_path / "art"), entries, source="tiny k-quant mix", model=src.model,
                               weight_quant=src.weight_quant)
    assert manifest.model["llm"]["layers"] == "scan (2 segments: layers 0-5 by 3, layers 6-7 by 1)"
    mlir = (tmp_path / "art" / "functions" / "decode.mlir").read_text()
    assert mlir.count('stablehlo.composite "hloserve.paged_attention"') == 4
    blocks = {n: (w.shape[0], w.quant["block"]) for n, w in manifest.weights.items()
              if "down_proj" in n and w.quant and w.quant["role"] == "qweight"}
    assert sorted(blocks.values()) == [(2, "Q4_K"), (2, "Q4_K"), (2, "Q6_K"), (2, "Q6_K")], blocks
    prompt = [257, 100, 7, 42, 255, 3, 99]
    inputs = pack_step([(prompt, 0, [1])], 16)
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [16], "num_seqs": [1], "max_blocks": [1]})
    cache = np.zeros(LLMSpec.from_json(manifest.model["llm"]).kv_cache.concrete_shape(2), np.float32)
    out = model.functions["decode"](**inputs, kv_cache=cache)
    with torch.no_grad(), hf_layers.unrolled(entries[0].module):
        ref, ref_cache = entries[0].module(**{k: torch.from_numpy(v) for k, v in inputs.items()},
                                           kv_cache=torch.from_numpy(cache))
    np.testing.assert_allclose(np.asarray(out["logits"]), ref.numpy(), atol=1e-4, rtol=0)
    # [L, 2, kv heads, blocks, 16, head dim]: block 0 is the null block, which padding rows write here.
    # Each linear quantizes its activations to int8 per 32-element block (Q8_0), so where a sum lies an
    # ulp from a rounding boundary, another summation order (the decomposition's dot, not the kernel's:
    # a CPU without VNNI runs it at 16 rows) moves its code by one, and that step of max|x| / 127 goes on
    # through the later layers' K/V: a bound of 2e-3 of the cache's largest value (0.0027 of 13
    # measured on such a CPU), where a layer reading or writing another's cache is off by its values.
    want_cache = ref_cache.numpy()[:, :, :, 1:]
    np.testing.assert_allclose(np.asarray(out["kv_cache"])[:, :, :, 1:], want_cache,
                               atol=2e-3 * np.abs(want_cache).max(), rtol=0)
    assert (np.abs(ref_cache.numpy()[:, :, :, 1]).max(axis=(1, 2, 3, 4)) > 0).all()     # every layer wrote its K/V


def test_a_gguf_source_leaves_no_temporary_directory(k_gguf, tmp_path, monkeypatch):
    """The Hugging Face directory a GGUF is read through is removed once loaded; the source holds
    its tokenizer files' bytes, which the artifact gets."""
    import tempfile

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    src = load_source(k_gguf, llm_step="generic")
    assert os.listdir(scratch) == []
    assert set(src.files) == {"tokenizer.json", "tokenizer_config.json"}
    entries = [e for e in src.entries if e.name == "decode"]
    manifest = export_artifact(str(tmp_path / "art"), entries, source="tiny k-quant gguf", model=src.model,
                               files=src.files)
    for name, content in src.files.items():
        with open(tmp_path / "art" / name, "rb") as f:
            assert f.read() == content
    assert set(manifest.model["files"]) == set(src.files)
