"""The real SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to f32) exported by the CLI preset and run
through the runtime with the paged KV cache: greedy continuations of three chat prompts equal
transformers' eager greedy output on the same dequantized weights (transformers' own GGUF loader;
test_gguf.py checks that its weights equal ours bit for bit) for 64 tokens.

The three sequences run batched: one `prefill` step for all prompts, then `decode` steps of one token
per sequence; their blocks are interleaved in one cache so each block table is non-contiguous.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch

from hloserve.runtime.artifact import TextSpec, read_manifest
from hloserve.runtime.artifact.llm import LLMSpec, pack_step

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
# Prompts whose answers run past 64 tokens, so every position is compared (no early EOS).
CHATS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "Explain step by step how photosynthesis works."}],
    [{"role": "user", "content": "List ten tips for staying productive while working from home."}],
]
# Last-token logits of the prompts, runtime vs transformers eager (f32, 30 layers, logits up to ~31):
# measured max |diff| 7.2e-5; the bound leaves room for other reduction orders. Greedy is robust to
# that: the smallest top-1/top-2 logit margin along the three 64-token continuations is 0.0135.
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def smollm2_artifact(tmp_path_factory) -> str:
    """`hloserve export smollm2-135m-instruct -o OUT`, once per module."""
    from hloserve.server.cli import main
    out = str(tmp_path_factory.mktemp("smollm2") / "art")
    assert main(["export", "smollm2-135m-instruct", "-o", out, "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    from hloserve.exporter import presets
    path = presets.resolve("smollm2-135m-instruct", quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch on n threads for the block. With one thread the eager reference runs ~8x faster on a loaded
    2-core machine (measured: 4.2 s -> 0.53 s per 40-token forward), where multi-threaded kernels spin
    against other processes."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _prompts(art: str) -> list[list[int]]:
    """The chats rendered with the artifact's chat template and encoded with its tokenizer.json."""
    import tokenizers

    from hloserve.exporter.gguf.tokenizer import render_chat_template
    text = _text(art)
    assert text.chat_template, "the artifact must carry the GGUF chat template"
    tok = tokenizers.Tokenizer.from_file(text.tokenizer_path(art))
    texts = [render_chat_template(text.chat_template, chat, add_generation_prompt=True) for chat in CHATS]
    assert texts[0].endswith("<|im_start|>assistant\n")
    return [tok.encode(t, add_special_tokens=text.add_bos_token).ids for t in texts]


def _text(art: str) -> TextSpec:
    return TextSpec.of(read_manifest(art), art)


def _runtime_greedy(art: str, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy decoding of all prompts at once through the artifact; returns (continuations, prefill logits)."""
    from hloserve.runtime import load

    rt = load(art)
    llm = rt.manifest.model["llm"]
    bs = llm["block_size"]
    # blocks interleaved between sequences (1, 4, 7, ... for seq 0), block 0 is the null block
    need = [-(-(len(p) + new_tokens) // bs) for p in prompts]
    S = len(prompts)
    tables = [[1 + s + S * i for i in range(n)] for s, n in enumerate(need)]
    num_blocks = 1 + S * max(need)
    width = max(need)
    cache = np.zeros(LLMSpec.from_json(llm).kv_cache.concrete_shape(num_blocks), np.float32)

    step = pack_step([(p, 0, t) for p, t in zip(prompts, tables)], bs, pad_blocks=width)
    out = rt.functions["prefill"](**step, kv_cache=cache)
    prefill_logits = np.asarray(out["logits"])
    cache = out["kv_cache"]
    seqs = [list(p) for p in prompts]
    for i in range(new_tokens):
        nxt = np.asarray(out["logits"]).argmax(-1)
        for s in range(S):
            seqs[s].append(int(nxt[s]))
        if i == new_tokens - 1:
            break
        step = pack_step([(sq[-1:], len(sq) - 1, t) for sq, t in zip(seqs, tables)], bs, pad_blocks=width)
        out = rt.functions["decode"](**step, kv_cache=cache)
        cache = out["kv_cache"]
    return [sq[len(p):] for sq, p in zip(seqs, prompts)], prefill_logits


def test_smollm2_greedy_matches_transformers(smollm2_artifact, hf_model):
    with open(os.path.join(smollm2_artifact, "manifest.json")) as f:
        manifest = json.load(f)
    assert set(manifest["functions"]) >= {"prefill", "decode"}
    assert manifest["model"]["preset"] == "smollm2-135m-instruct"
    assert "attention interface" in manifest["model"]["llm"]["attention"]     # the generic step, by default
    prompts = _prompts(smollm2_artifact)
    got, prefill_logits = _runtime_greedy(smollm2_artifact, prompts, NEW_TOKENS)
    _assert_matches_transformers(hf_model, prompts, got, prefill_logits)


def test_smollm2_hf_directory_through_the_generic_step(tmp_path_factory, smollm2_artifact, hf_model):
    """The same weights saved as a Hugging Face directory and exported with `--llm-step generic` (the
    model's transformers code with hloserve's paged attention): the same greedy continuations."""
    import shutil

    from hloserve.server.cli import main
    root = tmp_path_factory.mktemp("smollm2-hf")
    hf_dir, out = root / "hf", str(root / "art")
    hf_model.hf_quantizer = None                      # plain f32 tensors now (dequantized from the GGUF)
    if hasattr(hf_model.config, "quantization_config"):
        delattr(hf_model.config, "quantization_config")
    hf_model.save_pretrained(str(hf_dir))
    text = _text(smollm2_artifact)
    shutil.copy(text.tokenizer_path(smollm2_artifact), hf_dir / "tokenizer.json")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": text.chat_template,
                                                               "add_bos_token": text.add_bos_token}))
    assert main(["export", str(hf_dir), "--llm-step", "generic", "-o", out, "-q"]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        model = json.load(f)["model"]
    assert "attention interface" in model["llm"]["attention"]
    assert model["text"]["version"] == 1 and "chat_template" not in model   # the text spec, typed, in one place
    assert _text(out) == _text(smollm2_artifact)         # the text spec travels through the directory
    prompts = _prompts(out)
    assert prompts == _prompts(smollm2_artifact)
    got, prefill_logits = _runtime_greedy(out, prompts, NEW_TOKENS)
    _assert_matches_transformers(hf_model, prompts, got, prefill_logits)


def _assert_matches_transformers(hf_model, prompts, got, prefill_logits):
    eos = hf_model.config.eos_token_id
    for i, (prompt, cont) in enumerate(zip(prompts, got)):
        ids = torch.tensor([prompt])
        with torch.no_grad(), _torch_threads(1):
            want_logits = hf_model(ids).logits[0, -1].numpy()
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=eos)[0, len(prompt):].tolist()
        np.testing.assert_allclose(prefill_logits[i], want_logits, rtol=0, atol=LOGITS_ATOL)
        assert len(want) == NEW_TOKENS and eos not in want, f"prompt {i}: reference ended early; pick a longer prompt"
        assert cont == want, f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(cont, want)) if a != b)}"


def test_smollm2_split_over_three_devices(smollm2_artifact):
    """The f32 preset with `--tensor-parallel-size 3` (its 9 query heads over 3 KV heads: 3 is the one
    split above 1 that gives every device whole KV heads; 2 and 4 are refused): the same greedy
    tokens as one device through the whole engine, every split weight and the cache divided by 3,
    no all-gather in the compiled steps but the logits'."""
    from tests.server.test_tensor_parallel import only_logits_gathered
    from tests.support.tensor_parallel import tp_report

    prompts = _prompts(smollm2_artifact)
    want, _ = _runtime_greedy(smollm2_artifact, prompts, 32)     # one device; equal to transformers above
    report = tp_report(smollm2_artifact, [3], prompts, 32)[3]
    assert report["tokens"] == want
    assert all(frac == [1 / 3] for frac in report["split"].values()), report["split"]
    assert len(report["split"]) == 7 + 1 + 1                      # q, k, v, o, gate, up, down; embedding; the cache
    for fn, h in report["hlo"].items():                           # gathered: the logits only
        assert h["all-reduce"] >= 2 and only_logits_gathered(h["all-gather"], report["vocab"]), (fn, h)
