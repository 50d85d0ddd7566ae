"""Tool calling with the real `openai` client: a chat template that renders tools (Hermes style),
forced calls (a named function, "required") whose arguments validate against the tools' schemas,
streamed and not, replayed tool conversations, and the parser of free answers ("auto").

The model has random weights (tests/server/conftest.py): a valid call can only come from the
tool grammar being applied at every step.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from hloserve.server.http import tools

from .servers import running_server, with_chat_template

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(tiny_chat_llm, tmp_path_factory):
    _, art = tiny_chat_llm
    copy = with_chat_template(art, TEMPLATE, str(tmp_path_factory.mktemp("tools")))
    with running_server(copy, "--max-model-len", "256", "--served-model-name", "tiny") as (base, proc):
        yield base


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_function_call_streamed_and_not(server):
    c = client(server)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=40,
                                  temperature=1.0, seed=1)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=40,
                                       temperature=1.0, seed=1, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert deltas[-1].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == call.function.arguments


def test_required_calls_validate_against_their_tools(server):
    c = client(server)
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_answers_text_and_tool_history_renders(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None        # random weights: no call in free text
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    tok = httpx.post(f"{server}/tokenize", json={"model": "tiny", "messages": history}, timeout=30).json()
    text = httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}, timeout=30).json()
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in text["prompt"]


def test_bad_tool_requests_get_400(server):
    for body in ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 {"tools": [{"type": "function", "function": {}}]},
                 {"tool_choice": "required"}):
        r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": MSGS, "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)


def test_parser_reads_hermes_blocks_and_json_answers():
    content, calls = tools.parse('Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
                                 TOOLS, "auto")
    assert content == "Sure." and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    content, calls = tools.parse('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}', TOOLS, "auto")
    assert content is None and calls[0].name == "get_weather"
    assert tools.parse('{"name": "unknown", "arguments": {}}', TOOLS, "auto") == (
        '{"name": "unknown", "arguments": {}}', [])
    assert tools.parse("plain text", TOOLS, "auto") == ("plain text", [])
