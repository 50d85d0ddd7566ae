"""Multi-LoRA: a tiny random Llama (SmolLM2's tokenizer) exported with adapter slots, PEFT adapters with
random nonzero weights (init_lora_weights=False) of two ranks and target sets, served by `hloserve serve
--lora-modules` and checked against transformers + PEFT on the same adapters: the step's logits with
both adapters and the base model in one call, greedy text through a real server with the requests
concurrent (one batch), /v1/models, vLLM's load/unload endpoints, and adapters that cannot be served
(400 from the endpoint, one line from the CLI)."""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest

from .conftest import export_tiny_llama, smollm2_text_files
from .servers import hf_greedy, running_server

pytestmark = pytest.mark.slow
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, lora_alpha, target modules, use_rslora)
ADAPTERS = {"qv": (4, 16, ["q_proj", "v_proj"], False), "all": (8, 16, ALL_LINEAR, True),
            "big": (16, 16, ["q_proj"], False), "head": (4, 8, ["lm_head"], False)}
PROMPT = ("The old lighthouse stood at the edge of the cliff for nearly two hundred years, and every night its "
          "keeper climbed the stairs")


@pytest.fixture(scope="module")
def lora_llm(tmp_path_factory):
    """(artifact, {adapter name: (PEFT model, directory)}, tokenizer): slots 3, max rank 8, every linear."""
    import peft
    import torch
    import transformers

    from hloserve.exporter.llm.lora import LoraRequest
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.server.text.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("lora")
    config, files = smollm2_text_files()
    _, art = export_tiny_llama(root, "tiny-lora", files=files, lora=LoraRequest(3, 8), **config)
    adapters = {}
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = transformers.LlamaForCausalLM.from_pretrained(str(root / "hf"))
        model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                          use_rslora=rs, init_lora_weights=False)).eval()
        model.save_pretrained(str(root / name))
        adapters[name] = (model, str(root / name))
    os.makedirs(root / "nofile")
    shutil.copy(root / "qv" / "adapter_config.json", root / "nofile")
    adapters["nofile"] = (None, str(root / "nofile"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(root / "hf")).eval()
    adapters["base"] = (hf, None)
    return art, adapters, Tokenizer.from_artifact(LLMArtifact.read(art))


def test_one_step_mixing_two_adapters_and_the_base_equals_peft(lora_llm):
    """One call of each step function with rows under adapter qv, adapter all and none: each row's
    logits are transformers + PEFT's on that adapter (f32 throughout: summation order apart)."""
    import torch

    from hloserve import runtime
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.runtime.artifact.llm import pack_step
    from hloserve.server.core.adapters import AdapterTable

    art, adapters, tok = lora_llm
    spec = LLMArtifact.read(art).llm
    table = AdapterTable(spec.lora)
    slots = [table.load(n, adapters[n][1]).ref.slot for n in ("qv", "all")] + [0]
    prompts = [tok.encode(PROMPT)[:12], tok.encode("Once upon a time"), tok.encode(PROMPT)[:12]]
    inputs = pack_step([(p, 0, [i + 1]) for i, p in enumerate(prompts)], spec.block_size, lora_slots=slots)
    model = runtime.load(art)
    kv = np.zeros(spec.kv_cache.concrete_shape(4), spec.kv_cache.numpy_dtype)
    for fn in model.functions:
        got = np.asarray(model.functions[fn](**inputs, kv_cache=kv, **table.stacks())["logits"])
        for i, name in enumerate(("qv", "all", "base")):
            with torch.no_grad():
                want = adapters[name][0](torch.tensor([prompts[i]])).logits[0, -1].numpy()
            np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"{fn} {name}")
    with torch.no_grad():   # the adapters change the model: their logits are not the base model's
        base = adapters["base"][0](torch.tensor([prompts[0]])).logits[0, -1]
        assert (adapters["qv"][0](torch.tensor([prompts[0]])).logits[0, -1] - base).abs().max() > 0.1


@pytest.fixture(scope="module")
def server(lora_llm):
    art, adapters, _ = lora_llm
    with running_server(art, "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
                        "--lora-modules", f"qv={adapters['qv'][1]}", f"all={adapters['all'][1]}") as (base, _):
        yield base


def complete(base: str, model: str, ids: list[int], n: int = 8):
    import openai
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text


def test_greedy_text_of_two_adapters_in_one_batch_equals_peft(server, lora_llm):
    """The base model first (its prompt blocks enter the prefix cache), then the same prompt under both
    adapters and the base, concurrently: each text is PEFT's greedy text on its adapter (the prefix
    cache is salted by adapter, so the base's cached blocks are not reused under an adapter)."""
    _, adapters, tok = lora_llm
    ids = tok.encode(PROMPT)
    want = {name: tok.decode(hf_greedy(adapters[name][0], ids, 8)) for name in ("qv", "all", "base")}
    assert len(set(want.values())) == 3, want            # the adapters change the greedy text
    assert complete(server, "tiny-lora", ids) == want["base"]
    names = ("qv", "all", "tiny-lora", "qv", "all")
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: complete(server, n, ids), names))
    assert got == [want["base" if n == "tiny-lora" else n] for n in names]


def test_models_list_and_runtime_load_and_unload(server, lora_llm):
    _, adapters, tok = lora_llm
    cards = {m["id"]: m for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert set(cards) == {"tiny-lora", "qv", "all"}
    assert cards["qv"]["parent"] == "tiny-lora" and cards["qv"]["root"] == adapters["qv"][1]
    ids = tok.encode(PROMPT)
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "qv2", "lora_path": adapters["qv"][1]})
    assert r.status_code == 200 and "qv2" in r.text
    assert complete(server, "qv2", ids) == complete(server, "qv", ids)
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "more", "lora_path": adapters["all"][1]})
    assert r.status_code == 400 and "all 3 adapter slots are in use" in r.json()["error"]["message"]
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "qv2"}).status_code == 200
    assert "qv2" not in {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]}
    r = httpx.post(f"{server}/v1/completions", json={"model": "qv2", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "qv2"}).status_code == 404


@pytest.mark.parametrize("name, message", [("big", "rank 16 is above the artifact's --max-lora-rank 8"),
                                           ("head", "is not a LoRA A/B of a decoder layer's projection"),
                                           ("nofile", "adapter_model.safetensors is missing")])
def test_an_adapter_that_cannot_be_served_answers_400(server, lora_llm, name, message):
    _, adapters, tok = lora_llm
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name][1]})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert complete(server, "qv", tok.encode("hi"), 2)          # still serving


def test_the_cli_refuses_an_adapter_that_cannot_be_served_in_one_line(lora_llm):
    art, adapters, _ = lora_llm
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", art, "--port", "0",
                        "--lora-modules", f"big={adapters['big'][1]}"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if "--max-lora-rank 8" in ln]
    assert len(lines) == 1 and "re-export with --max-lora-rank 16" in lines[0], p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", art, "--lora-modules", "nopath"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "give NAME=PATH" in p.stderr


def test_export_refuses_lora_options_without_slots(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "export", "x", "-o", str(tmp_path / "a"),
                        "--max-lora-rank", "8"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "need --lora-slots N" in p.stderr, p.stderr
