"""The real all-MiniLM-L6-v2 checkpoint: ONE artifact with dynamic batch x seq matches torch eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch

ATOL = 1e-4  # f32, per the exporter issue


@pytest.mark.parametrize("batch,seq", [(1, 7), (3, 33), (8, 128)])
def test_minilm_matches_eager(minilm_dir, minilm_artifact, batch, seq):
    import transformers

    from hloserve.runtime import load
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    model = load(minilm_artifact)
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(1000, 29000, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[-1, seq // 2:] = 0  # a padded row
    tt = torch.zeros_like(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.numpy()
    got = model.functions["forward"](input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=tt.numpy())
    np.testing.assert_allclose(np.asarray(got["last_hidden_state"]), want, atol=ATOL, rtol=0)


def test_minilm_symbolic_shapes_in_stablehlo(minilm_artifact):
    import json
    import os
    import re
    with open(os.path.join(minilm_artifact, "manifest.json")) as f:
        manifest = json.load(f)
    fn = manifest["functions"]["forward"]
    assert [t["shape"] for t in fn["inputs"]] == [["batch", "seq"]] * 3
    assert manifest["symbols"] == {"batch": {"min": 1, "max": 64}, "seq": {"min": 1, "max": 512}}
    text = open(os.path.join(minilm_artifact, "functions", "forward.mlir")).read()
    assert re.search(r"tensor<\?x\?xi32>", text)
    # weights are arguments, never dense constants over 1 KiB
    for m in re.finditer(r'dense<"0x([0-9A-Fa-f]+)">', text):
        assert len(m.group(1)) // 2 <= 1024
