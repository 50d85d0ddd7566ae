"""The real all-MiniLM-L6-v2 artifact through the runtime: padded batches match transformers, strict serving.

Tolerance: atol 1e-4 in f32 (as the exporter's parity test).
"""
from __future__ import annotations

import numpy as np
import pytest

from hloserve import runtime
from hloserve.runtime.client import compile_events

ATOL = 1e-4


def test_minilm_buckets_strict_matches_transformers(minilm_dir, minilm_artifact, tmp_path):
    import torch
    import transformers
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    model = runtime.load(minilm_artifact, cache_dir=str(tmp_path), buckets={"batch": [4, 8]}, strict=True)
    fn = model.functions["forward"]
    assert fn.buckets.sizes == {"batch": (4, 8)}            # seq is not paddable: it compiles per size
    assert model.warmup(sizes={"seq": [16]}) == 2
    backend = compile_events().backend_compiles
    for batch in (3, 5, 8, 1):
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(1000, 29000, (batch, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, 10:] = 0
        tt = torch.zeros_like(ids)
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.numpy()
        got = fn(input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=tt.numpy())
        assert got["last_hidden_state"].shape == (batch, 16, 384)
        np.testing.assert_allclose(np.asarray(got["last_hidden_state"]), want, atol=ATOL, rtol=0)
    assert fn.stats.compiles == 2 and compile_events().backend_compiles == backend
    ids = np.ones((2, 17), np.int64)
    with pytest.raises(runtime.RecompileError, match=r"'forward'.*seq=17.*new seq=17"):
        fn(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids)
