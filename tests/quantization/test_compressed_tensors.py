"""compressed-tensors checkpoints (llm-compressor's format) exported with their integers and scales
kept (exporter/compressed_tensors), against compressed-tensors' own decompression and transformers
loading the same checkpoint.

The checkpoints are made here from a tiny bf16 Llama by compressed-tensors' compressor, as
llm-compressor makes them (tests/support/ct_checkpoints.py): W4A16 (group 128, symmetric), int4
asymmetric (group 32 and per channel, zero points packed), W8A16 (per channel and group 32, packed
into int32) and W8A8 (int-quantized, dynamic per-token activations).

  * Kept as stored: every quantized module's integers equal compressed-tensors' unpacked ones, and
    its stored weight dequantized in float32 (hloserve's arithmetic) equals compressed-tensors'
    float32 decompression bit for bit. Nothing is requantized.
  * Exported: last-token logits of the artifact (prefill and decode, each a step of 64 rows: the
    bucket) against transformers with the same weights whose quantized linears round their input and
    weight as the `hloserve.quant_linear` contract does at that row count (version 6 from 64 rows:
    both to bf16): only summation order differs, which can flip a rounding to bf16 (one element
    moved by 2^-8 of itself). Within 3e-2, where the activation rounding itself moves the logits
    (largest ~3) by 0.03-0.05 and a wrong weight by far more.
  * Against transformers loading the checkpoint as it is (float activations; W8A8's per-token int8):
    hloserve's activation rounding (per element <= max|x_block| / 254, ~0.4% of a block's largest
    value) through 14 quantized linears: within 5% of the largest logit, 1.5% on average. (transformers
    5.24 with compressed-tensors 0.20 cannot load asymmetric pack-quantized checkpoints: the zero points
    it allocates are unpacked. For those the reference is transformers with compressed-tensors'
    decompressed weights.)
  * Refused schemes: one line naming the field, its value and what is supported; the CLI exits 1.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from hloserve.exporter.compressed_tensors.checkpoint import open_checkpoint
from hloserve.quantization import modules
from hloserve.quantization.schemes import QuantConfig, QuantizationError
from tests.exporter.step_driver import Paged, prompts
from tests.support.ct_checkpoints import SCHEMES, make_checkpoint, tiny_llama

pytest.importorskip("compressed_tensors")

# scheme -> (bits, hloserve group: None = one scale per row, symmetric); the layers' inputs are 128 or 256 wide
EXPECTED = {"w4a16": (4, 128, True), "w4a16_g64": (4, 64, True), "w4a16_asym_g32": (4, 32, False), "w4a16_asym_channel": (4, "in", False),
            "w8a16": (8, None, True), "w8a16_g32": (8, 32, True), "w8a8": (8, None, True)}
TRANSFORMERS_LOADS = ("w4a16", "w4a16_g64", "w8a16", "w8a16_g32", "w8a8")        # see the module docstring
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ct"))
    return {name: make_checkpoint(root, name) for name in SCHEMES}


def _quant_config(path: str):
    from compressed_tensors.quantization import QuantizationConfig
    with open(os.path.join(path, "config.json")) as f:
        return QuantizationConfig.model_validate(json.load(f)["quantization_config"])


def _skeleton(path: str):
    """transformers' model of the checkpoint on the meta device (its module names and classes)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _ct_decompressed(path: str) -> dict[str, torch.Tensor]:
    """module -> its float32 weight as compressed-tensors' own compressor decompresses it (scales widened
    to float32 first, so the arithmetic is float32's)."""
    from compressed_tensors.compressors import BaseCompressor
    qc, ckpt = _quant_config(path), open_checkpoint(path)
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    out = {}
    for name, parts in ckpt.quantized.items():
        sd = {part: ckpt.tensor(t) for part, t in parts.items()}
        sd["weight_scale"] = sd["weight_scale"].float()
        out[name] = compressor.decompress(sd, scheme)["weight"].float()
    return out


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_integers_and_scales_are_kept(made, scheme):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    path = made[scheme]
    ckpt = open_checkpoint(path)
    given = ckpt.stored_by_module(_skeleton(path), QuantConfig.parse("int8"))
    assert len(given) == 14 and "lm_head" not in given                        # 7 linears x 2 layers; head ignored
    want = _ct_decompressed(path)
    bits, group, symmetric = EXPECTED[scheme]
    for name, (stored, s) in given.items():
        n_in = want[name].shape[1]
        assert (s.bits, s.group, s.symmetric) == (bits, n_in if group == "in" else group, symmetric), (name, s)
        assert stored["qweight"].dtype == (torch.uint8 if bits == 4 else torch.int8)
        got = modules.dequantize(stored["qweight"], stored["scale"], stored.get("min"), s.bits, s.group or 0)
        assert torch.equal(got.view(torch.int32), want[name].view(torch.int32)), name       # bit for bit
        parts = ckpt.quantized[name]
        if "weight_packed" in parts:   # the integers themselves, not only their products
            ct_q = unpack_from_int32(ckpt.tensor(parts["weight_packed"]), bits, torch.Size(want[name].shape))
        else:
            ct_q = ckpt.tensor(parts["weight"])
        ours = modules.unpack_int4(stored["qweight"], signed=symmetric) if bits == 4 else stored["qweight"]
        assert torch.equal(ours.to(torch.int16), ct_q.to(torch.int16) + (0 if symmetric else 8)), name


@pytest.mark.parametrize("symmetric", [True, False])
def test_ragged_groups_keep_every_scale(symmetric):
    """Input dim 96 with group_size 64 (older compressed-tensors wrote a short last group): stored as
    groups of 32, each scale (and zero point) repeated for the groups it covers; values exact."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from hloserve.exporter.compressed_tensors.checkpoint import convert
    from hloserve.exporter.compressed_tensors.config import WeightArgs

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (16, 96), generator=g, dtype=torch.int8)
    scale = (torch.rand(16, 2, generator=g) + 0.5).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (16, 2), generator=g, dtype=torch.int8)
    t = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale}
    if not symmetric:
        t["weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    stored, s = convert(t, WeightArgs("g", 4, symmetric, "group", 64, "pack-quantized"), (16, 96), "w")
    assert (s.group, s.symmetric) == (32, symmetric) and stored["scale"].shape == (16, 3)
    cols = torch.arange(96) // 64                                                  # each element's own group
    z = 0 if symmetric else zero.float()[:, cols]
    want = (q.float() - z) * scale.float()[:, cols]
    tt = {r: torch.from_numpy(a) for r, a in stored.items()}
    got = modules.dequantize(tt["qweight"], tt["scale"], tt.get("min"), 4, 32)
    assert torch.equal(got, want)


def _reference(path: str, scheme: str, *, contract: bool):
    """transformers' Llama in float32 with the quantized linears' weights as compressed-tensors decompresses
    them; `contract`: each of those linears rounds its input and weight as the quant_linear contract
    (version 6) does at the tests' step of 64 rows (bf16_rows or more): both to bf16, or, where this
    CPU's kernels raise bf16_rows (tests/support/quant_contract.py), its input quantized per 32-element
    block as version 2's product does."""
    from hloserve.quantization.modules import quantize_blocks
    from tests.support.quant_contract import step_rows
    import transformers
    ckpt = open_checkpoint(path)
    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    state = {n: t.float() for n, t in ckpt.float_state_dict(torch.float32).items()}
    state.update({f"{n}.weight": w for n, w in _ct_decompressed(path).items()})
    model = transformers.LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state,
                                                          dtype=torch.float32).eval()
    if contract and step_rows(64) == 0:
        for name in ckpt.quantized:
            model.get_submodule(name).register_forward_pre_hook(lambda m, args: (quantize_blocks(args[0].float()),))
    elif contract:
        for name in ckpt.quantized:
            linear = model.get_submodule(name)
            with torch.no_grad():
                linear.weight.copy_(linear.weight.bfloat16().float())
            linear.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().to(args[0].dtype),))
    return model


def _transformers_load(path: str):
    """transformers loading the compressed-tensors checkpoint itself (float32); it decompresses the
    weights on the model's first forward."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1]]))
    return model


def _last_logits(model, ref, fn: str, lengths=(1, 17, 40)):
    ps = prompts(list(lengths))
    got = Paged(model).step(fn, dict(enumerate(ps)))
    with torch.no_grad():
        want = np.stack([ref(torch.tensor([p])).logits[0, -1].float().numpy() for p in ps])
    return got, want


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym_g32", "w8a16_g32", "w8a8"])
def test_export_matches_transformers(made, scheme, tmp_path):
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    path = made[scheme]
    src = load_source(path)
    assert "compressed-tensors" in src.description and src.model["quantization"]["checkpoint"]["modules"] == 14
    export_artifact(str(tmp_path / "art"), src.entries, source=scheme, model=src.model, weight_quant=src.weight_quant)
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [64], "num_seqs": [8], "max_blocks": [8]})
    ints = {n: w for n, w in model.manifest.weights.items() if w.dtype in ("i8", "u8")}
    assert len(ints) == 7 and all(w.quant["role"] == "qweight" and w.quant["shape"][0] == 2 for w in ints.values())
    bits, _, symmetric = EXPECTED[scheme]
    assert {(w.quant["scheme"], w.quant["symmetric"]) for w in ints.values()} == {(f"int{bits}", symmetric)}
    contract = _reference(path, scheme, contract=True)
    plain = _transformers_load(path) if scheme in TRANSFORMERS_LOADS else _reference(path, scheme, contract=False)
    for fn in ("prefill", "decode"):
        got, want = _last_logits(model, contract, fn)
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=0, err_msg=f"{scheme} {fn}")
        got, want = _last_logits(model, plain, fn)
        top, diff = np.abs(want).max(), np.abs(got - want)
        assert diff.max() < 0.05 * top and diff.mean() < 0.015 * top, (scheme, fn, diff.max(), diff.mean(), top)


def test_cli_export_keeps_the_layers_and_the_rest_in_bf16(made, tmp_path):
    """`hloserve export DIR` (no flags; --dtype auto): the bf16 checkpoint's int4 layers kept, its float
    embedding and head stored in bf16 (the head as int16 bits) under float32 activations, the KV cache bf16; the
    decode step runs, within the bound against transformers above."""
    from hloserve.runtime import load
    from hloserve.server.cli import main

    out = str(tmp_path / "art")
    assert main(["export", made["w4a16"], "-o", out, "--function", "decode", "-q"]) == 0
    model = load(out, buckets={"num_tokens": [64], "num_seqs": [8], "max_blocks": [8]})
    weights = model.manifest.weights
    assert model.manifest.model["quantization"]["spec"] == "compressed-tensors"
    table = {n.rsplit(".", 2)[-2]: w.dtype for n, w in weights.items() if n.endswith(("embed_tokens.weight",
                                                                                       "lm_head.weight"))}
    assert table == {"embed_tokens": "bf16", "lm_head": "i16"}, table      # the head: a LayerLinear's int16 bits
    assert sorted({w.quant["scheme"] for w in weights.values() if w.quant}) == ["int4"]
    got, want = _last_logits(model, _transformers_load(made["w4a16"]), "decode")
    top, diff = np.abs(want).max(), np.abs(got - want)
    assert diff.max() < 0.05 * top and diff.mean() < 0.015 * top, (diff.max(), diff.mean(), top)


def test_a_tied_table_is_stored_once_in_int8(tmp_path):
    """A W4A16 checkpoint whose head is tied to its embedding (SmolLM2's layout; llm-compressor leaves
    both 16-bit): `hloserve export DIR` stores the table once, int8 with a scale per row, interleaved for
    the head's kernel, the lookups gathering from it; --keep-16bit-embedding keeps the bf16 table (the
    head reading it as int16 bits). Both within the bound against transformers above; the flag with
    --quantize, or on a checkpoint that is not compressed-tensors, is refused in one line."""
    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load
    from hloserve.server.cli import main

    path = make_checkpoint(str(tmp_path), "w4a16", model=tiny_llama(tied=True))
    want = None
    for flags, table in (([], [("i8", None, 16)]), (["--keep-16bit-embedding"], [("bf16", None, None)])):
        out = str(tmp_path / f"art{len(flags)}")
        assert main(["export", path, "-o", out, "--function", "decode", "-q", *flags]) == 0
        model = load(out, buckets={"num_tokens": [64], "num_seqs": [8], "max_blocks": [8]})
        weights = model.manifest.weights
        got_table = [(w.dtype, *((w.quant["group"], w.quant["rows"]) if w.quant else (None, None)))
                     for n, w in weights.items() if n.endswith(("embed_tokens.weight", "lm_head.weight", "embedding.weight"))]
        assert got_table == table, got_table
        want = _transformers_load(path) if want is None else want
        got, ref = _last_logits(model, want, "decode")
        top, diff = np.abs(ref).max(), np.abs(got - ref)
        assert diff.max() < 0.05 * top and diff.mean() < 0.015 * top, (flags, diff.max(), diff.mean(), top)
    with pytest.raises(SourceError, match="applies without --quantize"):
        load_source(path, quantize="int8", keep_16bit_embedding=True)
    with pytest.raises(SourceError, match="applies to compressed-tensors checkpoints"):
        load_source(str(tmp_path), keep_16bit_embedding=True)


def test_transformers_reads_the_same_weights(made):
    """The references agree: transformers' own load of a checkpoint holds compressed-tensors' decompressed
    weights (what the tests above compare hloserve's stored integers with)."""
    for scheme in TRANSFORMERS_LOADS:
        model, want = _transformers_load(made[scheme]), _ct_decompressed(made[scheme])
        for name, w in want.items():
            assert torch.equal(model.get_submodule(name).weight.float(), w), (scheme, name)


# -- refused ------------------------------------------------------------------------------------------
def _edited(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _group(qc):
    return qc["config_groups"]["group_0"]


REFUSED = [
    ("fp8", lambda qc: _group(qc)["weights"].update(type="float", num_bits=8), "weights.type is 'float'"),
    ("nvfp4", lambda qc: [g.update(format="nvfp4-pack-quantized") for g in (qc, _group(qc))],
     "format is 'nvfp4-pack-quantized'"),
    ("w2", lambda qc: _group(qc)["weights"].update(num_bits=2), "weights.num_bits is 2"),
    ("w8_asym", lambda qc: _group(qc)["weights"].update(num_bits=8, symmetric=False), "weights.symmetric is False"),
    ("block", lambda qc: _group(qc)["weights"].update(strategy="block", block_structure=[128, 128]),
     "weights.strategy is 'block'"),
    ("actorder", lambda qc: _group(qc)["weights"].update(actorder="group"), "weights.actorder is 'group'"),
    ("static_acts", lambda qc: _group(qc).update(input_activations={"num_bits": 8, "type": "int", "dynamic": False,
                                                                   "strategy": "tensor"}),
     "input_activations.dynamic is False"),
    ("fp8_acts", lambda qc: _group(qc).update(input_activations={"num_bits": 8, "type": "float", "dynamic": True}),
     "input_activations is 'float8'"),
    ("sparse", lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparsity_config.format is 'sparse-24-bitmask'"),
    ("kv_cache", lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme is set"),
    ("frozen", lambda qc: qc.update(quantization_status="frozen"), "quantization_status is 'frozen'"),
]


@pytest.mark.parametrize("name,edit,fragment", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_schemes_are_refused_in_one_line(made, tmp_path, name, edit, fragment):
    from hloserve.exporter.sources import load_source
    path = _edited(made["w4a16"], str(tmp_path / name), edit)
    with pytest.raises(QuantizationError) as e:
        load_source(path)
    msg = str(e.value)
    assert fragment in msg and ("supported" in msg or name == "frozen") and "\n" not in msg, msg


def test_a_g_idx_tensor_is_refused(made, tmp_path):
    """An activation-order permutation (GPTQ's actorder group) in the files, whatever the config says."""
    from safetensors.torch import save_file

    from hloserve.exporter.sources import load_source
    path = str(tmp_path / "gidx")
    shutil.copytree(made["w4a16"], path)
    save_file({"model.layers.0.mlp.up_proj.weight_g_idx": torch.zeros(128, dtype=torch.int32)},
              os.path.join(path, "extra.safetensors"))
    with pytest.raises(QuantizationError, match=r"weight_g_idx is an activation-order permutation .*supported"):
        load_source(path)


def test_cli_refuses_a_scheme_in_one_line(made, tmp_path):
    """`hloserve export DIR` of an fp8 checkpoint: exit 1, one line naming the field and what is
    supported, and no artifact directory left behind."""
    path = _edited(made["w4a16"], str(tmp_path / "fp8"), REFUSED[0][1])
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "export", path, "-o", str(out), "-q"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "config_groups.group_0.weights.type is 'float'" in lines[0] and "supported: int4" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("scheme,bound", [("w4a16_g64", 0.35), ("w8a8", 0.55)])
def test_smollm2_perplexity_matches_transformers(scheme, bound, tmp_path):
    """A real model: SmolLM2-135M-Instruct (the GGUF preset's weights, dequantized, in bf16) made W4A16 by
    compressed-tensors with groups of 64 (128 does not divide its hidden size 576), or W8A8, exported
    with no flag: its own layers kept, the tied embedding and head (left 16-bit by llm-compressor)
    stored once in int8 with a scale per row. Perplexity of the first 4 windows of 256 tokens of
    tests/data/web_genesis.txt through the artifact's decode (each window from an empty context, every
    position scored in one step) within 1% of transformers' with the checkpoint's weights (its bf16
    table, float activations), and no worse than transformers' own W8A8 forward (int8 activations per
    token, coarser than hloserve's blocks of 32); the artifact's weights at most 0.35x of the model's
    bf16 bytes for W4A16 (issue #40).

    Four windows, not one: a window's perplexity moves by up to 1.6% either way with the order of the
    f32 sums alone. Kernel and decomposition agree per call to ~1e-6 (the contract's "any
    association"), but every quantized linear rounds its input to int8, so a last-bit difference flips
    some roundings and 30 layers carry that on: W4A16, first window, 8.90 with this CPU's kernels,
    9.03 with quant_linear's decomposition, 9.00 with paged attention's, transformers 9.05; over the
    4 windows -0.5% to +0.4% of transformers' on every such path, the kernels built for cooperlake
    included (Xeon with AMX, 2026-11-29)."""
    import tokenizers
    import transformers

    from hloserve.exporter import presets
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.gguf.checkpoint import load_gguf, write_hf_directory
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load
    from hloserve.runtime.artifact.llm import LLMSpec, pack_step
    from hloserve.runtime.progress import QUIET

    gg = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    hf_dir = write_hf_directory(gg, str(tmp_path / "hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(None, config=transformers.AutoConfig.from_pretrained(hf_dir),
                                                       state_dict=gg.materialize(QUIET), dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in hf.parameters())                        # the tied table once
    path = make_checkpoint(str(tmp_path), scheme, model=hf.eval())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(hf_dir, f), path)
    src = load_source(path, weight_dtype="bfloat16", kv_cache_dtype="bfloat16")   # what `hloserve export DIR` does
    export_artifact(str(tmp_path / "art"), [e for e in src.entries if e.name == "decode"], source=f"smollm2 {scheme}",
                    model=src.model, files=src.files, weight_quant=src.weight_quant)
    with open(os.path.join(REPO, "tests", "data", "web_genesis.txt")) as f:
        ids = tokenizers.Tokenizer.from_str(gg.tokenizer_json).encode(f.read()).ids
    windows = [ids[i * 256:(i + 1) * 256] for i in range(4)]
    art = load(str(tmp_path / "art"), buckets={"num_tokens": [256], "num_seqs": [256], "max_blocks": [16]})
    spec = LLMSpec.from_json(art.manifest.model["llm"])
    table = list(range(1, 17))                       # one block table; token i is the last of its own "sequence"
    refs = {"transformers": _transformers_load(path)}
    if scheme == "w8a8":   # transformers' W8A8 forward quantizes activations per token; the same weights without that
        refs["float activations"] = _reference(path, scheme, contract=False)
    ours, nll = [], {k: [] for k in refs}
    for w in windows:
        inputs = pack_step([([t], i, table) for i, t in enumerate(w)], spec.block_size)
        cache = np.zeros(spec.kv_cache.concrete_shape(17), spec.kv_cache.numpy_dtype)
        ours.append(_nll(np.asarray(art.functions["decode"](**inputs, kv_cache=cache)["logits"], np.float64), w))
        with torch.no_grad():
            for k, m in refs.items():
                nll[k].append(_nll(m(torch.tensor([w])).logits[0].double().numpy(), w))
    theirs = {k: float(np.exp(np.concatenate(v).mean())) for k, v in nll.items()}
    ppl = float(np.exp(np.concatenate(ours).mean()))
    size = os.path.getsize(tmp_path / "art" / "weights.safetensors") / (2 * n_params)
    print(f"SmolLM2 {scheme} + int8 table: perplexity {ppl:.4f} ({theirs}), weights {size:.3f}x of bf16")
    # against the checkpoint's weights with float activations: hloserve's int8 activations (per block of
    # 32) and its int8 table cost < 1%. W8A8's own per-token int8 activations cost more (measured +3.5%)
    # than hloserve's finer blocks: never worse than transformers' W8A8 forward
    assert abs(ppl / theirs.get("float activations", theirs["transformers"]) - 1) < 0.01, (ppl, theirs)
    assert ppl < 1.01 * theirs["transformers"], (ppl, theirs)
    # no float matrix is stored (norms are): the checkpoint's layers and the one int8 table
    weights = art.manifest.weights
    assert all(w.quant for w in weights.values() if np.prod(w.shape) > 65536 and w.dtype not in ("i8", "u8")) and \
        all(w.quant for w in weights.values() if w.dtype in ("i8", "u8")), \
        {n: (w.dtype, w.shape) for n, w in weights.items() if not w.quant}
    tables = [w for n, w in weights.items() if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert [(w.dtype, w.quant["group"], w.quant["rows"]) for w in tables] == [("i8", None, 16)], tables
    # W4A16: 0.21x for the layers (int4 g64, f16 scales), 0.106x for the table (int8, an f32 scale per row)
    assert size <= bound, size


def _nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """Negative log-likelihoods of ids[1:] under logits[:-1] ([T, V], float64)."""
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), ids[1:]]
