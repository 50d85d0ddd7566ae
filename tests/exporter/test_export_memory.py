"""Weights stream to disk: exporting holds no second copy of the model.

A ~300 MB bf16 MLP is built and exported in a fresh subprocess; its peak RSS
(VmHWM) may exceed the RSS after building the model by at most half the
weight bytes (capture and lowering need ~100 MB of their own; one extra copy of
the weights would need 300 MB). benchmarks/export.py measures the same for a
1B-parameter Llama.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, resource, sys, tempfile
import psutil, torch
from hloserve.exporter.export import EntryPoint, export_artifact

layers, dim = 4, 6144
prev = torch.get_default_dtype()
torch.set_default_dtype(torch.bfloat16)          # built in bf16: no f32 copy to begin with
model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers))).eval()
torch.set_default_dtype(prev)
weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
rss_model = psutil.Process().memory_info().rss
with tempfile.TemporaryDirectory() as out:
    export_artifact(out, [EntryPoint("forward", model, (torch.randn(2, dim, dtype=torch.bfloat16),))], source="t")
    file_bytes = os.path.getsize(os.path.join(out, "weights.safetensors"))
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024  # VmHWM: this address space only (ru_maxrss survives exec, so it would include the forking parent)
print(json.dumps(dict(weight_bytes=weight_bytes, file_bytes=file_bytes, rss_model=rss_model, peak=peak)))
"""


@pytest.mark.slow
def test_export_streams_weights_without_a_second_copy():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["weight_bytes"] > 300e6
    assert r["file_bytes"] >= r["weight_bytes"]  # every weight was written
    extra = r["peak"] - r["rss_model"]
    assert extra <= 0.5 * r["weight_bytes"], (
        f"export needed {extra / 2**20:.0f} MiB over the built model's RSS for "
        f"{r['weight_bytes'] / 2**20:.0f} MiB of weights: a copy of the weights is being made")
