"""Tensor-parallel serving on virtual CPU devices: the same artifact at 1, 2 and 4 devices.

A random-init Llama with 8 query heads over 4 KV heads (weights x3 so greedy has no near-ties
at float noise; f32). At every size: greedy tokens of several prompts (chunked prefill, mixed
steps) equal one device's and transformers'; each device holds exactly 1/N of every split
weight and of the KV cache (read from the device buffers); the compiled steps hold all-reduces
(two per layer body: after o_proj and down_proj) and no all-gather but the logits' (the
vocabulary is split too). `hloserve serve
--tensor-parallel-size 2` serves the chat model over HTTP with the openai client, reports
per-device memory in /metrics, and a size that does not divide the KV heads is one line.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.server.servers import hf_greedy, running_server
from tests.support.tensor_parallel import tp_report

pytestmark = pytest.mark.slow
NEW = 32


@pytest.fixture(scope="module")
def gqa_llm(tmp_path_factory):
    from tests.support.tiny_llama import tiny_llama
    return tiny_llama(str(tmp_path_factory.mktemp("gqa-llm")), heads=8, kv_heads=4, max_position=512,
                      block_size=16, max_context=256)


def test_two_and_four_devices_give_one_devices_tokens_with_every_split_weight_divided(gqa_llm):
    hf, art = gqa_llm
    prompts = [[5, 6, 7], list(range(10, 90)), [200 - i for i in range(37)], [42] * 20]   # 80 tokens: chunked
    report = tp_report(art, [1, 2, 4], prompts, NEW)
    assert report[1]["tokens"] == [hf_greedy(hf, p, NEW) for p in prompts]
    for n in (2, 4):
        r = report[n]
        assert r["tokens"] == report[1]["tokens"], f"tensor-parallel {n}"
        assert r["devices"] == n and r["compiles_after_warmup"] == 0
        assert r["split"] and all(frac == [1 / n] for frac in r["split"].values()), r["split"]
        assert not r["absent"], r["absent"]          # every weight the spec names is stored
        for fn, h in r["hlo"].items():      # the one gather: each step's logits, split by vocabulary
            assert h["all-reduce"] >= 2 and only_logits_gathered(h["all-gather"], r["vocab"]), (fn, h)
    one = report[1]["memory"]
    assert set(one) == {"0/weights", "0/kv_cache"}
    four = report[4]["memory"]
    assert four["0/kv_cache"] * 4 == one["0/kv_cache"]     # the same blocks, a quarter of the heads each
    assert one["0/weights"] / 4 < four["0/weights"] < one["0/weights"]   # the norms are whole


def test_bf16_weights_read_in_place_split_the_same_way(tmp_path_factory):
    """With 16-bit weights the step's products are hloserve.layer_linear over whole stacks (one
    device on CPU: the kernel; a mesh: the decomposition, partitioned): two devices give one
    device's tokens, hold half of every split weight, and gather nothing but the logits."""
    import torch

    from tests.support.tiny_llama import tiny_llama
    _, art = tiny_llama(str(tmp_path_factory.mktemp("gqa-bf16")), heads=8, kv_heads=4, max_position=512,
                        block_size=16, max_context=256, weight_dtype=torch.bfloat16)
    prompts = [[5, 6, 7], list(range(10, 90)), [42] * 20]
    report = tp_report(art, [1, 2], prompts, NEW)
    two = report[2]
    assert two["tokens"] == report[1]["tokens"]
    assert two["split"] and all(frac == [1 / 2] for frac in two["split"].values()), two["split"]
    for fn, h in two["hlo"].items():
        assert h["all-reduce"] >= 2 and only_logits_gathered(h["all-gather"], two["vocab"]), (fn, h)


@pytest.mark.parametrize("family,weights", [("llama", "f32"), ("qwen3", "bf16"), ("llama", "int8")])
def test_the_generic_step_splits_by_heads(tmp_path_factory, monkeypatch, family, weights):
    """The generic (transformers) step of a GQA model, its layers one scanned body: two devices give
    one device's tokens and transformers', every split weight (q/k/v and gate/up by output rows, o
    and down by input columns, the vocabulary) and the KV cache are halved, and the compiled steps
    all-reduce and gather nothing but the logits. bf16: the stacks are read in place
    (hloserve.layer_linear), whose decomposition the mesh partitions. int8 (--quantize): the
    per-row scales of the row-split matrices are split with them."""
    import torch
    import transformers

    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.llm import hf_causal
    from hloserve.exporter.llm.step import StepExportOptions

    root = str(tmp_path_factory.mktemp(f"generic-tp-{family}"))
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=family == "qwen3")
    if family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    with torch.no_grad():      # x3: greedy without near-ties at float noise
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(3.0)
    hf.save_pretrained(f"{root}/hf")
    from hloserve.quantization.convert import QuantRequest
    from hloserve.quantization.schemes import QuantConfig
    src = hf_causal.from_hf_directory(f"{root}/hf", opts=StepExportOptions(block_size=16, max_context=256, max_tokens=64,
                                                                           max_seqs=8),
                                      weight_dtype=torch.bfloat16 if weights == "bf16" else None,
                                      quantize=QuantRequest(QuantConfig.parse("int8")) if weights == "int8" else None)
    assert src.model["llm"].model.layers == "scan"
    export_artifact(f"{root}/art", src.entries, source=f"tiny-{family}", model=src.model, weight_quant=src.weight_quant)
    prompts = [[5, 6, 7], list(range(10, 90)), [42] * 20]          # 80 tokens: chunked
    if weights == "int8":
        # one device runs the CPU kernels, two the mesh-partitioned decompositions. quant_linear version 6
        # sums a chunk's bf16 products in f32 in each one's own order: the first step's logits 3.6e-7 apart
        # (of 1.7), enough to flip an int8 rounding of a later decode step's activations and then a greedy
        # token (the fifth, 2026-12-01). Both sides run the decompositions: the split is what is compared.
        monkeypatch.setenv("HLOSERVE_CPU_KERNELS", "0")
    report = tp_report(f"{root}/art", [1, 2], prompts, NEW)
    if weights == "f32":
        assert report[1]["tokens"] == [hf_greedy(hf, p, NEW) for p in prompts]
    two = report[2]
    assert two["tokens"] == report[1]["tokens"]
    split = {re.sub(r".*(stack\.0\.|model\.)", "", k): v for k, v in two["split"].items()}
    want = {"self_attn__o_proj__weight", "mlp__down_proj__weight", "kv_cache"}
    if weights == "bf16":   # q/k/v and gate/up as one matrix each, rows grouped by KV head and by row
        want |= {"self_attn__fused_qkv_proj__weight", "mlp__fused_gate_up_proj__weight"}
    else:
        want |= {"self_attn__q_proj__weight", "self_attn__k_proj__weight", "self_attn__v_proj__weight",
                 "mlp__gate_proj__weight", "mlp__up_proj__weight"}
    if weights == "int8":
        want |= {f"{m}__weight_scale" for m in ("self_attn__q_proj", "self_attn__k_proj", "self_attn__v_proj",
                                                 "mlp__gate_proj", "mlp__up_proj")}
    assert want <= set(split) and all(frac == [1 / 2] for frac in split.values()), split
    assert any("embed" in k or "lm_head" in k for k in split), split       # the vocabulary is split too
    assert two["absent"] == []       # a tied table: the spec names the one name the artifact stores
    for fn, h in two["hlo"].items():
        assert h["all-reduce"] >= 2 and only_logits_gathered(h["all-gather"], two["vocab"]), (fn, h)


def only_logits_gathered(shapes: list[str], vocab: int) -> bool:
    """Every all-gather in a compiled step is of logits f32[S, vocab] (never of a weight or the cache)."""
    return all(re.fullmatch(rf"f32\[\d+,{vocab}\]", s) for s in shapes)


def test_a_size_that_does_not_divide_the_kv_heads_is_one_line(gqa_llm):
    _, art = gqa_llm
    proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", art, "--tensor-parallel-size", "3",
                           "--port", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and "does not divide the model's 4 KV heads; use one of [1, 2, 4]" in lines[0], proc.stderr


def test_serve_with_tensor_parallel_2_over_http(tiny_chat_llm):
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    hf, art = tiny_chat_llm          # 4 query heads over 2 KV heads
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    prompts = [tok.encode(t) for t in ("Once upon a time", "The capital of France is a city where")]
    with running_server(art, "--tensor-parallel-size", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                        "--max-model-len", "128") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for p in prompts:
            r = client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == tok.decode(hf_greedy(hf, p, 16))
        text = httpx.get(f"{base}/metrics", timeout=10).text
    samples = {(s.labels["device"], s.labels["kind"]): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "hloserve:device_memory_bytes"}
    assert set(samples) == {("0", "weights"), ("1", "weights"), ("0", "kv_cache"), ("1", "kv_cache")}
    assert samples[("0", "kv_cache")] == samples[("1", "kv_cache")] > 0
