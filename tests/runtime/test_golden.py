"""Stored artifacts keep loading and computing (jax.export's back-compat discipline).

tests/golden/tiny_llama_v1/ was written on 2026-11-23 by hloserve at commit f53050f, before the format
moved to runtime/artifact and before model.llm had a "version" field: a random-init 2-layer Llama
(vocab 128, hidden 32, block 8, context 64) with its prefill and decode functions. The .npz beside it
holds what that version computed for an 11-token prompt (prefill logits, then one decode step).
Never regenerate these files silently: a format change that breaks them must bump a version and
keep reading the old one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from hloserve import runtime
from hloserve.runtime import artifact
from hloserve.runtime.artifact import ArtifactError, LLMArtifact, LLMSpec, TextSpec, pack_step

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden")
ART = os.path.join(GOLDEN, "tiny_llama_v1")


def test_v1_manifest_and_llm_contract_read():
    m = artifact.read_manifest(ART)
    artifact.verify_files(ART, m)
    llm = LLMSpec.of(m, ART)
    assert m.format_version == 1 and llm.version == 1        # no "version" key was written: version 1
    assert (llm.block_size, llm.max_blocks, llm.max_context, llm.max_seqs, llm.max_tokens) == (8, 8, 64, 4, 32)
    assert llm.kv_cache.concrete_shape(6) == (2, 2, 2, 6, 8, 8) and llm.kv_cache.holds is None
    assert llm.eos_token_ids == (2,) and llm.bos_token_id == 1
    stored = m.model["llm"]
    assert {k: v for k, v in llm.to_json().items() if k != "version"} == stored   # nothing lost on a round trip


def test_v1_artifact_computes_what_it_computed_when_written():
    expected = np.load(os.path.join(GOLDEN, "tiny_llama_v1_expected.npz"))
    model = runtime.load(ART, cache_dir=None)
    llm = LLMSpec.of(model.manifest, ART)
    cache = np.zeros(llm.kv_cache.concrete_shape(6), llm.kv_cache.numpy_dtype)
    prompt = expected["prompt"].tolist()
    out = model.functions["prefill"](**pack_step([(prompt, 0, [1, 2])], 8, pad_tokens=16, pad_seqs=2), kv_cache=cache)
    prefill = np.asarray(out["logits"])[:1]
    nxt = int(prefill[0].argmax())
    out = model.functions["decode"](**pack_step([([nxt], len(prompt), [1, 2])], 8, pad_seqs=2),
                                    kv_cache=out["kv_cache"])
    decode = np.asarray(out["logits"])[:1]
    # f32 sums of at most 64 terms per dot, 2 layers: reordering moves a logit by ~1e-6 of its scale
    for got, want in ((prefill, expected["prefill_logits"]), (decode, expected["decode_logits"])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_newer_or_broken_llm_contract_is_refused(tmp_path):
    with open(os.path.join(ART, "manifest.json")) as f:
        raw = json.load(f)
    newer = dict(raw["model"]["llm"], version=99)
    with pytest.raises(ArtifactError, match=r"version 99 is outside the supported range \[1..3\]; upgrade hloserve"):
        LLMSpec.from_json(newer)
    broken = {k: v for k, v in raw["model"]["llm"].items() if k != "block_size"}
    with pytest.raises(ArtifactError, match="has no 'block_size'"):
        LLMSpec.from_json(broken)
    with pytest.raises(ArtifactError, match="not an LLM step artifact"):
        LLMSpec.of(artifact.Manifest.from_json({**raw, "model": {}}), "x")


def test_v1_text_fields_read_as_text_spec_version_1():
    """The golden artifact predates model["text"]: its text fields sit at the top of `model`
    (tokenizer null, chat_template null, no add_bos_token) and read as a version 1 TextSpec."""
    m = artifact.read_manifest(ART)
    assert "text" not in m.model and m.model["tokenizer"] is None
    text = TextSpec.of(m, ART)
    assert text == TextSpec(version=1, tokenizer=None, chat_template=None, add_bos_token=True)
    assert text.tokenizer_path(ART) is None and LLMArtifact.read(ART).text == text
    # an encoder written then named no tokenizer: the tokenizer.json its files list
    encoder = dataclasses.replace(m, model={"task": "text-encoder", "files": {"tokenizer.json": "9f2c"}})
    assert TextSpec.of(encoder, "enc").tokenizer == "tokenizer.json"


@pytest.mark.parametrize("stored, match", [
    ({"version": 2}, r"text spec version 2 is outside the supported range \[1..1\]; upgrade hloserve or re-export"),
    ({"tokenizer": "tokenizer.json"}, r"model.text has no 'version'"),
    ({"version": 1, "tokenizer": "../etc/passwd"}, r"model.text.tokenizer = '../etc/passwd' must be a file name"),
    ({"version": 1, "chat_template": ["a"]}, r"model.text.chat_template must be a jinja2 template"),
    ({"version": 1, "add_bos_token": "yes"}, r"model.text.add_bos_token = yes must be true or false"),
    ({"version": 1, "eos_token_ids": [2]}, r"fields \['eos_token_ids'\] that text spec version 1 does not define"),
    ("tokenizer.json", r"model.text is str, not an object")])
def test_a_newer_or_broken_text_spec_is_refused_naming_the_field(stored, match):
    with pytest.raises(ArtifactError, match=match) as e:
        TextSpec.from_json(stored)
    assert "re-export" in str(e.value) and "\n" not in str(e.value)
    m = artifact.read_manifest(ART)
    with pytest.raises(ArtifactError, match=match):   # as the server reads it, the artifact named first
        LLMArtifact.read(ART, dataclasses.replace(m, model={**m.model, "text": stored}))


# composites_v<version>/<case>.npz: modules with composites of that version
COMPOSITE_CASES = sorted(f"{d}/{n.removesuffix('.npz')}" for d in os.listdir(GOLDEN) if d.startswith("composites_v")
                         for n in os.listdir(os.path.join(GOLDEN, d)) if n.endswith(".npz"))


def _bound(name: str, version: int, args: list, want: np.ndarray) -> np.ndarray:
    """How far a reordered f32 summation may move each output (tests/runtime/test_kernels.py derives
    each): attention outputs are softmax averages of O(1) values, 1e-5; a linear's products are exact
    in f32 (x rounded to the weights' 16 bits, or quantized per block of 32 for quantized weights), so
    |error| <= (K + 4) 2^-24 sum_k |x_k w_k| (the quantized kernel's unsigned offsets included)."""
    import jax.numpy as jnp
    import torch

    from hloserve.quantization import modules, primitives
    from hloserve.quantization.modules import quantize_blocks
    if name.startswith("paged_attention"):
        return np.full(want.shape, 1e-5)
    x, layer = args[0], int(args[-1])
    K = x.shape[1]
    if name.startswith("layer_linear"):
        w = np.asarray(jnp.asarray(args[1][layer]).view(jnp.bfloat16).astype(jnp.float32))
        xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
        return K * 2.0 ** -24 * (np.abs(xr) @ np.abs(w).T) + 1e-30
    if version == 5:   # K-quants, the quants interleaved: the layer's f32 weights from its blocks
        from hloserve.quantization.schemes import WeightScheme
        kind = name.removeprefix("quant_linear_").upper()
        scheme = dataclasses.replace(WeightScheme.of_block(kind), rows=16)
        w = primitives.dequantize_blocks(args[1][layer], args[2][layer], scheme)       # [N, K]
        s, m = primitives.block_scales(args[2][layer], kind)
        group = K // s.shape[1]
        terms = np.abs(w) + 128 * np.repeat(np.abs(s), group, 1) + (0 if m is None else np.repeat(np.abs(m), group, 1))
        x8 = quantize_blocks(torch.from_numpy(x)).numpy()
        return (K + 4) * 2.0 ** -24 * (np.abs(x8) @ terms.T) + 1e-30
    qweight, scale, mn = args[1], args[2], args[3]
    five = version == 4                  # quant_linear v4: 5-bit values, offset 16 in the kernel
    if version in (2, 4, 6):   # quant_linear v2 / v4 / v6, interleaved by 16 rows: back to row order for the bound
        bits = 5 if five else 4 if qweight.shape[2] == 8 * K else 8
        mats = [modules.rows_in_order(*(torch.from_numpy(a[i]) if a.size else None for a in (qweight, scale, mn)), bits)
                for i in range(qweight.shape[0])]
        qweight = np.stack([q.numpy() for q, _, _ in mats])                 # int values [L, N, K]
        scale = np.stack([sc.numpy() for _, sc, _ in mats])
        mn = np.stack([m.numpy() for _, _, m in mats]) if mn.size else mn
        bits = 8                                                             # int values, as int8 are
    bits = 4 if qweight.shape[2] * 2 == K else 8
    ints = (primitives.unpack_int4(qweight, signed=not mn.size) if bits == 4 else qweight).astype(np.float32)[layer]
    group = K // scale.shape[2]
    s = np.repeat(scale.astype(np.float32)[layer], group, axis=1)
    m = np.repeat(mn.astype(np.float32)[layer], group, axis=1) if mn.size else np.zeros_like(s)
    if version == 6 and x.shape[0] >= 64:   # bf16_rows (make_composites_v6.py: 64) and more: r(x) r(W)^T
        def r(a):
            return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
        return K * 2.0 ** -24 * (np.abs(r(x)) @ np.abs(r(ints * s + m)).T) + 1e-30
    offset = 16 if five else 0 if mn.size else 128 if bits == 8 else 8
    x8 = quantize_blocks(torch.from_numpy(x)).numpy()
    terms = np.abs(ints * s) + np.abs(m) + offset * np.abs(s)
    return (K + 4) * 2.0 ** -24 * (np.abs(x8) @ terms.T) + 1e-30


@pytest.mark.parametrize("name", COMPOSITE_CASES)
def test_stored_composite_computes_what_it_did_through_kernel_and_decomposition(name):
    """A module stored with a composite at its version (tests/golden/make_composites_v1.py and
    make_composites_v2.py, written 2026-11-26; make_composites_v4.py, v5 and v6, 2026-12-01) is still recognised: on this machine's CPU kernel (where one builds) and through its
    decomposition it computes the stored outputs, within what reordered f32 sums allow (version 6's
    chunks on a CPU whose kernel computes version 2's product there: that product, version 2's bound)."""
    import jax
    from jax import export

    from hloserve.runtime import kernels
    from hloserve.runtime.kernels.cpu import build
    from hloserve.runtime.artifact.kernels import COMPOSITES, QUANT_LINEAR_V6
    from tests.support.quant_contract import step_rows

    folder, name = name.split("/")
    version = int(folder.removeprefix("composites_v"))
    composite = next(c for (_, v), c in COMPOSITES.items() if v == version and name.startswith(c.name.split(".")[1]))
    with open(os.path.join(GOLDEN, folder, f"{name}.jax_exported"), "rb") as f:
        exp = export.deserialize(bytearray(f.read()))
    stored = np.load(os.path.join(GOLDEN, folder, f"{name}.npz"))
    args = [stored[f"arg{i}"] for i in range(len(stored.files) - 1)]
    want = stored["want"]
    assert f'"{composite.name}"' in exp.mlir_module() and f"version = {composite.version}" in exp.mlir_module()
    bound = _bound(name, version, args, want)
    library = build.library()
    backends = (kernels.Decompositions(),) + ((kernels.CpuBackend(library),) if library is not None else ())
    for backend in backends:
        s = backend.specialize(exp)
        lib = backend if s.kernels else None
        assert s.kernels == (backend.name == "cpu")
        got = np.asarray(jax.jit(s.exported.call)(*args))
        want_here, bound_here = want, bound
        if lib is not None and composite.key == QUANT_LINEAR_V6.key and step_rows(len(args[0])) == 0:
            # this CPU's kernel computes version 2's product where the module asked for bf16 (targets.py;
            # no AMX): version 2's decomposition of the same operands, within version 2's bound
            from hloserve.exporter.composites.quant_linear import quant_linear_v2_reference
            attrs = {k: int(v) for k, v in re.findall(r"\b(bits|group) = (\d+) : i64", exp.mlir_module())}
            want_here = np.asarray(jax.jit(lambda *a: quant_linear_v2_reference(*a, **attrs))(*args))
            bound_here = _bound(name, 2, args, want_here)
        assert got.shape == want.shape and (np.abs(got - want_here) <= bound_here).all(), \
            (name, lib is not None, np.abs(got - want_here).max())
