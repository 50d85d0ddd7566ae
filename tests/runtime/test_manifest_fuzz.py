"""A damaged manifest.json is refused with one ArtifactError line, never another exception.

Mutants of the golden tiny Llama's manifest (tests/support/manifest_mutants.py: a key deleted, a value
of another type, a negative or huge number, a changed string, a list emptied or shortened, a key added
or renamed, the text cut short) go through read_manifest, runtime.load and LLMArtifact.read (what a
server reads at start). SEED's first N_MUTANTS every run; `benchmarks/fuzz_files.py --manifests N`
runs more (docs/reliability.md).
"""
from __future__ import annotations

import json
import os
import re

import pytest

from ..support import manifest_mutants

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "tiny_llama_v1")
SEED = 0
N_MUTANTS = 150
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


def _raw() -> dict:
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        return json.load(f)


def test_every_manifest_mutant_is_refused_in_one_line_or_loads(tmp_path):
    raw, outcomes, problems = _raw(), [], []
    for i in range(N_MUTANTS):
        mutation, text = manifest_mutants.mutant_text(raw, SEED, i)
        path = str(tmp_path / str(i))
        manifest_mutants.artifact_copy(GOLDEN, path, text)
        outcome, message = manifest_mutants.try_artifact(path)
        outcomes.append(outcome)
        if outcome == "error" or outcome == "refused" and ("\n" in message or EXCEPTION_NAME.search(message)):
            problems.append(f"{i} ({mutation}): {outcome}: {message}")
    assert not problems, "\n".join(problems)
    assert outcomes.count("refused") >= N_MUTANTS // 2 and outcomes.count("loaded") >= 1, outcomes


def _mutated(tmp_path, change) -> str:
    raw = _raw()
    change(raw)
    path = str(tmp_path / "art")
    manifest_mutants.artifact_copy(GOLDEN, path, json.dumps(raw))
    return path


@pytest.mark.parametrize("change,message", [
    (lambda m: m["functions"].__setitem__("../../x", m["functions"].pop("decode")),
     r"functions\.\.\./\.\./x is .*, not an object named by a plain file name"),
    (lambda m: m["functions"]["prefill"]["files"].__setitem__("../weights.safetensors", "0" * 64),
     r"functions\.prefill\.files is .*, not an object of plain file names"),
    (lambda m: m["symbols"]["num_seqs"].__setitem__("max", -1), r"symbols\.num_seqs\.max is -1, not null or an int >= min"),
    (lambda m: m["functions"]["decode"]["inputs"][0].__setitem__("shape", ["2*"]),
     r"functions\.decode\.inputs\[0\]\.shape is \[\"2\*\"\], not a list of dims"),
    (lambda m: m["functions"]["decode"]["weights"].append("model.nope"),
     r"functions\.decode\.weights is \[\"model\.nope\"\], not names of weights the manifest declares"),
    (lambda m: m.__setitem__("format_version", True), r"has no integer format_version >= 1"),
])
def test_named_manifest_damage_is_refused_naming_the_field(tmp_path, change, message):
    outcome, got = manifest_mutants.try_artifact(_mutated(tmp_path, change))
    assert outcome == "refused" and re.search(message, got), got
    assert got.endswith("the artifact is corrupted, re-export it")
