"""Damaged GGUF files are refused in one line, in bounded time, before anything is built from them.

A structure-aware fuzzer (tests/support/gguf_mutants.py, run by tests/support/gguf_fuzz.py) rewrites
the header, key-values and tensor infos of the real SmolLM2-135M-Instruct Q4_1 file: SEED's first
N_MUTANTS mutants (the same ones every run, every mutation kind in turn) plus three named cases, each
loaded in a worker process through load_gguf, the transformers config, the tokenizer and the HF model
built on the meta device. Each must end within LIMIT seconds as either a one-line SourceError naming
the file and no Python exception, or a load that builds. `benchmarks/fuzz_files.py` runs more of them
(docs/reliability.md).
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys

import pytest

from ..support import gguf_fuzz, gguf_mutants
from ..support.launch import free_port

SEED = 0
N_MUTANTS = 2 * len(gguf_mutants.KINDS)          # every kind twice
NAMED = ["named:block_count", "named:head_count", "named:context_length"]
LIMIT = 10.0                                     # seconds per mutant (issue 41)
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    from hloserve.exporter import presets
    return presets.resolve("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="module")
def results(smollm2_gguf, tmp_path_factory) -> dict[str, gguf_fuzz.Result]:
    work = str(tmp_path_factory.mktemp("gguf-fuzz"))
    try:
        got = gguf_fuzz.run_mutants(smollm2_gguf, SEED, [str(i) for i in range(N_MUTANTS)] + NAMED, work,
                                       limit=LIMIT)
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the last mutant is a 98 MB file
    return {r.spec: r for r in got}


def _problem(r: gguf_fuzz.Result) -> str | None:
    """What is wrong with one mutant's outcome, or None."""
    if r.outcome not in ("refused", "loaded"):
        return f"{r.outcome}: {r.message}"
    if r.seconds >= LIMIT:
        return f"took {r.seconds:.1f} s"
    if r.outcome == "refused":
        if "\n" in r.message or not r.message.strip():
            return f"not one line: {r.message!r}"
        if EXCEPTION_NAME.search(r.message):
            return f"names a Python exception: {r.message}"
        if not re.match(r"model\.gguf: |\S*model\.gguf is not a readable GGUF file", r.message):
            return f"does not name the file first: {r.message}"
    return None


def test_every_mutant_is_refused_in_one_line_or_builds(results):
    assert len(results) == N_MUTANTS + len(NAMED)
    problems = [f"{r.spec} ({r.mutation}): {_problem(r)}" for r in results.values() if _problem(r)]
    assert not problems, "\n".join(problems)
    outcomes = [r.outcome for r in results.values()]
    # the fuzzer reaches both sides: most mutants damage the file, some only change what it may say
    assert outcomes.count("refused") >= N_MUTANTS // 2 and outcomes.count("loaded") >= 1, outcomes
    kinds = {r.mutation.split(":")[0] for r in results.values()}
    assert kinds >= {k.__name__[2:] for k in gguf_mutants.KINDS}, kinds


@pytest.mark.parametrize("spec,message", [
    ("named:block_count", "model.gguf: llama.block_count = 1000000 but the file has tensors for 30 layers "
                          "(blk.0..blk.29; blk.30 has none); the file is damaged or mislabelled: re-convert it"),
    ("named:head_count", "model.gguf: llama.attention.head_count = 0; it must be at least 1; the file is damaged or "
                         "mislabelled: re-convert it"),
    ("named:context_length", "model.gguf: llama.context_length = 0; it must be 1..16777216 tokens; the file is "
                             "damaged or mislabelled: re-convert it"),
])
def test_named_damage_is_refused_naming_the_field(results, spec, message):
    r = results[spec]
    assert (r.outcome, r.message) == ("refused", message)
    assert r.seconds < LIMIT


@pytest.fixture(scope="module")
def damaged_files(smollm2_gguf, tmp_path_factory) -> dict[str, str]:
    """The named mutants and a header count past the file, written for the CLI."""
    base = gguf_mutants.Base.parse(smollm2_gguf)
    out = tmp_path_factory.mktemp("gguf-damaged")
    files = {}
    for spec in NAMED:
        _, layout = gguf_mutants.make(base, SEED, spec)
        files[spec] = str(out / f"{spec.split(':')[1]}.gguf")
        layout.write(files[spec])
    layout = copy.deepcopy(base.layout)
    layout.tensor_count = 2**63
    files["tensor_count"] = str(out / "tensor_count.gguf")
    layout.write(files["tensor_count"])
    return files


@pytest.mark.parametrize("spec,fragment", [
    ("named:block_count", "block_count.gguf: llama.block_count = 1000000 but the file has tensors for 30 layers"),
    ("named:head_count", "head_count.gguf: llama.attention.head_count = 0; it must be at least 1"),
    ("named:context_length", "context_length.gguf: llama.context_length = 0; it must be 1..16777216 tokens"),
    ("tensor_count", "tensor_count.gguf: GGUF.tensor_count = 9223372036854775808, but the"),
])
def test_export_cli_refuses_a_damaged_file_in_one_line(damaged_files, tmp_path, spec, fragment):
    out = tmp_path / "art"
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "export", damaged_files[spec], "-o", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("hloserve: error: ")]
    # one error line, the last; before it only the progress lines ("[hloserve  0.0s] loading ...")
    assert p.returncode == 1 and errors == lines[-1:], p.stderr[-3000:]
    assert all(ln.startswith("[hloserve ") for ln in lines[:-1]), p.stderr[-3000:]
    assert errors[0].startswith(f"hloserve: error: {fragment}"), errors[0]
    assert not EXCEPTION_NAME.search(errors[0])
    assert not out.exists()


def test_serve_refuses_a_damaged_file_instead_of_never_becoming_ready(damaged_files, tmp_path):
    """`hloserve serve FILE.gguf` with block_count = 1000000 used to build a million-layer model and
    never become ready; now its export refuses the file and the command exits (no server starts)."""
    env = {**os.environ, "HLOSERVE_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", damaged_files["named:block_count"],
                        "--port", str(free_port())], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("hloserve: error: ")]
    assert p.returncode == 1 and errors, p.stderr[-3000:]
    assert errors[0].startswith("hloserve: error: block_count.gguf: llama.block_count = 1000000 but the file has "
                                "tensors for 30 layers"), errors
    assert not any(EXCEPTION_NAME.search(ln) for ln in errors), errors
    artifacts = tmp_path / "cache" / "artifacts"
    assert not (artifacts.exists() and os.listdir(artifacts))          # no half-written export left behind
