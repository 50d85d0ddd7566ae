"""Speculative decoding with a draft model through `hloserve serve`: the default model (SmolLM2-135M-Instruct,
bf16) drafted by its own int8 export (self-speculation with a quantized draft, both exported into the test
cache on first use): the same greedy text as without speculation, most proposals accepted, seeded sampling
drawing the same text, requests drafting together (batched draft calls) answering what they answer
alone, vLLM's counters in /metrics; a draft with another vocabulary refused in one line.
Clients: the openai SDK and httpx on loopback."""
from __future__ import annotations

import json

import pytest

from .servers import metric, running_server
from .test_serve_spec import COPY, PASSAGE, client, invariant_default

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def draft_artifact():
    """The default preset exported with int8 weights (and the default's bf16 KV cache)."""
    from hloserve.server.serve import DEFAULT_PRESET, default_artifact
    return default_artifact(DEFAULT_PRESET, "int8", "bfloat16")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, draft_artifact):
    """(base URL without speculation, base URL with the int8 draft): both serving the batch-invariant
    default (what `serve --speculative-config` exports), so speculation is all that differs."""
    logs = str(tmp_path_factory.mktemp("serve-draft"))
    spec = json.dumps({"model": draft_artifact, "num_speculative_tokens": 4})
    art = invariant_default()
    with running_server(art, "--served-model-name", MODEL, "--max-num-seqs", "8", ready_timeout=1200,
                        log_dir=logs) as (plain, _):
        with running_server(art, "--served-model-name", MODEL, "--max-num-seqs", "8", "--speculative-config", spec,
                            ready_timeout=1200, log_dir=logs) as (draft, _):
            yield plain, draft


def acceptance(base: str) -> tuple[float, float]:
    import httpx
    m = httpx.get(f"{base}/metrics").text
    return (metric(m, "vllm:spec_decode_num_drafts_total"), metric(m, "vllm:spec_decode_num_accepted_tokens_total")
            / metric(m, "vllm:spec_decode_num_draft_tokens_total"))


def test_greedy_text_is_the_same_and_most_proposals_are_accepted(servers):
    """A copy and an open-ended question: the same greedy text and usage as the plain server (prompts
    without near-ties, see test_serve_spec.py); the int8 draft agrees with its bf16 target on most
    tokens (measured 2026-11-28: acceptance in the test's log line)."""
    asks = [COPY, [{"role": "user", "content": "Explain how bread is baked, in a few sentences."}]]
    for messages in asks:
        answers = [client(b).chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
                   for b in servers]
        a, b = (r.choices[0].message.content for r in answers)
        assert a == b, (a, b)
        assert answers[0].usage == answers[1].usage
    drafts, rate = acceptance(servers[1])
    print(f"draft model: {drafts:.0f} drafts, acceptance {rate:.2f}")
    assert drafts > 0 and rate > 0.5
    stream = client(servers[1]).chat.completions.create(model=MODEL, messages=COPY, max_tokens=64, temperature=0,
                                                        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == client(servers[0]).chat.completions.create(model=MODEL, messages=COPY, max_tokens=64,
                                                               temperature=0).choices[0].message.content


def test_requests_drafting_together_give_the_plain_servers_text(servers):
    """Three requests at once (they propose in the same steps: the draft model runs them batched,
    catch-ups sharing calls) answer what the plain server answers them one at a time. Copies of a
    passage, whose greedy choices are far from ties, of three lengths, so they end in different steps."""
    import concurrent.futures
    lengths = (24, 40, 64)
    want = [client(servers[0]).chat.completions.create(model=MODEL, messages=COPY, max_tokens=n, temperature=0)
            .choices[0].message.content for n in lengths]
    before = acceptance(servers[1])[0]
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        got = list(pool.map(lambda n: client(servers[1]).chat.completions.create(
            model=MODEL, messages=COPY, max_tokens=n, temperature=0).choices[0].message.content, lengths))
    assert got == want
    assert acceptance(servers[1])[0] > before


def test_seeded_sampling_draws_the_same_text(servers):
    """Each position draws what it draws without speculation (verify_draft: a point-mass proposal is kept
    with probability p(token), else a draw from p without it), so a seeded request's text is the same."""
    prompt = f"{PASSAGE}\n\nWrite the next sentence of this story:"
    texts = [client(b).completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0.8, seed=1234)
             .choices[0].text for b in servers]
    assert texts[0] == texts[1], texts


def test_a_draft_with_another_vocabulary_is_refused(servers, tmp_path):
    """A tiny random Llama of 128 tokens as the draft: one line naming both vocabularies."""
    from hloserve.runtime.artifact.errors import HloserveError
    from hloserve.server.config import ServeConfig
    from hloserve.server.core.spec_decode import SpeculativeConfig
    from hloserve.server.serve import default_artifact
    from hloserve.server.wiring import build_engine

    from .conftest import export_tiny_llama
    _, tiny = export_tiny_llama(tmp_path, "tiny", vocab=128)
    spec = SpeculativeConfig(method="draft_model", model=tiny, num_speculative_tokens=2)
    with pytest.raises(HloserveError) as e:
        build_engine(default_artifact(), ServeConfig(speculative_config=spec))
    msg = str(e.value)
    assert "\n" not in msg and "vocab 128" in msg and "vocab 49152" in msg, msg
