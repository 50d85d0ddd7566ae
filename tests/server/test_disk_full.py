"""`hloserve serve` with its cache root on a full disk (a small tmpfs, tests/support/disk.py): it
compiles without caching, says so in one warning line, and serves transformers' greedy text; it
leaves nothing half-written that a later start would read; the next start on the same cache root, now
with room, serves the same text and fills the cache.

The CPU kernel library is the suite's (HLOSERVE_KERNEL_CACHE, tests/conftest.py), not rebuilt twice
here: the library on a full disk, kept for the process with one warning and never half-written, is
tests/runtime/test_disk_full.py's. (`hloserve export` on a full disk: tests/exporter/test_cli.py.)
"""
from __future__ import annotations

import glob
import os

import httpx
import pytest

from hloserve.runtime._private import unreadable_compile_cache_entries
from tests.support.disk import fill, files_under, small_disk

from .servers import hf_greedy, running_server

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
SERVER_ARGS = ("--model-name", MODEL, "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "64")
PROMPT = "The capital of France is"
TOKENS = 12


def greedy_text(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def serve_once(art: str, cache: str, log_dir: str) -> tuple[str, str]:
    """(the greedy text, the server's log) of one start of `hloserve serve` on `cache`."""
    os.makedirs(log_dir)
    with running_server(art, *SERVER_ARGS, env={"HLOSERVE_CACHE": cache}, log_dir=log_dir) as (base, _):
        text = greedy_text(base)
    (log,) = glob.glob(os.path.join(log_dir, "server-*.log"))
    with open(log) as f:
        return text, f.read()


def test_serving_on_a_full_cache_disk_then_with_room_gives_the_same_greedy_text(tiny_chat_llm, tmp_path):
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    hf, art = tiny_chat_llm
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    want = tok.decode(hf_greedy(hf, tok.encode(PROMPT), TOKENS))
    with small_disk(str(tmp_path / "disk"), "64m") as cache:
        filler = fill(cache, leave=64 << 10)       # room for a few small files; no kernel library, no executable
        text, log = serve_once(art, cache, str(tmp_path / "full"))
        assert text == want
        assert "Traceback" not in log, log[-3000:]
        assert log.count("compiled executables are not cached for the rest of this process") == 1, log[-3000:]
        left = files_under(cache)
        assert not [f for f in left if "partial" in f or f.startswith(("kernels/", "xla/executables/"))], left
        assert unreadable_compile_cache_entries(os.path.join(cache, "xla"), 0) == [], left

        os.remove(filler)
        text, log = serve_once(art, cache, str(tmp_path / "room"))
        assert text == want
        assert "cannot be kept" not in log and "is full" not in log, log[-3000:]
        written = files_under(cache)
        assert [f for f in written if f.startswith("xla/executables/")], written


def test_serving_a_gguf_file_on_a_full_cache_disk_says_so_in_one_line(tmp_path):
    """`hloserve serve FILE.gguf` exports the file into the cache first; on a full disk the export
    fails and `serve` says why in one line, its own (the export's error, not "see above"), exit 1."""
    import subprocess
    import sys

    from hloserve.exporter import presets
    gguf = presets.resolve("smollm2-135m-instruct")
    with small_disk(str(tmp_path / "disk"), "16m") as cache:
        fill(cache, leave=64 << 10)
        env = dict(os.environ, HLOSERVE_CACHE=cache)
        proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", gguf, "--port", "0"],
                              capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hloserve: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "the disk is full" in errors[0] and "see above" not in errors[0], errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
