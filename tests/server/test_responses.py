"""OpenAI's Responses API (/v1/responses) with the real `openai` SDK, unchanged, against a live server.

Each answer is checked against /v1/chat/completions on the same conversation (the same greedy
tokens: both routes render the same chat template), structured output and forced tool calls
against their schemas (the model has random weights, tests/server/conftest.py: valid JSON only
comes from the grammar), the streamed events against the SDK's own accumulator
(`client.responses.stream`) and the non-streamed answer.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from .servers import running_server, with_chat_template
from .test_structured import SCHEMA
from .test_tools import TEMPLATE, WEATHER

pytestmark = pytest.mark.slow

MODEL = "tiny"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": WEATHER}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_llm, tmp_path_factory):
    """The tiny chat model with a chat template that renders tools and tool turns (test_tools.py's)."""
    _, art = tiny_chat_llm
    copy = with_chat_template(art, TEMPLATE, str(tmp_path_factory.mktemp("responses")))
    with running_server(copy, "--max-model-len", "256", "--served-model-name", MODEL) as (base, _):
        yield base


def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def chat(c, messages, **kw):
    """The chat completion of the same conversation, greedy."""
    return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def same_as_chat(r, full) -> None:
    """A response holds the chat completion's text and token counts."""
    want = full.choices[0]
    assert r.output_text == want.message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")


def test_text_and_message_lists_give_chat_completions_greedy_tokens(server):
    c = client(server)
    r = c.responses.create(model=MODEL, input="Name a color.", max_output_tokens=12, temperature=0)
    same_as_chat(r, chat(c, [{"role": "user", "content": "Name a color."}], max_tokens=12))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    # instructions, then a replayed turn, with both kinds of text part
    items = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    r = c.responses.create(model=MODEL, instructions="Be terse.", input=items, max_output_tokens=10, temperature=0)
    same_as_chat(r, chat(c, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a color."}],
                         max_tokens=10))
    assert r.instructions == "Be terse."


def test_max_output_tokens_cuts_the_answer_incomplete(server):
    c = client(server)
    full = chat(c, ASK, max_tokens=3)
    assert full.choices[0].finish_reason == "length"   # the fixed random model: no EOS in 3 greedy tokens
    r = c.responses.create(model=MODEL, input=ASK, max_output_tokens=3, temperature=0)
    same_as_chat(r, full)
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"


def test_json_schema_format_streamed_with_the_sdk_helper_and_not(server):
    c = client(server)
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    r = c.responses.create(model=MODEL, input="Describe a thing as JSON.", text=fmt, max_output_tokens=64,
                           temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with c.responses.stream(model=MODEL, input="Describe a thing as JSON.", text=fmt, max_output_tokens=64,
                            temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_create_stream_true_ends_incomplete_like_the_answer(server):
    c = client(server)
    r = c.responses.create(model=MODEL, input=ASK, max_output_tokens=5, temperature=0)
    events = list(c.responses.create(model=MODEL, input=ASK, max_output_tokens=5, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_function_tool_round_trip_matches_chat(server):
    """A forced call validates against the tool's schema, streamed the same; its output fed back
    continues the conversation exactly as the equivalent chat does."""
    c = client(server)
    kw = dict(model=MODEL, input=ASK, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=40, temperature=0)
    r = c.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    want = chat(c, ASK, tools=[CHAT_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=40)
    assert want.choices[0].message.tool_calls[0].function.arguments == call.arguments
    with c.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output[0].arguments == call.arguments
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and args[0].arguments == call.arguments
    # the call and its output fed back (the SDK's output item, as clients replay it)
    follow = c.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=6, temperature=0, input=ASK + [
        call, {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}]
    same_as_chat(follow, chat(c, history, tools=[CHAT_TOOL], max_tokens=6))
    r = c.responses.create(model=MODEL, input=ASK, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                           max_output_tokens=60, temperature=1.0)
    assert [o.type for o in r.output] == ["function_call"]
    jsonschema.validate(json.loads(r.output[0].arguments), WEATHER)


def test_answers_and_events_validate_strictly_against_the_sdk_types(server):
    """The SDK builds its objects without validation; here every answer and every event is validated
    by pydantic against the SDK's own types (required fields, literals, discriminated unions), and
    every answer against the server's published schema."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    import jsonschema
    events = TypeAdapter(ResponseStreamEvent)
    doc = httpx.get(f"{server}/openapi.json", timeout=30).json()
    published = {"$ref": doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["application/json"]
                 ["schema"]["$ref"], "components": doc["components"]}
    bodies = [{"input": ASK, "max_output_tokens": 4, "temperature": 0, "instructions": "Be terse."},
              {"input": ASK, "max_output_tokens": 40, "temperature": 0, "tools": [TOOL], "tool_choice": "required",
               "text": {"format": {"type": "text"}}},
              {"input": "JSON?", "max_output_tokens": 64, "temperature": 0,
               "text": {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}}}]
    with httpx.Client(base_url=server, timeout=60) as h:
        for body in bodies:
            r = h.post("/v1/responses", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            Response.model_validate(r.json())
            jsonschema.validate(r.json(), published)
            with h.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                lines = [line for line in r.iter_lines() if line]
            names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
            parsed = [events.validate_json(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
            assert names == [e.type for e in parsed] and parsed[-1].type in ("response.completed",
                                                                               "response.incomplete")


@pytest.mark.parametrize("body,status,fragment", [
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "keeps no responses"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "has type 'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "text parts"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "not among"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "needs `schema`"),
    ({"input": "hi", "max_output_tokens": 1000}, 400, "lower max_output_tokens to at most"),
    ({"input": "word " * 300}, 400, "the model's context is 256 tokens"),
    ({"input": ""}, 400, "input is empty"),
    ({"input": "hi", "model": "other"}, 404, "model 'other' does not exist"),
])
def test_bad_requests_answer_in_openai_format_and_the_server_keeps_serving(server, body, status, fragment):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"], err
    ok = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                    "store": True, "newer_field": 1}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2, ok.text
    assert ok.headers["x-hloserve-warning"] == "ignored unknown fields: newer_field"
