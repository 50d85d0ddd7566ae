"""Two hosts, one model: `hloserve serve --distributed` as two jax processes on this machine.

Each process has one CPU device; the step is split over both (`--tensor-parallel-size 2`), the
cross-process collectives are jax's own (gloo on CPU). Process 0 serves HTTP and schedules;
process 1 runs every step it sends. Greedy completions through the openai client equal
transformers' on the same weights, and when the leader stops, the follower is released and exits
cleanly.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server.servers import hf_greedy, running_server
from tests.support.launch import free_port

pytestmark = pytest.mark.slow


def test_two_processes_serve_one_split_model(tiny_chat_llm, tmp_path):
    import openai

    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    hf, art = tiny_chat_llm          # 4 query heads over 2 KV heads: one KV head per process
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    opts = ["--tensor-parallel-size", "2", "--distributed", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--max-model-len", "128"]
    run = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2"}
    log = open(tmp_path / "follower.log", "w")
    follower = subprocess.Popen([sys.executable, "-m", "hloserve.server.cli", "serve", art, *opts],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **run, "JAX_PROCESS_ID": "1"})
    try:
        prompts = [tok.encode(t) for t in ("Once upon a time", "The capital of France is a city where")]
        with running_server(art, *opts, env={**run, "JAX_PROCESS_ID": "0"}, log_dir=str(tmp_path)) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            name = client.models.list().data[0].id
            for p in prompts:
                r = client.completions.create(model=name, prompt=p, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].text == tok.decode(hf_greedy(hf, p, 16))
        assert follower.wait(60) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
        log.close()
    out = (tmp_path / "follower.log").read_text()
    assert "running the leader's steps" in out and "the leader stopped after" in out, out[-3000:]
