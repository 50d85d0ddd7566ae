"""Tool calling for chat models (OpenAI's `tools` / `tool_choice`), as vLLM does it.

The tools are rendered by the model's chat template (`tools=` in its context, the Hugging Face
convention). What the model may answer depends on `tool_choice`:

  * a named function (`{"type": "function", "function": {"name": ...}}`): the output is forced,
    token by token, to a JSON object matching that function's `parameters` schema (structured
    output); it becomes the call's `arguments`;
  * "required": the output is forced to a JSON array of one or more `{"name", "parameters"}`
    objects, each matching one of the tools;
  * "auto": the output is free; calls are parsed from it afterwards: Hermes-style
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3, Hermes, many
    others), or a whole answer that is one JSON object `{"name": ..., "arguments"|"parameters": ...}`
    (Llama 3's JSON form). Text outside the blocks stays the message's content.

When calls are found, the message carries `tool_calls` (ids `call_<hex>`, arguments as a JSON
string) and `finish_reason` is "tool_calls". A streamed answer with tools sends its calls (and any
content) when the model finishes, as one delta: parsing needs the whole output.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Sequence

from ..text.grammar import GrammarSpec

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str           # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(tools: Sequence[dict], tool_choice: Any) -> None:
    """ValueError unless the tools are functions with names and the choice names one of them."""
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"{{...}}}}}}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools {names}")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f"tool_choice {tool_choice!r}: use 'none', 'auto', 'required' or a named function")
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools")


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def constraint(tools: Sequence[dict], tool_choice: Any, parallel: bool | None = None) -> GrammarSpec | None:
    """The grammar a forced tool choice puts on the output (None for 'auto' and 'none'); with
    `parallel` False (parallel_tool_calls) "required" makes exactly one call."""
    fns = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        return GrammarSpec("json_schema", json.dumps(_parameters(fns[tool_choice["function"]["name"]])))
    if tool_choice == "required":
        one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _parameters(f)},
                "required": ["name", "parameters"], "additionalProperties": False} for n, f in fns.items()]
        schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
        if parallel is False:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(schema))
    return None


def parse(text: str, tools: Sequence[dict], tool_choice: Any) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer."""
    if isinstance(tool_choice, dict):
        return None, [ToolCall(tool_choice["function"]["name"], text)]
    if tool_choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []          # cut short (max_tokens): no complete call
        return None, [ToolCall(c["name"], json.dumps(c.get("parameters", {}))) for c in items]
    names = {t["function"]["name"] for t in tools}
    calls = []
    for block in _BLOCK.findall(text):
        call = _call(block, names)
        if call is not None:
            calls.append(call)
    if calls:
        content = _BLOCK.sub("", text).strip()
        return content or None, calls
    call = _call(text.strip(), names)
    return (None, [call]) if call is not None else (text, [])


def _call(text: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
