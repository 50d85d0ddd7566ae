"""`hloserve serve` with no artifact: the real SmolLM2-135M-Instruct, end to end.

The first run exports the preset into the hloserve cache (HLOSERVE_CACHE, default
~/.cache/hloserve; several minutes on 2 cores), later runs reuse it. The greedy chat answer
must name Paris and equal, token for token, transformers' greedy generation on the same
dequantized weights computed the way the default artifact computes them (its Linears on
bf16-rounded weights and inputs with f32 sums, K and V rounded to bf16: `hloserve serve`'s
DEFAULT_EXPORT_FLAGS; K is rounded before RoPE there, after it here).
"""
from __future__ import annotations

import pytest

from ..reference import hf_with_mixed_linears
from .servers import hf_greedy, running_server

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER_TOKENS = 12


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """The server on the default model. Where the artifact is not exported yet (a fresh cache root),
    first plant what a start killed mid-export leaves (benchmarks/chaos.py found it once stopping
    every later start): a directory at the artifact's path with no manifest, a dead process's
    `.partial-PID` export and its export child's `.partial-PID.partial-PID2`; the start must remove
    them all and export."""
    import os

    from hloserve.runtime.paths import made_once
    from hloserve.server.serve import default_artifact_path
    path = default_artifact_path()
    with made_once(path):     # not while a worker sharing the cache exports it
        if not os.path.exists(os.path.join(path, "manifest.json")):
            _plant_a_killed_export(path)
    with running_server(None, "--max-num-seqs", "4", ready_timeout=1200,
                        log_dir=str(tmp_path_factory.mktemp("serve-default"))) as (base, _):
        assert os.path.exists(os.path.join(path, "manifest.json"))
        # only this artifact's leftovers: the directory is shared with other artifacts that other
        # workers may be exporting right now
        mine = f"{os.path.basename(path)}.partial-"
        assert not any(name.startswith(mine) for name in os.listdir(os.path.dirname(path)))
        yield base


def _plant_a_killed_export(path: str) -> None:
    import os
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for d in (path, f"{path}.partial-{dead.pid}", f"{path}.partial-{dead.pid}.partial-{dead.pid + 1}"):
        os.makedirs(os.path.join(d, "weights"), exist_ok=True)
        with open(os.path.join(d, "weights", "half.safetensors"), "wb") as f:
            f.write(b"\0" * 1024)


def test_default_model_answers_the_capital_of_france(default_server):
    import openai
    client = openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=ANSWER_TOKENS,
                                       temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer

    # the same tokens as transformers' greedy generation on the GGUF's weights (dequantized), with
    # the default artifact's matmul rounding
    import torch
    import transformers

    from hloserve.exporter import presets
    from hloserve.runtime import artifact
    from hloserve.exporter.gguf.checkpoint import load_gguf
    from hloserve.server.serve import default_artifact
    from hloserve.server.text.tokenizer import Tokenizer

    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    cfg = transformers.LlamaConfig(**{k: v for k, v in ckpt.config.items() if k not in ("architectures", "model_type")})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict({k: torch.as_tensor(v) for k, v in ckpt.materialize().items()},
                                             strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected   # the head is tied to the embedding
    hf.tie_weights()
    art = default_artifact()
    model = artifact.read_manifest(art).model
    assert model["weight_dtype"] == "bf16" and model["llm"]["kv_cache"]["holds"] == "bf16"
    hf_with_mixed_linears(hf, kv_dtype=torch.bfloat16)
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    want = hf_greedy(hf, tok.encode_chat(QUESTION), r.usage.completion_tokens)
    assert r.usage.prompt_tokens == len(tok.encode_chat(QUESTION))
    assert answer == tok.decode(want, skip_special_tokens=True), (answer, tok.decode(want))


def readme_python_examples() -> list[str]:
    """The ```python blocks of the README."""
    import os
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_openai_example_runs_verbatim(default_server, capsys):
    """The README's Python example against `hloserve serve` (the default model, its preset name),
    changed only in the port."""
    (example,) = [b for b in readme_python_examples() if "OpenAI(" in b]
    assert "http://127.0.0.1:8000/v1" in example
    code = example.replace("http://127.0.0.1:8000/v1", f"{default_server}/v1")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "the example printed no answer"


def test_readme_example_names_paris_at_the_presets_sampling(default_server):
    """The README's example leaves temperature out: the server samples with the preset's model-card
    defaults (temperature 0.2, top_p 0.9, in the artifact's generation_config.json); issue 38 asks
    for Paris in at least 9 of 10 draws (the example as written, each run given its own seed; at
    temperature 1 with no top_p the answers were gibberish).

    The example asks for one sentence. The bare question ("What is the capital of France?") named
    Paris in 21 of 30 draws (2026-11-29): on the Q4_1 file the answer's first token is a near-tie
    ('The' 0.155, 'L' 0.140 at temperature 1), top_p 0.9 keeps both, and an answer opening 'L' is
    "L'Étoile, la Marseillaise, ...". Asked for one sentence, it named Paris in 130 of 130 (seeds
    0-129), each time "The capital of France is Paris."."""
    import concurrent.futures

    (example,) = [b for b in readme_python_examples() if "OpenAI(" in b]
    assert "temperature" not in example and "create(" in example

    def run(seed: int) -> str:
        code = example.replace("http://127.0.0.1:8000/v1", f"{default_server}/v1").replace(
            "create(", f"create(seed={seed}, ")
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
        return scope["r"].choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(run, range(10)))
    assert sum("Paris" in a for a in answers) >= 9, answers


def test_default_model_is_listed_under_its_preset_name_with_its_defaults(default_server):
    import httpx
    models = httpx.get(f"{default_server}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["smollm2-135m-instruct"]
    assert models[0]["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9}
