"""`hloserve serve MODEL.gguf`: a GGUF file named on the command line is exported into the cache
once, in the format `--quantize` picks (auto: the file's own blocks), and served.

The file is the tiny Llama of tests/quantization/test_gguf_import.py whose matrices are Q4_K,
Q6_K and Q5_0 blocks (K-quants kept as blocks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hloserve.server.serve import DEFAULT_EXPORT_FLAGS, DEFAULT_EXPORT_TAG, EXPORT_STEP, export_choice, serve_target

from ..quantization.test_gguf_import import write_k_gguf
from .servers import running_server


def test_export_choice_table():
    """auto: the file's blocks for a GGUF named on the command line, bf16 for the default model; a
    quantized export keeps K and V in bf16 unless --kv-cache-dtype says otherwise."""
    assert export_choice("auto", default_model=False) == (("--quantize", "gguf", "--kv-cache-dtype", "bfloat16"),
                                                          f"gguf2-kvbfloat16-{EXPORT_STEP}")
    assert export_choice("auto", default_model=True) == (DEFAULT_EXPORT_FLAGS, DEFAULT_EXPORT_TAG)
    assert export_choice("bf16", default_model=False) == (DEFAULT_EXPORT_FLAGS, DEFAULT_EXPORT_TAG)
    assert export_choice("int4:32:sym", default_model=False) == (
        ("--quantize", "int4:32:sym", "--kv-cache-dtype", "bfloat16"), f"int4_32_sym-kvbfloat16-{EXPORT_STEP}")
    # --kv-cache-dtype: its own cache entry, except the default model's own bf16
    assert export_choice("auto", default_model=True, kv_cache_dtype="bfloat16") == (DEFAULT_EXPORT_FLAGS, DEFAULT_EXPORT_TAG)
    assert export_choice("auto", default_model=True, kv_cache_dtype="int8") == (
        ("--weight-dtype", "bfloat16", "--kv-cache-dtype", "int8"), f"bf16-kvint8f-{EXPORT_STEP}")
    assert export_choice("auto", default_model=False, kv_cache_dtype="int8") == (
        ("--quantize", "gguf", "--kv-cache-dtype", "int8"), f"gguf2-kvint8f-{EXPORT_STEP}")
    for name in ("fp8", "fp8_e4m3"):   # vLLM's alias: the same export
        assert export_choice("auto", default_model=True, kv_cache_dtype=name) == (
            ("--weight-dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"), f"bf16-kvfp8_e4m3-{EXPORT_STEP}")


def test_quantize_is_refused_for_an_exported_artifact(tmp_path):
    """An artifact is served as it was exported: --quantize other than auto is one readable line, exit 1."""
    r = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", str(tmp_path), "--quantize", "int8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("hloserve: error: ") and "is an exported artifact" in lines[-1], r.stderr


@pytest.mark.slow
def test_serve_gguf_file_serves_its_own_blocks(tmp_path):
    """`hloserve serve tiny-k.gguf` exports it with --quantize gguf through the generic step (the
    manifest says so: the Q4_K and Q6_K layers kept as blocks, the Q5_0 one its 5-bit values, int5 g32), names the model after the file and
    answers a completion; a second resolution reuses the export."""
    import openai

    path = write_k_gguf(str(tmp_path / "tiny-k.gguf"))
    with running_server(path, "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "64",
                        log_dir=str(tmp_path)) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        assert model == "tiny-k"
        r = client.completions.create(model=model, prompt="t t", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    art, name = serve_target(path)                        # already exported: found, not exported again
    assert name == "tiny-k" and art.endswith(f"-gguf2-kvbfloat16-{EXPORT_STEP}")
    with open(os.path.join(art, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["model"]["quantization"]["native"] is True
    q, down = ([w["quant"] for n, w in sorted(manifest["weights"].items())
                if part in n and w.get("quant", {}).get("role") == "qweight"] for part in ("q_proj", "down_proj"))
    assert [w["block"] for w in q] == ["Q4_K", "Q4_K"]
    assert [(w["scheme"], w["scale_dtype"]) for w in down] == [("Q6_K", "f16"), ("int5", "f16")]
