"""Speculative decoding through `hloserve serve` on the default model (SmolLM2-135M-Instruct) exported
batch-invariant, as `serve --speculative-config` exports it (into the test cache on first use), both
servers on that artifact: the same greedy text, tokens and logprobs (bit for bit) with and without
`--speculative-config`, max_tokens and stop strings exact when a step accepts several tokens, and
vLLM's counters in /metrics. Clients: the openai SDK and httpx on loopback."""
from __future__ import annotations

import json

import pytest

from .servers import metric, running_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PASSAGE = ("The old lighthouse stood at the edge of the cliff for nearly two hundred years. Every night its keeper "
           "climbed the narrow spiral stairs, trimmed the wick, and polished the great lens until it shone.")
COPY = [{"role": "user", "content": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"}]
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def invariant_default() -> str:
    """The default model exported batch-invariant (what `serve --speculative-config` serves): a row's
    logits do not depend on its step's size (tests/runtime/test_batch_invariance.py)."""
    from hloserve.server.serve import DEFAULT_PRESET, SERVE_QUANTIZE, default_artifact
    return default_artifact(DEFAULT_PRESET, SERVE_QUANTIZE, batch_invariant=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(base URL without speculation, base URL with it): two servers of the batch-invariant default."""
    logs = str(tmp_path_factory.mktemp("serve-spec"))
    art = invariant_default()
    with running_server(art, "--served-model-name", MODEL, "--max-num-seqs", "8", ready_timeout=1200,
                        log_dir=logs) as (plain, _):
        with running_server(art, "--served-model-name", MODEL, "--max-num-seqs", "8", "--speculative-config", SPEC,
                            log_dir=logs) as (spec, _):
            yield plain, spec


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_text_is_the_same_with_and_without_speculation(servers):
    plain, spec = servers
    answers = [client(b).chat.completions.create(model=MODEL, messages=COPY, max_tokens=64, temperature=0)
               for b in servers]
    a, b = (r.choices[0].message.content for r in answers)
    assert a == b and "lighthouse" in a, (a, b)
    assert answers[0].usage == answers[1].usage
    import httpx
    m = httpx.get(f"{spec}/metrics").text
    drafts, accepted = metric(m, "vllm:spec_decode_num_drafts_total"), metric(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > drafts          # a copy is mostly accepted: more than one token a draft
    assert "vllm:spec_decode_num_drafts_total" not in httpx.get(f"{plain}/metrics").text
    # streamed: several tokens may come in one event, the text is the same
    stream = client(spec).chat.completions.create(model=MODEL, messages=COPY, max_tokens=64, temperature=0,
                                                  stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == a


def test_max_tokens_stop_strings_and_logprobs_when_several_tokens_come_a_step(servers):
    """Completions on a prompt the model copies: exactly max_tokens tokens; a stop string in the
    middle of an accepted draft ends the text before it with the tokens counted up to it, as without
    speculation; one logprobs entry per token, equal to the plain server's, bit for bit: the same
    tokens, values and top alternatives (a verifying step runs more rows a call than a decode; on an
    artifact exported without --batch-invariant the values differed by up to 0.08 here, the rotary
    embedding's rounding moving with the step's size and the bf16 activations amplifying it)."""
    prompt = f"{PASSAGE}\n\nThe same passage again:\n\n{PASSAGE[:60]}"
    outs = []
    for base in servers:
        c = client(base)
        n = c.completions.create(model=MODEL, prompt=prompt, max_tokens=13, temperature=0)
        stop = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=["spiral"])
        lp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=2)
        outs.append((n, stop, lp))
    (n0, stop0, lp0), (n1, stop1, lp1) = outs
    assert n1.usage.completion_tokens == 13 and n1.choices[0].finish_reason == "length"
    assert n1.choices[0].text == n0.choices[0].text
    assert stop1.choices[0].finish_reason == "stop" and "spiral" not in stop1.choices[0].text
    assert stop1.choices[0].text == stop0.choices[0].text and stop1.usage == stop0.usage
    t0, t1 = lp0.choices[0].logprobs, lp1.choices[0].logprobs
    assert t1.tokens == t0.tokens and len(t1.tokens) == lp1.usage.completion_tokens == 20
    assert t1.token_logprobs == t0.token_logprobs
    assert t1.top_logprobs == t0.top_logprobs
