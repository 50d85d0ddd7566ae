"""The step calling convention and the kernels' constants have one definition each (runtime/artifact/)."""
from __future__ import annotations

import os
import re

import pytest

from hloserve.runtime.artifact import LLMSpec
from hloserve.runtime.artifact.kernels import PAGED_ATTENTION, Holds
from hloserve.runtime.artifact.llm import Layout

CC = os.path.join(os.path.dirname(__file__), "..", "..", "runtime", "kernels", "cpu", "common.h")


def test_the_kernels_holds_codes_are_the_python_enum():
    """common.h's `Kind` enumerators carry Holds' values, in the same order (the C++ side is
    read from the source the runtime builds)."""
    with open(CC) as f:
        source = f.read()
    body = re.search(r"enum class Kind : int64_t \{([^}]*)\}", source)
    assert body, "common.h no longer declares `enum class Kind : int64_t {...}`"
    kinds = dict((name, int(value)) for name, value in re.findall(r"k(\w+)\s*=\s*(\d+)", body.group(1)))
    assert kinds == {"F32": Holds.OWN, "BF16": Holds.BF16, "F16": Holds.F16, "I8Rows": Holds.INT8_ROWS,
                     "I8ZpRows": Holds.INT8_ZP_ROWS, "F8E4M3Rows": Holds.FP8_E4M3_ROWS}
    assert [Holds.named(n) for n in (None, "bf16", "f16")] == [Holds.OWN, Holds.BF16, Holds.F16]


@pytest.mark.parametrize("stored, layout", [
    ("gather: K/V gathered per token", Layout.GATHER), ("flat: scores T x S*C", Layout.FLAT),
    ("paged", Layout.PAGED), ("something newer: ...", None), ("", None)])
def test_a_functions_layout_is_read_from_its_contract_entry(stored, layout):
    raw = {"block_size": 8, "max_blocks": 8, "max_seqs": 4, "max_tokens": 32, "vocab_size": 128,
           "kv_cache": {"dtype": "f32", "shape": [2, 2, 2, "num_blocks", 8, 8]},
           "step": {"functions": {"decode": stored}}}
    spec = LLMSpec.from_json(raw)
    assert spec.layout("decode") is layout and spec.layout("missing") is None
    if layout is not None:
        assert layout.per_token == (layout is not Layout.FLAT)
        assert layout.composites == (((PAGED_ATTENTION.name, 1), (PAGED_ATTENTION.name, 2)) if layout is Layout.GATHER
                                     else ())


def test_the_step_signature_is_checked_against_the_contract_at_load():
    """The stored v1 golden artifact follows the contract; a function whose recorded signature
    departs from it (a dim renamed, the cache not donated, an extra padded dim) is refused when
    the artifact is read, naming the function and the input."""
    import dataclasses

    from hloserve.runtime.artifact import ArtifactError, LLMArtifact, read_manifest
    golden = os.path.join(os.path.dirname(__file__), "..", "golden", "tiny_llama_v1")
    art = LLMArtifact.read(golden)
    assert art.llm.layout("decode") is Layout.GATHER and art.llm.layout("prefill") is Layout.FLAT
    manifest = read_manifest(golden)
    decode = manifest.functions["decode"]
    renamed = dataclasses.replace(decode, inputs=tuple(
        dataclasses.replace(t, shape=("n_tokens",)) if t.name == "positions" else t for t in decode.inputs))
    for fn, match in [(renamed, r"'decode' input 'positions' is i32\[n_tokens\], the contract says i32\[num_tokens\]"),
                      (dataclasses.replace(decode, donated=()), "not logits and the donated 'kv_cache'"),
                      (dataclasses.replace(decode, paddable=("num_blocks",)), "pads only")]:
        bad = dataclasses.replace(manifest, functions={**manifest.functions, "decode": fn})
        with pytest.raises(ArtifactError, match=match):
            LLMArtifact.read(golden, bad)


@pytest.mark.parametrize("quant,row,holds", [("int8", 66, 3), ("int8_zp", 67, 4), ("fp8_e4m3", 66, 5),
                                             ("int4_zp", 67, None)])
def test_an_int8_kv_cache_reads_as_its_rows_say_and_an_unknown_one_is_refused_in_one_line(quant, row, holds):
    """kv_cache.quant "int8" (rows before 2026-11-28) and "int8_zp" (with a zero point) both read and
    serve as --kv-cache-dtype int8, "fp8_e4m3" as fp8_e4m3; a value this reader does not know is one
    line, not a misread cache."""
    from hloserve.runtime.artifact.errors import ArtifactError
    from hloserve.runtime.artifact.llm import KVCacheSpec

    raw = {"input": "kv_cache", "output": "kv_cache", "dtype": "i8", "quant": quant,
           "shape": [2, 2, 3, "num_blocks", 16, row]}
    if holds is None:
        with pytest.raises(ArtifactError, match=r"quant 'int4_zp' with dtype 'i8' is not a quantized KV cache this "
                                                r"reader understands \(int8 in i8, int8_zp in i8, fp8_e4m3 in i8\)") as e:
            KVCacheSpec.from_json(raw, "model.llm.kv_cache")
        assert "\n" not in str(e.value)
        return
    kv = KVCacheSpec.from_json(raw, "model.llm.kv_cache")
    assert (kv.stored_name, kv.holds_code, kv.holds_code.row_extra) == (quant.removesuffix("_zp"), holds, row - 64)
    assert KVCacheSpec.from_json(kv.to_json(), "again") == kv
