"""A bounded soak in the suite: benchmarks/soak.py for 45 seconds on the tiny Llama of conftest.py.

The script starts its own server (a KV cache of 31 blocks of 16 tokens for up to 8 sequences of
up to 256 tokens, so the mix runs through preemption) and keeps 16 clients busy with the soak's
request mix (streams, chat, structured output, n=2, 20% leavers). Checked from its JSON summary: no
errors, every request accounted for (client side and the engine's finish counts), every KV block free
again when idle, no compile after warm-up. Latencies are reported by the script, never asserted here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_ARGS = "--max-num-seqs 8 --max-num-batched-tokens 32 --max-model-len 256 --num-blocks 32 --model-name tiny-chat"


def test_soak_on_the_tiny_model_leaks_nothing(tiny_chat_llm, tmp_path):
    _, art = tiny_chat_llm
    out = tmp_path / "soak.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--artifact", art, "--minutes", "0.75",
           "--concurrency", "16", "--seed", "0", "--report-every", "15", "--server-args", SERVER_ARGS,
           "--cache", os.environ["HLOSERVE_CACHE"], "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(run.stdout)
    assert out.exists(), f"no summary (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    s = json.loads(out.read_text())
    assert s["errors"] == 0, s["error_samples"]
    assert s["accounted"], (s["requests"], s["completed"], s["left"], s["engine_requests_sent"], s["engine_finished"])
    assert s["requests"] == s["completed"] + s["left"] > 100
    assert s["engine_finished_total"] == s["engine_requests_sent"]
    assert set(s["by_kind"]) == {"stream", "plain", "chat", "structured", "n2", "leave_stream", "leave_sent"}
    assert s["used_blocks"] == 0 and s["free_blocks"] == s["total_blocks"] == 31
    assert s["compiles_after_warmup"] == 0
    assert s["preemptions"] > 0                  # the small cache forced recomputation
    assert s["failures"] == [] and run.returncode == 0, (s["failures"], run.stderr[-4000:])
