"""The real server on 127.0.0.1 with an exported Llama artifact, driven by the real `openai` client.

The model is a tiny random-init Llama using SmolLM2's real tokenizer and chat template (from the
GGUF), so prompts, detokenization and templates are real; outputs are checked token-for-token
against transformers' greedy generation on the same weights.
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from .servers import hf_greedy, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    _, art = tiny_chat_llm
    with running_server(art, "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128",
                        "--api-key", "sk-test", "--max-pending", "64") as (base, proc):
        yield base, proc


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)


def test_completion_matches_transformers_greedy(server, tiny_chat_llm):
    hf, art = tiny_chat_llm
    base, _ = server
    from hloserve.server.text.tokenizer import Tokenizer
    from hloserve.runtime import artifact
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    want = hf_greedy(hf, ids, 12)
    r = client(base).completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode(want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"


def test_chat_streaming_equals_non_streaming(server):
    base, _ = server
    c = client(base)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    full = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.choices[0].message.role == "assistant"


def test_seeded_sampling_reproducible_and_logprobs(server):
    base, _ = server
    c = client(base)
    kw = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
              logprobs=2, extra_body={"top_k": 50, "ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_models_and_auth(server):
    base, _ = server
    assert [m.id for m in client(base).models.list().data] == ["tiny-chat"]
    r = httpx.get(f"{base}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body,fragment", [
    ("{not json", "malformed JSON"),
    ({"model": "tiny-chat", "prompt": "hi", "temperature": "hot"}, "invalid value for 'temperature'"),
    ({"model": "tiny-chat", "prompt": "hi", "temperature": 3}, "invalid value for 'temperature'"),
    ({"model": "tiny-chat", "prompt": "hi", "top_p": 0}, "invalid value for 'top_p'"),
    ({"model": "tiny-chat", "prompt": "hi", "n": 17}, "n must be at most 16"),
    ({"model": "tiny-chat", "prompt": "hi", "best_of": 2, "n": 3}, "must be at least n"),
    ({"model": "tiny-chat", "prompt": "hi", "best_of": 3, "stream": True}, "cannot be streamed"),
    ({"model": "tiny-chat", "prompt": ["a", ""]}, "prompt is empty"),
    ({"model": "tiny-chat", "prompt": "hi", "logit_bias": {"x": 1}}, "is not a token id"),
    ({"model": "tiny-chat", "prompt": "hi", "presence_penalty": 3}, "invalid value for 'presence_penalty'"),
    ({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1000}, "lower max_tokens to at most"),
    ({"model": "tiny-chat", "prompt": "word " * 200}, "the model's context is 128 tokens"),
    ({"model": "other", "prompt": "hi"}, "model 'other' does not exist"),
    ({"prompt": "hi"}, "missing required field 'model'"),
])
def test_bad_requests_answer_400_and_server_keeps_serving(server, body, fragment):
    base, _ = server
    headers = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{base}/v1/completions", content=data, headers=headers, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_health_ready_metrics(server):
    base, _ = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    text = httpx.get(f"{base}/metrics").text
    families = parse_metrics(text)
    for name in ("vllm:time_to_first_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions", "hloserve:compiles_after_warmup",
                 "hloserve:requests_in_flight"):
        assert name in families, name
    assert families["hloserve:compiles_after_warmup"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert all(s.labels["model_name"] for f in families.values() for s in f.samples)


def test_metrics_split_each_step_into_host_and_device(server):
    """Every engine step that runs the model adds one observation to hloserve:step_device_seconds (the
    host waiting on the step functions) and one to hloserve:step_host_seconds (the rest of the step);
    the device part is inside the runner's own step time."""
    base, _ = server

    def read():
        fams = parse_metrics(httpx.get(f"{base}/metrics").text)
        out = {}
        for name in ("hloserve:step_host_seconds", "hloserve:step_device_seconds"):
            assert fams[name].type == "histogram", name
            out[name] = {s.name.rsplit("_", 1)[-1]: s.value for s in fams[name].samples if not s.name.endswith("_bucket")}
        out["runner"] = next(s.value for s in fams["hloserve:runner_step_seconds"].samples)
        return out

    before = read()
    r = client(base).completions.create(model="tiny-chat", prompt="hi there", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    after = read()
    host = {k: after["hloserve:step_host_seconds"][k] - before["hloserve:step_host_seconds"][k] for k in ("count", "sum")}
    dev = {k: after["hloserve:step_device_seconds"][k] - before["hloserve:step_device_seconds"][k] for k in ("count", "sum")}
    assert dev["count"] >= 8 and host["count"] == dev["count"]      # the prompt's step and 7 decodes, at least
    assert dev["sum"] > 0 and host["sum"] > 0
    assert dev["sum"] <= after["runner"] - before["runner"] + 1e-9   # measured inside the runner's step


def test_metrics_split_step_time_into_chunk_and_decode_steps(server):
    """hloserve:step_seconds_total{kind}: a request's prompt runs in steps of kind "chunk", its later
    tokens in steps of kind "decode"; together they are the steps' wall time (host + device)."""
    base, _ = server

    def read():
        fams = parse_metrics(httpx.get(f"{base}/metrics").text)
        got = {s.labels["kind"]: s.value for s in fams["hloserve:step_seconds"].samples}
        assert fams["hloserve:step_seconds"].type == "counter" and set(got) == {"chunk", "decode"}
        steps = sum(next(s.value for s in fams[n].samples if s.name.endswith("_sum"))
                    for n in ("hloserve:step_host_seconds", "hloserve:step_device_seconds"))
        return got, steps

    (before, steps_before) = read()
    r = client(base).completions.create(model="tiny-chat", prompt="hi there, how are you today?", max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    after, steps_after = read()
    chunk, decode = (after[k] - before[k] for k in ("chunk", "decode"))
    assert chunk > 0 and decode > 0            # the prompt's step(s), then 5 decodes
    assert abs(chunk + decode - (steps_after - steps_before)) <= 1e-6 * max(1.0, steps_after)


def parse_metrics(text: str) -> dict:
    """/metrics through prometheus_client's own parser: it raises on a malformed exposition
    (a family typed twice, a sample without its family, a bad label)."""
    from prometheus_client.parser import text_string_to_metric_families
    families = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in families, f"family {fam.name} exposed twice"
        families[fam.name] = fam
    return families


def test_serving_process_never_imports_torch(server):
    _, proc = server
    maps = open(f"/proc/{proc.pid}/maps").read()
    assert "libtorch" not in maps


def test_every_openai_field_at_a_neutral_value_is_accepted(server):
    """What SDKs and tools send along: OpenAI's bookkeeping fields, neutral penalties and formats, a
    replayed tool conversation, vLLM's extensions at their defaults (what `vllm bench serve` sends)."""
    c = client(base := server[0])
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    r = c.chat.completions.create(model="tiny-chat", messages=msgs[:1], max_tokens=3, temperature=0,
                                  logit_bias={}, store=False, metadata={"k": "v"}, presence_penalty=0,
                                  frequency_penalty=0, response_format={"type": "text"}, parallel_tool_calls=False,
                                  user="u", extra_body={"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
                                                        "skip_special_tokens": True})
    assert r.choices[0].message.content is not None
    r = c.completions.create(model="tiny-chat", prompt="hi", max_tokens=3, best_of=1, suffix=None, temperature=0,
                             extra_body={"repetition_penalty": 1.0, "ignore_eos": True})
    assert r.usage.completion_tokens == 3
    headers = {"Authorization": "Bearer sk-test"}
    body = {"model": "tiny-chat", "messages": msgs, "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200


def test_unknown_fields_are_ignored_with_a_warning(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer sk-test"}, timeout=30,
                   json={"model": "tiny-chat", "prompt": "hi", "max_tokens": 2, "max_token": 5, "newer_field": {}})
    assert r.status_code == 200, r.text
    assert r.headers["x-hloserve-warning"] == "ignored unknown fields: max_token, newer_field"


def test_field_names_no_header_can_carry_are_escaped_and_release_admission(server):
    """An unknown field whose name is not Latin-1 (or holds CR LF) once broke the streamed answer's
    warning header after admission: 500, and the slot was never released, so ~max-pending of them
    disabled the server. 1,000 of them (over fifteen times --max-pending), then a normal request."""
    base, _ = server
    auth = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as h:
        for i in range(1000):
            # (schemathesis found "" and "a ": a header value may not end in a space)
            name = ["\u20ac", "a\r\nx-injected: 1", "\x00\x7f", "\U0001f600", "", "a ", " "][i % 7]
            r = h.post("/v1/completions", json={"model": "tiny-chat", "prompt": "Hi", "max_tokens": 1,
                                                "stream": bool(i % 2), name: 1})
            assert r.status_code == 200, (name, r.text)
            warning = r.headers["x-hloserve-warning"]
            assert warning.isascii() and warning.isprintable() and "x-injected" not in r.headers, warning
            assert json.loads(warning.removeprefix("ignored unknown fields: ")) == name
        r = h.post("/v1/completions", json={"model": "tiny-chat", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_chat_template_kwargs_may_set_the_generation_prompt(server, tiny_chat_llm):
    """chat_template_kwargs={"add_generation_prompt": false} renders without the assistant header
    (it answered 500 once: the key was passed twice); the prompt is shorter by that header."""
    base, _ = server
    msgs = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer sk-test"}, timeout=30) as h:
        lengths = []
        for kwargs in ({}, {"add_generation_prompt": False}):
            r = h.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": msgs, "max_tokens": 1,
                                                     "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            t = h.post("/tokenize", json={"messages": msgs, "add_generation_prompt": not kwargs}).json()
            assert r.json()["usage"]["prompt_tokens"] == t["count"]
            lengths.append(t["count"])
        assert lengths[1] < lengths[0]


def test_out_of_vocabulary_ids_in_sampling_fields_are_refused(server):
    base, _ = server
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer sk-test"}, timeout=30) as h:
        for extra, field in (({"logit_bias": {"99999999": 5}}, "logit_bias"),
                             ({"stop_token_ids": [99999999]}, "stop_token_ids")):
            r = h.post("/v1/completions", json={"model": "tiny-chat", "prompt": "Hi", "max_tokens": 1, **extra})
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        # /tokenize: a lone surrogate in a chat message, and text no context could hold
        r = h.post("/tokenize", headers={"Content-Type": "application/json"},
                   content='{"messages": [{"role": "user", "content": "a \\ud800 b"}]}')
        message = r.json()["error"]["message"]   # refused by the JSON parser or by the text check
        assert r.status_code == 400 and ("not valid Unicode" in message or "hex escape" in message), r.text
        r = h.post("/tokenize", json={"prompt": "x" * (128 * 64 + 1)})
        assert r.status_code == 400 and "shorten it" in r.json()["error"]["message"], r.text
        r = h.post("/detokenize", json={"tokens": [1] * (128 * 64 + 1)})
        assert r.status_code == 400 and "at most" in r.json()["error"]["message"], r.text
        assert h.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200


def test_logit_bias_and_penalties_change_the_greedy_tokens(server, tiny_chat_llm):
    """logit_bias +100 on one token makes greedy decoding emit only it; repetition_penalty gives
    transformers' greedy generation with the same penalty (over prompt and output)."""
    hf, art = tiny_chat_llm
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    c = client(server[0])
    forced = tok.encode(" blue")[0]
    kw = dict(model="tiny-chat", prompt=[5, 6, 7], max_tokens=6, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(logit_bias={str(forced): 100}, **kw)
    assert r.choices[0].logprobs.tokens == [tok.decode([forced], skip_special_tokens=False)] * 6
    import torch
    rep = c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5}})
    with torch.no_grad():
        want = hf.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=6, repetition_penalty=1.5,
                           eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert rep.choices[0].logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]


def test_hostile_inputs_get_4xx_and_the_server_keeps_serving(server):
    base, _ = server
    auth = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
    # a lone UTF-16 surrogate is valid JSON but not text
    r = httpx.post(f"{base}/v1/completions", headers=auth, timeout=30,
                   content='{"model": "tiny-chat", "prompt": "a \\ud800 b", "max_tokens": 2}')
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and ("not valid Unicode" in message or "hex escape" in message), r.text
    r = httpx.post(f"{base}/tokenize", headers=auth, timeout=30, content='{"prompt": "a \\ud800 b"}')
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and ("not valid Unicode" in message or "hex escape" in message), r.text
    # a non-ASCII Authorization header is a wrong key, not a crash
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer clé".encode()})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # a body over the limit is refused from its Content-Length, before it is read
    big = json.dumps({"model": "tiny-chat", "prompt": "x" * (17 << 20)})
    r = httpx.post(f"{base}/v1/completions", headers=auth, content=big, timeout=30)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    # text that cannot fit the context is refused before tokenizing
    r = httpx.post(f"{base}/v1/completions", headers=auth, timeout=30,
                   json={"model": "tiny-chat", "prompt": "word " * 20000})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_tokenize_and_detokenize_round_trip(server, tiny_chat_llm):
    _, art = tiny_chat_llm
    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    base, _ = server
    auth = {"Authorization": "Bearer sk-test"}
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny-chat", "prompt": "The capital of France"}, headers=auth)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("The capital of France")
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 128
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{base}/tokenize", json={"messages": msgs}, headers=auth)
    assert r.json()["tokens"] == tok.encode_chat(msgs)
    r = httpx.post(f"{base}/detokenize", json={"tokens": tok.encode("Paris is nice")}, headers=auth)
    assert r.json()["prompt"] == tok.decode(tok.encode("Paris is nice"), skip_special_tokens=False)
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10**9]}, headers=auth).status_code == 400


def test_n_choices_streamed_and_not(server):
    """n=3 seeded samples: three choices, each the completion a single request with seed+i gives;
    streamed chunks carry their choice index and add up to the same texts; usage counts the prompt once."""
    c = client(server[0])
    kw = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    r = c.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    singles = [c.completions.create(**{**kw, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert [ch.text for ch in r.choices] == singles
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == c.completions.create(**kw).usage.prompt_tokens
    texts = ["", "", ""]
    for chunk in c.completions.create(n=3, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == singles
    chat = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], n=2,
                                     max_tokens=4, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_several_prompts_in_one_request(server):
    """A batch of prompts (text and token ids): choice p*n + i answers prompt p, each the completion
    the prompt gets alone; usage counts every prompt once."""
    c = client(server[0])
    kw = dict(model="tiny-chat", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The capital of France is", "Once upon a time"]
    r = c.completions.create(prompt=prompts, n=2, **kw)
    alone = [c.completions.create(prompt=p, **kw) for p in prompts]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 20
    ids = c.completions.create(prompt=[[5, 6, 7], [8, 9]], **kw)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_best_of_answers_the_most_likely_candidates_and_echo_prepends_the_prompt(server):
    """best_of=4, n=2 seeded: the two answers are the two of the four single requests (seed+i) with
    the highest summed log-probability, most likely first; echo puts the prompt before the text."""
    c = client(server[0])
    kw = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    r = c.completions.create(n=2, best_of=4, **kw)
    singles = [c.completions.create(**{**kw, "seed": 5 + i}, logprobs=0).choices[0] for i in range(4)]
    ranked = sorted(singles, key=lambda ch: -sum(ch.logprobs.token_logprobs))
    assert [ch.text for ch in r.choices] == [ch.text for ch in ranked[:2]]
    assert r.usage.completion_tokens == 24                          # every candidate is generated
    e = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    plain = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert e.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-chat", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, stream=True)
        if ch.choices)
    assert streamed == e.choices[0].text


def test_best_of_with_echo_and_logprobs_scores_each_choices_own_prompt(server):
    """Several prompts, best_of > n, echo and logprobs: each answer's logprobs start with its own
    prompt's tokens (they once came from another prompt's: the choice index was taken before the
    best were picked)."""
    c = client(server[0])
    prompts = ["The cat sat on", "Hello there my good friend"]
    kw = dict(model="tiny-chat", prompt=prompts, max_tokens=2, temperature=1.0, seed=3, echo=True, logprobs=0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(n=1, best_of=3, **kw)
    alone = [c.completions.create(**{**kw, "prompt": p}).choices[0].logprobs for p in prompts]
    for choice, prompt, want in zip(r.choices, prompts, alone):
        n = len(want.tokens) - 2                                   # the prompt's tokens (2 generated)
        assert choice.text.startswith(prompt) and "".join(choice.logprobs.tokens[:n]) == prompt
        assert choice.logprobs.token_logprobs[1:n] == pytest.approx(want.token_logprobs[1:n], abs=1e-6)


def test_echo_with_logprobs_scores_the_prompt_like_transformers(server, tiny_chat_llm):
    """echo + logprobs (how evaluation harnesses score text): every prompt token after the first gets
    its log-probability given the tokens before it, equal to transformers' log-softmax on the same
    weights (f32, logits of magnitude ~1: measured differences ~1e-6; bound 1e-4), with the top-2
    alternatives; the first has none, as OpenAI's. The prompt (24 tokens) is scored in several calls
    of the 4-row decode bucket; a second request hits the prefix cache and scores the same; the
    stream sends the same numbers in its first chunk."""
    import torch

    from hloserve.runtime import artifact
    from hloserve.server.text.tokenizer import Tokenizer
    hf, art = tiny_chat_llm
    tok = Tokenizer.from_artifact(artifact.LLMArtifact.read(art))
    prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door"
    ids = tok.encode(prompt)
    assert len(ids) > 12
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()   # [len, vocab]
    c = client(server[0])
    kw = dict(model="tiny-chat", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    plain = c.completions.create(**{**kw, "echo": False}).choices[0]
    for attempt in range(2):                                  # the second one's prompt is cached
        lp = c.completions.create(**kw).choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + 3 and "".join(lp.tokens[:len(ids)]) == tok.decode(ids)
        got = np.array(lp.token_logprobs[1:len(ids)])
        np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
        for q in range(1, len(ids)):
            top2 = np.argsort(-want[q - 1])[:2]
            assert list(lp.top_logprobs[q]) == [tok.decode([int(t)], skip_special_tokens=False) for t in top2]
        assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-6)
        assert lp.text_offset[len(ids)] == len(tok.decode(ids))
    first = next(ch for ch in c.completions.create(**kw, stream=True) if ch.choices)
    assert first.choices[0].text == prompt
    streamed = first.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-6)


def test_include_stop_str_in_output_and_skip_special_tokens(server, tiny_chat_llm):
    """vLLM's text options: a stop string is cut off, or kept with include_stop_str_in_output; a
    special token's text appears only with skip_special_tokens false."""
    c = client(server[0])
    kw = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=12, temperature=0)
    full = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 8
    stop = full[4:7]
    at = full.find(stop)
    cut = c.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = c.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True,
                                                               "include_stop_str_in_output": True}).choices[0]
    assert cut.text == full[:at] and kept.text == full[:at + len(stop)] and kept.finish_reason == "stop"
    special = 1                                               # <|im_start|> in SmolLM2's tokenizer
    forced = dict(model="tiny-chat", prompt="hi", max_tokens=3, temperature=0, logit_bias={str(special): 100})
    shown = c.completions.create(**forced, extra_body={"skip_special_tokens": False}).choices[0].text
    hidden = c.completions.create(**forced).choices[0].text
    assert shown == "<|im_start|>" * 3 and hidden == ""
    for spaces in (True, False):                              # a fast tokenizer's text either way (vLLM's too)
        r = c.completions.create(**forced, extra_body={"skip_special_tokens": False,
                                                       "spaces_between_special_tokens": spaces})
        assert r.choices[0].text == shown


def test_published_schema_describes_the_real_bodies_and_answers(server):
    """/openapi.json: the generation routes declare their JSON bodies (the models they parse) and
    answer 400 in OpenAI's error format, never 422; the bodies real clients send validate against
    it, and the server's own 400 answers validate against the error schema."""
    import jsonschema
    base, _ = server
    doc = httpx.get(f"{base}/openapi.json", headers={"Authorization": "Bearer sk-test"}, timeout=30).json()
    assert "422" not in json.dumps(doc)
    # the API key's 401 is documented where the rule applies: every route but the probes
    assert "401" in doc["paths"]["/tokenize"]["post"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]

    def schema_of(ref):
        return {"$ref": ref, "components": doc["components"]}
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert op["requestBody"]["required"] and body == {"$ref": f"#/components/schemas/{model}"}
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    sent = {"/v1/completions": {"model": "tiny-chat", "prompt": ["a", "b"], "max_tokens": 2, "stream": True,
                                "stream_options": {"include_usage": True}, "logprobs": 1},
            "/v1/chat/completions": {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                     "response_format": {"type": "json_object"}, "max_completion_tokens": 2}}
    for path, body in sent.items():
        jsonschema.validate(body, schema_of(doc["paths"][path]["post"]["requestBody"]["content"]
                                            ["application/json"]["schema"]["$ref"]))
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({k: v for k, v in body.items() if k != "model"}, schema_of(
                doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]))
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer sk-test"}, json={"prompt": "x"},
                   timeout=30)
    assert r.status_code == 400
    jsonschema.validate(r.json(), schema_of("#/components/schemas/OpenAIError"))
    # the answers (typed models, http/completions_protocol.py, chat_protocol.py) validate against the published 200
    # schemas
    answered = {"/v1/completions": {**sent["/v1/completions"], "stream": False, "echo": True, "n": 2, "seed": 1},
                "/v1/chat/completions": {**sent["/v1/chat/completions"], "logprobs": True, "top_logprobs": 2}}
    for path, body in answered.items():
        r = httpx.post(f"{base}{path}", headers={"Authorization": "Bearer sk-test"}, json=body, timeout=60)
        assert r.status_code == 200, r.text
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert "text/event-stream" in content
        jsonschema.validate(r.json(), schema_of(content["application/json"]["schema"]["$ref"]))
