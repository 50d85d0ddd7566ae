"""Generation defaults as vLLM applies them: a checkpoint's generation_config.json fills the sampling
fields a request leaves out (`hloserve serve --generation-config auto|none|PATH`,
`--override-generation-config JSON`), and a request's own fields always win.

The model is a tiny random-init Llama with SmolLM2's tokenizer (tests/server/conftest.py) whose
Hugging Face directory carries a generation_config.json with top_k 1: sampling that keeps only the
most likely token is greedy, so "the defaults applied" is checked token for token against
transformers' greedy generation, and "the request's fields won" by the same tokens differing.
Real servers on loopback, driven by the openai SDK.
"""
from __future__ import annotations

import glob
import json
import os

import pytest

from .conftest import export_tiny_llama
from .servers import hf_greedy, running_server

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time"
# the checkpoint's own: greedy through top_k 1 (at a temperature the request-level tests undo)
CHECKPOINT = {"do_sample": True, "temperature": 0.7, "top_k": 1, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """(transformers model, artifact, token ids of PROMPT): the tiny Llama exported from a Hugging
    Face directory whose generation_config.json is CHECKPOINT."""
    from hloserve.exporter import presets
    from hloserve.exporter.gguf.checkpoint import load_gguf
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer

    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    st = ckpt.special_tokens
    files = {"tokenizer.json": ckpt.tokenizer_json,
             "tokenizer_config.json": json.dumps({"chat_template": ckpt.chat_template, "add_bos_token": False}),
             "generation_config.json": json.dumps({**CHECKPOINT, "eos_token_id": st.eos_token_id})}
    hf, art = export_tiny_llama(tmp_path_factory.mktemp("gen-llm"), "tiny-gen", ckpt.config["vocab_size"], files,
                                bos_token_id=st.bos_token_id, eos_token_id=st.eos_token_id)
    ids = Tokenizer.from_artifact(artifact.LLMArtifact.read(art)).encode(PROMPT)
    return hf, art, ids


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(base, extra: dict | None = None, **fields) -> tuple[str, int]:
    """(text, tokens) of PROMPT's completion with `fields` (and `extra`, vLLM's fields), past EOS."""
    r = client(base).completions.create(model="tiny-gen", prompt=PROMPT,
                                        extra_body={"ignore_eos": True, **(extra or {})}, **fields)
    return r.choices[0].text, r.usage.completion_tokens


def greedy_text(llm, n):
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    hf, art, ids = llm
    return Tokenizer.from_artifact(artifact.LLMArtifact.read(art)).decode(hf_greedy(hf, ids, n))


def defaults_listed(base) -> list[dict]:
    """Each /v1/models entry's generation_defaults, read through the openai SDK's Model objects."""
    return [m.model_extra["generation_defaults"] for m in client(base).models.list().data]


@pytest.fixture(scope="module")
def auto_server(llm, tmp_path_factory):
    _, art, _ = llm
    log_dir = str(tmp_path_factory.mktemp("gen-auto"))
    with running_server(art, "--max-num-seqs", "4", "--max-model-len", "128", "--served-model-name", "tiny-gen",
                        log_dir=log_dir) as (base, _):
        yield base, log_dir


def test_the_checkpoints_generation_config_applies_and_is_shown(auto_server, llm):
    base, log_dir = auto_server
    assert defaults_listed(base) == [{"temperature": 0.7, "top_k": 1, "max_tokens": 6}]
    # no sampling field: top_k 1 (greedy) and max_new_tokens 6 as max_tokens, whatever the seed
    for seed in (1, 2):
        assert complete(base, seed=seed) == (greedy_text(llm, 6), 6)
    (log,) = glob.glob(os.path.join(log_dir, "server-*.log"))
    lines = [line for line in open(log) if "generation defaults:" in line]
    assert len(lines) == 1 and '"top_k": 1' in lines[0] and "generation_config.json" in lines[0], lines


def test_a_requests_own_fields_win(auto_server, llm):
    base, _ = auto_server
    assert complete(base, max_tokens=3) == (greedy_text(llm, 3), 3)
    # top_k -1 turns the default top_k off: at temperature 1 over a random model's ~flat distribution
    # of 49152 tokens, six draws equal to the greedy six are out of reach
    text, n = complete(base, {"top_k": -1}, seed=5, temperature=1.0)
    assert n == 6 and text != greedy_text(llm, 6)
    # greedy stays one field away whatever the defaults
    assert complete(base, temperature=0, max_tokens=4) == (greedy_text(llm, 4), 4)


def test_generation_config_none_restores_the_neutral_defaults(llm):
    hf, art, _ = llm
    with running_server(art, "--max-num-seqs", "4", "--max-model-len", "128", "--served-model-name", "tiny-gen",
                        "--generation-config", "none") as (base, _):
        assert defaults_listed(base) == [{}]
        # temperature 1, no top-k, and completions' own max_tokens default (16): not greedy
        text, n = complete(base, seed=5)
        assert n == 16 and text != greedy_text(llm, 16)


def test_a_generation_config_path_with_an_override_merged_over_it(llm, tmp_path):
    _, art, _ = llm
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 1,
                                                                 "max_new_tokens": 9}))
    override = json.dumps({"max_new_tokens": 4, "top_p": 0.8})
    with running_server(art, "--max-num-seqs", "4", "--max-model-len", "128", "--served-model-name", "tiny-gen",
                        "--generation-config", str(tmp_path), "--override-generation-config", override) as (base, _):
        assert defaults_listed(base) == [{"temperature": 0.5, "top_k": 1, "top_p": 0.8, "max_tokens": 4}]
        assert complete(base, seed=3) == (greedy_text(llm, 4), 4)


@pytest.mark.parametrize("args,fragment", [
    (["--override-generation-config", "{temperature: 1}"], "is not JSON"),
    (["--override-generation-config", "[1]"], "is a JSON list"),
    (["--override-generation-config", '{"temprature": 0.5}'], "unknown field(s) 'temprature'"),
    (["--override-generation-config", '{"temperature": -1}'], "temperature=-1: must be"),
    (["--override-generation-config", '{"top_p": "high"}'], "top_p='high'"),
    (["--generation-config", "/nonexistent/gen"], "/nonexistent/gen does not exist"),
])
def test_a_bad_generation_config_is_one_line_from_the_cli(args, fragment, capsys, tmp_path):
    """Refused by ServeConfig at the edge, before any artifact is read (or the default model exported)."""
    from hloserve.server.cli import main
    assert main(["serve", str(tmp_path / "not-read"), *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hloserve: error: ") and fragment in err, err


def test_a_bad_value_in_the_artifacts_own_file_is_one_line(llm, tmp_path):
    """--generation-config auto reads the artifact's file when the service is built: a value
    SamplingParams refuses stops the start, before anything compiles, with one line naming the file."""
    import shutil
    import subprocess
    import sys

    _, art, _ = llm
    copy = str(tmp_path / "art")
    shutil.copytree(art, copy)
    with open(os.path.join(copy, "generation_config.json"), "w") as f:
        json.dump({"top_p": 0}, f)
    r = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "serve", copy, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    assert errors[0].startswith("hloserve: error: ") and "generation_config.json: top_p=0" in errors[0], r.stderr
