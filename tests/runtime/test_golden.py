"""Stored artifacts keep loading and computing (jax.export's back-compat discipline).

tests/golden/tiny_llama_v1/ was written on 2026-11-23 by hloserve at commit f53050f, before the format
moved to runtime/artifact and before model.llm had a "version" field: a random-init 2-layer Llama
(vocab 128, hidden 32, block 8, context 64) with its prefill and decode functions. The .npz beside it
holds what that version computed for an 11-token prompt (prefill logits, then one decode step).
Never regenerate these files silently: a format change that breaks them must bump a version and
keep reading the old one.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hloserve import runtime
from hloserve.runtime import artifact
from hloserve.runtime.artifact import ArtifactError, LLMSpec, pack_step

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
    with pytest.raises(ArtifactError, match=r"version 99 is outside the supported range \[1..2\]; upgrade hloserve"):
        LLMSpec.from_json(newer)
    broken = {k: v for k, v in raw["model"]["llm"].items() if k != "block_size"}
    with pytest.raises(ArtifactError, match="has no 'block_size'"):
        LLMSpec.from_json(broken)
    with pytest.raises(ArtifactError, match="not an LLM step artifact"):
        LLMSpec.of(artifact.Manifest.from_json({**raw, "model": {}}), "x")
