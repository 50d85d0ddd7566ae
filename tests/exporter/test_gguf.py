"""GGUF loading (exporter/gguf/checkpoint.py) on the real SmolLM2-135M-Instruct Q4_1 file.

References: the gguf package's own dequantization (bit-exact), transformers' GGUF loader (same file,
its own q/k un-permutation; exact) and transformers' GGUF tokenizer (identical ids, text, template).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

STRINGS = [
    "Hello world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "naïve café — ünïcödé, 日本語のテキスト, emoji 🤗🚀",
    "def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "don't we'll they've I'M",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name 3 colors."},
     {"role": "assistant", "content": "Red, green, blue."}, {"role": "user", "content": "Two more?"}],
]


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    from hloserve.exporter import presets
    return presets.resolve("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="module")
def ckpt(smollm2_gguf):
    from hloserve.exporter.gguf.checkpoint import load_gguf
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    import gguf
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf),
                                                      gguf_file=os.path.basename(smollm2_gguf))


def test_config_matches_transformers(ckpt, smollm2_gguf):
    import transformers
    ref = transformers.AutoConfig.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    c = ckpt.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert c[key] == getattr(ref, key), key
    assert c["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert c["rope_scaling"] is None and ref.rope_parameters["rope_type"] == "default"
    assert c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"]
    # SmolLM2-135M's published config (HuggingFaceTB/SmolLM2-135M-Instruct/config.json)
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (576, 30, 9, 3)
    assert ckpt.special_tokens.bos_token == "<|im_start|>" and ckpt.special_tokens.eos_token == "<|im_end|>"
    assert not ckpt.special_tokens.add_bos_token


def test_hf_names(ckpt):
    names = set(ckpt.tensors)
    assert len(names) == 2 + 30 * 9  # embed, final norm, 9 per layer; tied: no lm_head
    assert "lm_head.weight" not in names
    for suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        assert f"model.layers.29.{suffix}.weight" in names
    q = ckpt.tensors["model.layers.3.self_attn.q_proj.weight"]
    assert (q.gguf_name, q.ggml_type, q.shape, q.block_size, q.type_size) == ("blk.3.attn_q.weight", "Q4_1", (576, 576), 32, 20)
    e = ckpt.tensors["model.embed_tokens.weight"]
    assert (e.ggml_type, e.shape, e.blocks().shape) == ("Q8_0", (49152, 576), (49152, 18, 34))


def test_dequantize_is_gguf_package_bit_exact(ckpt, reader):
    """Every tensor equals gguf.quants.dequantize of the file's data (rows reordered for q/k only)."""
    import gguf
    from hloserve.runtime.progress import QUIET
    weights = ckpt.materialize(reporter=QUIET)
    by_gguf = {t.gguf_name: name for name, t in ckpt.tensors.items()}
    permuted = 0
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = weights[by_gguf[t.name]].numpy()
        assert got.dtype == np.float32 and got.shape == want.shape, t.name
        if ".attn_q." in t.name or ".attn_k." in t.name:
            perm = ckpt.tensors[by_gguf[t.name]].row_perm
            assert sorted(perm.tolist()) == list(range(want.shape[0]))
            want = want[perm]
            permuted += 1
        np.testing.assert_array_equal(got, want, err_msg=t.name)
    assert permuted == 60


def test_blocks_are_the_stored_bytes_in_hf_row_order(ckpt, reader):
    """blocks() moves whole rows of quantized blocks: dequantizing them gives dequantize(), exactly."""
    import gguf
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.embed_tokens.weight"):
        t = ckpt.tensors[name]
        blocks = t.blocks()
        qtype = gguf.GGMLQuantizationType[t.ggml_type]
        rows = blocks.reshape(t.shape[0], -1)  # (rows, row_bytes)
        np.testing.assert_array_equal(gguf.quants.dequantize(rows, qtype), t.dequantize())
        if t.row_perm is None:
            np.testing.assert_array_equal(rows, np.asarray(t.raw))
        else:
            assert not np.array_equal(rows, np.asarray(t.raw))  # the rows did move


def _rope_interleaved(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's rope (NORM mode) on [heads, head_dim]: rotates pairs (2j, 2j+1) by pos * theta^(-2j/d)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF Llama's rope on [heads, head_dim]: rotates pairs (j, j + d/2) by pos * theta^(-2j/d)."""
    d = x.shape[-1]
    ang = np.concatenate([pos * theta ** (-np.arange(0, d, 2) / d)] * 2)
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def test_unpermuted_q_k_give_hf_rope(ckpt):
    """llama.cpp's interleaved RoPE on the file's rows equals HF rotate_half RoPE on our rows, up to the
    same per-head row order for q and k, so q.k scores agree (float64, 1e-9)."""
    cfg = ckpt.config
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(cfg["hidden_size"])
    for proj, heads in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
        t = ckpt.tensors[f"model.layers.7.self_attn.{proj}.weight"]
        w_hf = t.dequantize().astype(np.float64)
        w_file = np.empty_like(w_hf)
        w_file[t.row_perm] = w_hf
        for pos in (0, 5, 1000):
            cpp = _rope_interleaved((w_file @ x).reshape(heads, d), pos, theta).reshape(-1)
            hf = _rope_rotate_half((w_hf @ x).reshape(heads, d), pos, theta).reshape(-1)
            np.testing.assert_allclose(cpp[t.row_perm], hf, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(ckpt, smollm2_gguf):
    """transformers dequantizes and un-permutes the same file on its own: every tensor is identical."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf),
                                                              gguf_file=os.path.basename(smollm2_gguf),
                                                              dtype=torch.float32)
    ref = model.state_dict()
    sd = ckpt.state_dict()
    assert set(sd) == set(ref) - {"lm_head.weight"}  # tied: HF shows lm_head as an alias of embed_tokens
    for name in sd:
        torch.testing.assert_close(sd[name], ref[name], rtol=0, atol=0, msg=name)


def test_tokenizer_matches_transformers(ckpt, hf_tokenizer):
    import tokenizers
    tok = tokenizers.Tokenizer.from_str(ckpt.tokenizer_json)
    assert tok.get_vocab_size() == ckpt.config["vocab_size"] == len(hf_tokenizer)
    for text in STRINGS:
        want = hf_tokenizer(text, add_special_tokens=True)["input_ids"]
        got = tok.encode(text).ids
        assert got == want, text
        assert tok.decode(got, skip_special_tokens=False) == hf_tokenizer.decode(want, skip_special_tokens=False)
        assert tok.decode(got, skip_special_tokens=True) == hf_tokenizer.decode(want, skip_special_tokens=True)
    # specials stay whole and keep the file's ids
    assert tok.encode("<|im_start|>assistant").ids[0] == 1
    assert tok.encode("2024").ids == [tok.token_to_id(c) for c in "2024"]  # SmolLM splits digits


def test_chat_template_matches_transformers(ckpt, hf_tokenizer):
    import tokenizers

    from hloserve.exporter.gguf.tokenizer import render_chat_template
    tok = tokenizers.Tokenizer.from_str(ckpt.tokenizer_json)
    assert ckpt.chat_template and ckpt.chat_template == hf_tokenizer.chat_template
    s = ckpt.special_tokens
    for messages in CHATS:
        for gen in (True, False):
            want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            got = render_chat_template(ckpt.chat_template, messages, add_generation_prompt=gen,
                                       bos_token=s.bos_token, eos_token=s.eos_token)
            assert got == want
            assert tok.encode(got).ids == hf_tokenizer(want, add_special_tokens=False)["input_ids"]
    assert got.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_header_reader_reads_what_gguf_reader_reads(smollm2_gguf, reader):
    """exporter/gguf/header.py against the gguf package's own reader: every key-value (type and
    value) and every tensor info (name, dims, type, data offset and size), in file order."""
    from hloserve.exporter.gguf.header import read_header
    header = read_header(smollm2_gguf)
    theirs = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(header.fields) == list(theirs)
    for key, f in theirs.items():
        ours = header.fields[key]
        assert [ours.type] + ([ours.item_type] if ours.item_type is not None else []) == [int(t) for t in f.types]
        assert ours.value == f.contents(), key
    assert header.data_start == reader.data_offset and header.alignment == reader.alignment
    assert [(t.name, t.dims, t.ggml_type, t.start, t.nbytes) for t in header.tensors] == \
        [(t.name, tuple(t.shape.tolist()), int(t.tensor_type), t.data_offset, t.n_bytes) for t in reader.tensors]


def test_non_gguf_file_is_a_clear_error(tmp_path):
    from hloserve.exporter.errors import SourceError
    from hloserve.exporter.gguf.checkpoint import load_gguf
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(SourceError, match="not a readable GGUF file"):
        load_gguf(str(bad))
    with pytest.raises(SourceError, match="no such GGUF file"):
        load_gguf(str(tmp_path / "missing.gguf"))



# -- synthetic files: what the SmolLM2 file does not exercise ------------------------------------
def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def _write_gguf(path: str, arch: str, hf_cfg, state: dict[str, np.ndarray], *, rope_scaling=None,
                add_bos: bool = True, raw: dict | None = None, rope_freqs: np.ndarray | None = None,
                extra=None) -> None:
    """A GGUF file as llama.cpp's converter writes it for `arch` (F32 tensors; q/k permuted for llama).

    raw: HF name -> (uint8 blocks [rows, row bytes], ggml type name), written as those blocks in place
    of state's float values (rows permuted for llama q/k like the floats). extra(writer): more
    metadata (a mixture of experts' expert_count, ...)."""
    import gguf
    from gguf.tensor_mapping import get_tensor_name_map
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(hf_cfg.num_hidden_layers)
    w.add_context_length(hf_cfg.max_position_embeddings)
    w.add_embedding_length(hf_cfg.hidden_size)
    w.add_feed_forward_length(hf_cfg.intermediate_size)
    w.add_head_count(hf_cfg.num_attention_heads)
    w.add_head_count_kv(hf_cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(hf_cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    w.add_vocab_size(hf_cfg.vocab_size)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling)
    # byte-level vocabulary: the 256 byte symbols, one merge, one control token
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "<|endoftext|>"]
    assert len(tokens) == hf_cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if extra is not None:
        extra(w)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, hf_cfg.num_hidden_layers)   # HF module name -> GGUF name
    heads, kv = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
    for name, value in state.items():
        if name == "lm_head.weight" and hf_cfg.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        blocks, kind = (raw or {}).get(name, (None, None))
        value = value.astype(np.float32) if blocks is None else blocks
        if arch == "llama" and ".q_proj." in name:
            value = _llama_cpp_permute(value, heads, heads)
        elif arch == "llama" and ".k_proj." in name:
            value = _llama_cpp_permute(value, heads, kv)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", value,
                     raw_dtype=None if kind is None else gguf.GGMLQuantizationType[kind])
    if rope_freqs is not None:   # Llama 3.x as llama.cpp converts it: RoPE frequency divisors
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_round_trip(tmp_path, arch):
    """HF weights -> GGUF the way llama.cpp writes them -> load_gguf gives the HF weights back exactly:
    q/k rows and biases un-permuted (llama) or untouched (qwen2), untied lm_head kept, config read."""
    import tokenizers
    import transformers

    from hloserve.exporter.gguf.checkpoint import load_gguf
    from hloserve.runtime.progress import QUIET
    torch.manual_seed(0)
    common = dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, attention_bias=True, rms_norm_eps=1e-5)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, rms_norm_eps=1e-6)
        model = transformers.Qwen2ForCausalLM(cfg)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for k in state:  # biases are zero-initialised: make them distinguishable per row
        if k.endswith(".bias"):
            state[k] = np.random.default_rng(len(k)).standard_normal(state[k].shape).astype(np.float32)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(path, arch, cfg, state, rope_scaling=2.0 if arch == "llama" else None)

    ckpt = load_gguf(path)
    assert set(ckpt.tensors) == set(state)  # incl. lm_head (untied) and o_proj.bias (llama attention_bias)
    sd = ckpt.state_dict(reporter=QUIET)
    for name, want in state.items():
        np.testing.assert_array_equal(sd[name].numpy(), want, err_msg=name)
    perm = ckpt.tensors["model.layers.1.self_attn.k_proj.bias"].row_perm
    assert (perm is not None) == (arch == "llama")

    c = ckpt.config
    assert c["model_type"] == arch and c["tie_word_embeddings"] is False
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]) == (4, 2, 16, 96)
    assert c["attention_bias"] is True
    assert c["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    if arch == "llama":
        assert c["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    else:
        assert c["rope_scaling"] is None
    tok = tokenizers.Tokenizer.from_str(ckpt.tokenizer_json)
    assert tok.encode(" t<|endoftext|>").ids == [257, 256, 257]  # BOS added (add_bos_token), merge, control token
    assert ckpt.special_tokens.add_bos_token and ckpt.special_tokens.bos_token == "<|endoftext|>"


def test_rope_freqs_divide_the_rotary_frequencies(tmp_path):
    """A GGUF with a rope_freqs tensor (llama.cpp's form of Llama 3 RoPE scaling: each inverse
    frequency divided by its factor): prefill logits of a 40-token prompt within 1e-4 of transformers f32 with its rotary
    inv_freq divided the same way (|logits| < ~1, f32: only summation order differs), and more than
    ten times that apart from the unscaled model's (random init: logits ~0.2, measured 1.8e-3)."""
    import transformers

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    from hloserve.runtime import load
    from hloserve.runtime.artifact.llm import LLMSpec, pack_step
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    factors = np.geomspace(1.0, 8.0, 8).astype(np.float32)            # [head_dim / 2]
    path = str(tmp_path / "rope-freqs.gguf")
    _write_gguf(path, "llama", cfg, {k: v.detach().numpy() for k, v in model.state_dict().items()}, rope_freqs=factors)
    src = load_source(path)
    art = str(tmp_path / "art")
    manifest = export_artifact(art, [e for e in src.entries if e.name == "prefill"], source="rope freqs",
                               model=src.model)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]
    rt = load(art, buckets={"num_tokens": [64], "num_seqs": [1], "max_blocks": [4]})
    cache = np.zeros(LLMSpec.from_json(manifest.model["llm"]).kv_cache.concrete_shape(4), np.float32)
    got = np.asarray(rt.functions["prefill"](**pack_step([(prompt, 0, [1, 2, 3])], 16), kv_cache=cache)["logits"])[0]
    with torch.no_grad():
        plain = model(torch.tensor([prompt])).logits[0, -1].numpy()
        model.model.rotary_emb.inv_freq /= torch.from_numpy(factors)
        want = model(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(got - plain).max() > 10 * 1e-4


def test_block_fields_reconstruct_dequantize(ckpt):
    """Q4_0 / Q4_1 / Q8_0 block fields give gguf's dequantization bit-exactly with the documented formulas."""
    import gguf

    from hloserve.exporter.gguf.tensor import GGUFTensor
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 64)).astype(np.float32)
    q4_0 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)  # uint8 [8, 2 * 18]
    tensors = [GGUFTensor("w", "w", "Q4_0", 2, (8, 64), 32, 18, q4_0, None, 0),
               ckpt.tensors["model.layers.2.self_attn.q_proj.weight"],   # Q4_1, rows un-permuted
               ckpt.tensors["model.embed_tokens.weight"]]                # Q8_0
    for t in tensors:
        f = t.block_fields()
        d = f["d"].astype(np.float32)[..., None]                          # [..., nb, 1]
        if t.ggml_type == "Q4_0":
            got = d * (f["q"].astype(np.int8) - np.int8(8)).astype(np.float32)
        elif t.ggml_type == "Q4_1":
            got = d * f["q"].astype(np.float32) + f["m"].astype(np.float32)[..., None]
        else:
            got = d * f["q"].astype(np.float32)
        np.testing.assert_array_equal(got.reshape(t.shape), t.dequantize(), err_msg=t.ggml_type)
    with pytest.raises(Exception, match="block fields are defined for"):
        ckpt.tensors["model.norm.weight"].block_fields()
