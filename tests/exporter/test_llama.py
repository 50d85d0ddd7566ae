"""Llama-family step export: parity with Hugging Face transformers through the runtime's paged cache.

Random-init tiny configs (2 layers, hidden 64, f32) of Llama, Mistral and Qwen2
are saved as HF directories, exported through `load_source` (the CLI's path:
sources.hf_directory -> llama_source), loaded with `hloserve.runtime.load`
(buckets + cache donation), and driven by `Paged`, a small test-side block
allocator. Tolerance: logits within 1e-4 (f32, the LLM issue's bound); greedy
generation token-identical for 32 tokens.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hloserve.exporter.models.llama import LlamaConfig, LlamaStep, LlamaWeights
from hloserve.runtime.artifact.llm import STEP_INPUTS, LLMSpec, pack_step

from ..reference import hf_with_mixed_linears

ATOL = 1e-4
BLOCK = 16
NUM_BLOCKS = 40
VOCAB = 256


def _hf_config(arch: str, **extra):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    common.update(extra)
    if arch == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    if arch == "mistral":
        return transformers.MistralConfig(num_key_value_heads=1, **{"sliding_window": None, **common})
    if arch == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    raise ValueError(arch)


def _hf_model(arch: str, seed: int = 0, **extra):
    """Random-init HF model; every parameter (norms and biases too) perturbed so none is trivial."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
            else:
                p.mul_(3.0)   # larger logits: fewer near-ties in greedy decoding
    return model


def _our_weights(hf) -> LlamaWeights:
    d = hf.config.to_dict()
    cfg = LlamaConfig.from_hf(d)
    sd = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    return LlamaWeights.from_hf_tensors(cfg, sd.__getitem__, sd.keys())


class Paged:
    """Test-side driver of the step contract: a free list of blocks (block 0 is the null block),
    a block table per sequence, and the donated cache threaded through every call."""

    def __init__(self, model, num_blocks: int = NUM_BLOCKS):
        import jax.numpy as jnp
        llm = model.manifest.model["llm"]
        self.fns = model.functions
        self.block = llm["block_size"]
        self.cache = jnp.zeros(LLMSpec.from_json(llm).kv_cache.concrete_shape(num_blocks), LLMSpec.from_json(llm).kv_cache.numpy_dtype)
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, fn: str, chunks: dict[int, list[int]]) -> np.ndarray:
        """Append `chunks[seq]` tokens to each listed sequence; returns f32[len(chunks), vocab]."""
        planned = []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block < start + len(toks):
                table.append(self.free.pop())
            planned.append((list(toks), start, list(table)))
            self.lens[sid] = start + len(toks)
        out = self.fns[fn](**pack_step(planned, self.block), kv_cache=self.cache)
        self.cache = out["kv_cache"]
        return np.asarray(out["logits"])


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def exported(request, tmp_path_factory):
    """(arch, HF model, runtime model) for one tiny random-init config, exported via load_source."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load

    arch = request.param
    hf = _hf_model(arch)
    root = tmp_path_factory.mktemp(f"llm-{arch}")
    hf.save_pretrained(str(root / "hf"))
    src = load_source(str(root / "hf"))
    export_artifact(str(root / "art"), src.entries, source=arch, model=src.model)
    return arch, hf, load(str(root / "art"), buckets={"num_tokens": [1, 8, 32, 64, 256], "num_seqs": [1, 8],
                                                     "max_blocks": [8]})


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["prefill", "decode"])
def test_prompt_logits_match_transformers(exported, fn):
    """Prompts of 1, 15, 16, 17, 100 tokens (block 16: contexts end inside, at and past block edges),
    all five in ONE ragged step; both step functions are exact for any mix."""
    arch, hf, model = exported
    lengths = [1, 15, 16, 17, 100]
    prompts = _prompts(lengths)
    paged = Paged(model)
    got = paged.step(fn, dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got[i], want, atol=ATOL, rtol=0, err_msg=f"{arch} {fn} prompt length {len(p)}")


@pytest.mark.slow
def test_chunked_prefill_matches_transformers(exported):
    """A 100-token prompt in chunks of 40, 40, 20 beside a second sequence that joins later."""
    arch, hf, model = exported
    a, b = _prompts([100, 17], seed=2)
    paged = Paged(model)
    paged.step("prefill", {0: a[:40]})
    paged.step("prefill", {0: a[40:80], 1: b})
    got = paged.step("prefill", {0: a[80:]})
    with torch.no_grad():
        want = hf(torch.tensor([a])).logits[0, -1].numpy()
    np.testing.assert_allclose(got[0], want, atol=ATOL, rtol=0, err_msg=f"{arch} chunked prefill")


@pytest.mark.slow
def test_greedy_generation_matches_transformers(exported):
    """Two prompts prefilled together, then 32 batched decode steps: token-identical to HF greedy."""
    arch, hf, model = exported
    prompts = _prompts([15, 17], seed=3)
    paged = Paged(model)
    logits = paged.step("prefill", dict(enumerate(prompts)))
    ours = [[int(np.argmax(row))] for row in logits]
    for _ in range(31):
        logits = paged.step("decode", {i: [ours[i][-1]] for i in range(len(prompts))})
        for i, row in enumerate(logits):
            ours[i].append(int(np.argmax(row)))
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(32):   # eager greedy loop: no eos stop, no generation-config defaults
                nxt = hf(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        assert ours[i] == ids[0, len(p):].tolist(), f"{arch}: greedy tokens differ for prompt {i}"


def test_manifest_describes_the_step(exported):
    arch, hf, model = exported
    m = model.manifest
    assert m.model["task"] == "causal-lm"
    llm = m.model["llm"]
    cfg = hf.config
    assert (llm["num_layers"], llm["num_heads"], llm["num_kv_heads"], llm["head_dim"], llm["vocab_size"]) == (
        2, 4, cfg.num_key_value_heads, 16, VOCAB)
    assert llm["block_size"] == BLOCK and llm["null_block"] == 0 and llm["eos_token_ids"] == [2]
    assert llm["bos_token_id"] == 1 and llm["max_context"] == 512
    for name in ("prefill", "decode"):
        fn = m.functions[name]
        assert [t.name for t in fn.inputs] == list(STEP_INPUTS)
        assert fn.donated == ("kv_cache",)
        shapes = {t.name: list(t.shape) for t in fn.inputs}
        assert shapes["tokens"] == ["num_tokens"] and shapes["block_tables"] == ["num_seqs", "max_blocks"]
        assert shapes["kv_cache"] == [2, 2, cfg.num_key_value_heads, "num_blocks", BLOCK, 16]
        outs = {t.name: (t.dtype, list(t.shape)) for t in fn.outputs}
        assert outs["logits"] == ("f32", ["num_seqs", VOCAB])
        assert set(fn.weights) == set(m.functions["prefill"].weights)   # one shared weight table
    # the decoder layers are one scanned body: a loop in StableHLO, not two copies of a layer
    text = open(os.path.join(model.path, "functions", "decode.mlir")).read()
    assert "stablehlo.while" in text


# -- eager model vs transformers: RoPE variants, sliding window (no export; fast) -------------------
@pytest.mark.parametrize("arch,extra,length", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 100),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), 40),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32), 50),
    ("llama", dict(attention_bias=True, mlp_bias=True), 20),
    ("mistral", dict(sliding_window=8), 40),
])
def test_eager_step_variants_match_transformers(arch, extra, length):
    """The torch step (scanned and unrolled; all three attention layouts) against HF eager, prompt in
    two chunks through the paged cache.

    Dynamic NTK RoPE past max_position_embeddings: ours grows the base from each sequence's context
    length; transformers from the batch's; for one sequence in one prefill they agree.
    """
    hf = _hf_model(arch, **extra)
    w = _our_weights(hf)
    (prompt,) = _prompts([length], seed=4)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    split = 1 if extra.get("rope_scaling", {}).get("rope_type") == "dynamic" else length // 2
    for scan, attention in ((True, "flat"), (False, "flat"), (True, "gather"), (True, "paged")):
        step = LlamaStep(w, attention=attention, scan=scan)
        cache = torch.zeros(2, 2, w.cfg.num_kv_heads, 12, BLOCK, w.cfg.head_dim)   # [L, 2, KV, N, BS, D]
        table = [5, 3, 9, 1, 7, 11, 2][: -(-length // BLOCK)]
        chunks = [(prompt, 0)] if split == 1 else [(prompt[:split], 0), (prompt[split:], split)]
        for toks, start in chunks:
            inp = pack_step([(toks, start, table)], BLOCK, pad_tokens=len(toks) + 3, pad_seqs=2)
            with torch.no_grad():
                logits, cache = step(*[torch.from_numpy(inp[k]) for k in STEP_INPUTS[:-1]], cache)
            np.testing.assert_allclose(logits[0].numpy(), want[start + len(toks) - 1], atol=ATOL, rtol=0,
                                       err_msg=f"{arch} {extra} scan={scan} {attention} chunk at {start}")
            assert torch.isfinite(logits).all(), "padding rows must stay finite (no NaN from masked softmax)"


def test_config_parsing_errors_name_the_fix():
    from hloserve.exporter.errors import SourceError
    base = _hf_config("llama").to_dict()
    with pytest.raises(SourceError, match="rope type 'yarn' is not supported"):
        LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(SourceError, match="not a Llama-family decoder"):
        LlamaConfig.from_hf({**base, "model_type": "gpt2"})
    q = LlamaConfig.from_hf({**_hf_config("qwen2").to_dict(), "attention_bias": True})
    assert q.qkv_bias and not q.o_bias


@pytest.mark.slow
def test_cli_export_bfloat16(tmp_path):
    """`hloserve export HF_DIR -o OUT --dtype bfloat16`: bf16 weights and cache, f32 logits near f32 HF."""
    from hloserve.server.cli import main
    from hloserve.runtime import load
    hf = _hf_model("qwen2", seed=5)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["export", str(tmp_path / "hf"), "-o", str(tmp_path / "art"), "--dtype", "bfloat16", "--llm-step", "llama", "-q"]) == 0
    with open(tmp_path / "art" / "manifest.json") as f:
        manifest = json.load(f)
    # the stacked matrices are stored as their bits in int16 (models/llama.py, BITS_STORAGE)
    assert manifest["weights"]["model.layers.qkv_proj"]["dtype"] == "i16"
    assert manifest["weights"]["model.layers.qkv_proj"]["quant"]["scheme"] == "bf16"
    assert manifest["weights"]["model.embed_tokens"]["dtype"] == "bf16"
    assert manifest["model"]["llm"]["kv_cache"]["dtype"] == "bf16"
    model = load(str(tmp_path / "art"))
    import jax.numpy as jnp
    llm = manifest["model"]["llm"]
    cache = jnp.zeros(LLMSpec.from_json(llm).kv_cache.concrete_shape(8), jnp.bfloat16)
    (prompt,) = _prompts([20], seed=6)
    out = model.functions["prefill"](**pack_step([(prompt, 0, [1, 2])], BLOCK), kv_cache=cache)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    got = np.asarray(out["logits"])[0]
    assert got.dtype == np.float32
    # bf16 has 8 mantissa bits: compare relative to the logit scale
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), (np.abs(got - want).max(), np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cli_export_bf16_weights(tmp_path, arch):
    """`--weight-dtype bfloat16`: bf16 matrices (stacked ones as int16 bits), f32 norms, activations
    and KV cache. Logits match transformers computing its Linears the same way (inputs and weights
    rounded to bf16, f32 sums) and plain f32 transformers within 2%; a two-chunk prompt and greedy
    decode agree with the first.

    The bound against the rounded reference follows from what XLA:CPU's bf16 dot paths may do: the
    products of bf16 values are exact in f32, so a path that sums in f32 differs by reordering only
    (~1e-7 of the logit scale on an AMD EPYC); a path that rounds a dot's result to bf16 (observed on an
    Intel Xeon with AMX: 2.0e-3 of the scale, i.e. one rounding of the LM head's output, unit roundoff
    2^-9) adds at most 2^-9 of the largest logit from the head, plus as much again propagated from the
    rounded hidden states. So: 2^-8 of the logit scale."""
    from hloserve.server.cli import main
    from hloserve.runtime import load
    hf = _hf_model(arch, seed=5)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["export", str(tmp_path / "hf"), "-o", str(tmp_path / "art"), "--llm-step", "llama", "--weight-dtype", "bfloat16",
                 "-q"]) == 0
    with open(tmp_path / "art" / "manifest.json") as f:
        manifest = json.load(f)
    weights = manifest["weights"]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert weights[f"model.layers.{name}"]["dtype"] == "i16"
        assert weights[f"model.layers.{name}"]["quant"]["scheme"] == "bf16"
    assert weights["model.embed_tokens"]["dtype"] == "bf16" and "quant" not in weights["model.embed_tokens"]
    assert weights["model.layers.input_layernorm"]["dtype"] == "f32" and weights["model.norm"]["dtype"] == "f32"
    assert manifest["model"]["weight_dtype"] == "bf16"
    assert manifest["model"]["llm"]["kv_cache"]["dtype"] == "f32"
    # half the bytes of the f32 matrices
    f32_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert os.path.getsize(tmp_path / "art" / "weights.safetensors") < 0.6 * f32_bytes

    model = load(str(tmp_path / "art"), buckets={"num_tokens": [1, 8, 32], "num_seqs": [1, 8], "max_blocks": [8]})
    (prompt,) = _prompts([21], seed=6)
    with torch.no_grad():
        f32_logits = hf(torch.tensor([prompt])).logits[0].numpy()
        want = hf_with_mixed_linears(hf)(torch.tensor([prompt])).logits[0].numpy()
    scale = np.abs(want).max()
    paged = Paged(model)
    got = np.concatenate([paged.step("prefill", {0: prompt[:13]}), paged.step("decode", {0: prompt[13:14]}),
                          paged.step("prefill", {0: prompt[14:]})])
    for row, pos in zip(got, (12, 13, 20)):
        assert np.abs(row - want[pos]).max() < 2.0 ** -8 * scale, (pos, np.abs(row - want[pos]).max(), scale)
        assert np.abs(row - f32_logits[pos]).max() < 0.02 * scale
    # greedy continuation: token-identical to the hooked transformers model
    ids = list(prompt)
    tok = int(np.argmax(got[-1]))
    for _ in range(8):
        ids.append(tok)
        with torch.no_grad():
            ref = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
        tok = int(np.argmax(paged.step("decode", {0: [ids[-1]]})[0]))
        assert tok == ref


@pytest.mark.slow
def test_cli_export_bf16_kv_cache(tmp_path, capsys):
    """`--weight-dtype bfloat16 --kv-cache-dtype bfloat16`: the cache is int16 holding bf16 K/V.
    Through the runtime, a chunked prompt and decodes match our torch step eager on the same
    weights and kv_dtype within 1e-4 of the logit scale, and transformers with the same
    roundings (K rounded before RoPE there) within 1e-2; greedy decoding agrees with the eager step."""
    from hloserve.server.cli import main
    from hloserve.exporter.models.llama_source import from_hf_directory
    from hloserve.runtime import load
    hf = _hf_model("llama", seed=7)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["export", str(tmp_path / "hf"), "-o", str(tmp_path / "art"), "--llm-step", "llama", "--weight-dtype", "bfloat16",
                 "--kv-cache-dtype", "bfloat16", "-q"]) == 0
    with open(tmp_path / "art" / "manifest.json") as f:
        kv = json.load(f)["model"]["llm"]["kv_cache"]
    assert kv["dtype"] == "i16" and kv["holds"] == "bf16"
    assert main(["inspect", str(tmp_path / "art")]) == 0
    shown = capsys.readouterr().out
    assert ", 4 stored as bf16" in shown and "kv cache: i16 holding bf16 bits" in shown
    model = load(str(tmp_path / "art"), buckets={"num_tokens": [1, 8, 32], "num_seqs": [1, 8], "max_blocks": [8]})
    eager = from_hf_directory(str(tmp_path / "hf"), weight_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    step = eager.entries[0].module                                         # LlamaStep, flat layout
    assert step.kv_dtype == torch.bfloat16 and step.model.bits_dtype == torch.bfloat16
    (prompt,) = _prompts([21], seed=8)
    with torch.no_grad():
        want = hf_with_mixed_linears(hf, kv_dtype=torch.bfloat16)(torch.tensor([prompt])).logits[0].numpy()
    scale = np.abs(want).max()
    paged, cache = Paged(model), torch.zeros(LLMSpec.from_json(model.manifest.model["llm"]).kv_cache.concrete_shape(NUM_BLOCKS), dtype=torch.int16)

    def eager_step(chunk):
        nonlocal cache
        inp = pack_step([chunk], BLOCK)
        with torch.no_grad():
            logits, cache = step(*[torch.from_numpy(inp[k]) for k in STEP_INPUTS[:-1]], cache)
        return logits[0].numpy()

    ids = list(prompt)
    for fn, lo, hi in (("prefill", 0, 13), ("decode", 13, 14), ("prefill", 14, 21)):
        got = paged.step(fn, {0: ids[lo:hi]})[0]
        ref = eager_step((ids[lo:hi], lo, paged.tables[0]))
        assert np.abs(got - ref).max() < 1e-4 * scale, (fn, np.abs(got - ref).max(), scale)
        assert np.abs(got - want[hi - 1]).max() < 1e-2 * scale
    for _ in range(6):
        ids.append(int(np.argmax(got)))
        got = paged.step("decode", {0: ids[-1:]})[0]
        ref = eager_step((ids[-1:], len(ids) - 1, paged.tables[0]))
        assert int(np.argmax(got)) == int(np.argmax(ref))


def test_weight_dtype_errors_name_the_fix(tmp_path, capsys):
    """--weight-dtype is for LLM step exports, not with --quantize, and must be a float dtype."""
    from hloserve.server.cli import main
    art = str(tmp_path / "art")
    assert main(["export", "smollm2-135m-instruct", "-o", art, "--weight-dtype", "bfloat16", "--quantize", "int8"]) == 1
    assert "--weight-dtype and --quantize both choose how weights are stored" in capsys.readouterr().err
    assert main(["export", "smollm2-135m-instruct", "-o", art, "--weight-dtype", "int8"]) == 1
    assert "--weight-dtype 'int8' is not supported" in capsys.readouterr().err
    assert main(["export", "tests.exporter.factories:mlp", "-o", art, "--weight-dtype", "bfloat16"]) == 1
    assert "--weight-dtype, --kv-cache-dtype and --llm-step apply to LLMs exported as step functions" in capsys.readouterr().err
    assert not os.path.exists(art)


@pytest.mark.slow
def test_paged_attention_exports_as_nested_loop(tmp_path):
    """The "paged" layout (a loop over blocks inside the layer loop) through export and the runtime:
    two sequences, one chunked, match HF; the StableHLO has the nested while."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.models.llama import llm_spec, step_entries
    from hloserve.exporter.models.step import StepExportOptions
    from hloserve.runtime import load
    hf = _hf_model("llama", seed=7)
    w = _our_weights(hf)
    opts = StepExportOptions(max_context=512, functions=(("paged", "paged"),))
    export_artifact(str(tmp_path / "art"), step_entries(w, opts), source="test",
                    model={"task": "causal-lm", "llm": llm_spec(w.cfg, opts, torch.float32).to_json()})
    assert open(tmp_path / "art" / "functions" / "paged.mlir").read().count("stablehlo.while") == 2
    paged = Paged(load(str(tmp_path / "art")))
    a, b = _prompts([40, 9], seed=8)
    paged.step("paged", {0: a[:23], 1: b})
    got = paged.step("paged", {0: a[23:], 1: [7]})
    with torch.no_grad():
        want_a = hf(torch.tensor([a])).logits[0, -1].numpy()
        want_b = hf(torch.tensor([b + [7]])).logits[0, -1].numpy()
    np.testing.assert_allclose(got[0], want_a, atol=ATOL, rtol=0)
    np.testing.assert_allclose(got[1], want_b, atol=ATOL, rtol=0)
