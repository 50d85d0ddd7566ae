"""Structured output through the real server and the `openai` SDK: response_format json_schema and
json_object, vLLM's guided_* and structured_outputs forms, streamed and not, under load.

The model has random weights (tests/server/conftest.py), so without a grammar its output is
noise: every check below fails unless the grammar's masks are applied at every step.
"""
from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest

from .servers import running_server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "enum": [1, 2, 3]},
                         "ok": {"type": "boolean"}},
          "required": ["color", "count", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    _, art = tiny_chat_llm
    with running_server(art, "--max-num-seqs", "8", "--max-model-len", "256", "--max-pending", "256") as (base, proc):
        yield base, proc


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_json_schema_chat_streamed_and_not(server):
    c = client(server[0])
    msgs = [{"role": "user", "content": "Describe a thing as JSON."}]
    for temperature in (0, 1.0):
        r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=64, temperature=temperature,
                                      seed=7, response_format=schema_format())
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    chunks = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=64, temperature=0,
                                       response_format=schema_format(), stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    full = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=64, temperature=0,
                                     response_format=schema_format())
    assert text == full.choices[0].message.content


def test_json_object_regex_choice_and_structured_outputs(server):
    c = client(server[0])
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "JSON please"}],
                                  max_tokens=48, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = c.completions.create(model="tiny-chat", prompt="A code:", max_tokens=20, temperature=1.0, seed=3,
                             extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        r = c.completions.create(model="tiny-chat", prompt="Answer:", max_tokens=20, temperature=1.0, seed=seed,
                                 extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices
    r = c.completions.create(model="tiny-chat", prompt="x", max_tokens=40, temperature=0,
                             extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                  temperature=0, extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("body,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"guided_regex": "(("}, "regex"),
    ({"guided_choice": []}, "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "both constrain"),
])
def test_bad_grammars_get_400_and_the_server_keeps_serving(server, body, fragment):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    ok = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_hundred_json_schema_requests_at_concurrency_16_all_validate(server):
    c = client(server[0])

    def one(i):
        r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": f"Thing {i}?"}],
                                      max_tokens=64, temperature=1.0, seed=i, response_format=schema_format())
        return r.choices[0].message.content, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    for text, reason in results:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in results}) > 3        # sampled, not one memorized answer
