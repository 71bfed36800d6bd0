"""A Responses API request (`/v1/responses`) as the chat conversation the engine runs: what the
gateway sizes, fingerprints, routes by prefix and has the engine's `/tokenize` count (the engine
has no count route of its own for this API). Pure functions on the client's JSON, which
`body` has type-checked first; nothing of ours is imported.

The conversion is the engine's (`engine/server/routers/responses.py`, as vLLM's): `instructions`
is the system message, a message's text parts are joined by newlines, a `function_call` is an
assistant tool call (calls in a row are one turn, as parallel calls are), a `function_call_output`
a `tool` message, a `reasoning` item is not shown to the model again. What the engine refuses (an
item type or content part it does not take) is counted as its JSON text: the count may be high,
never low, and the engine then answers 400. Turns the engine stored under `previous_response_id`
are not in the request, so not here (see policies/README.md).
"""

from __future__ import annotations

import json
from typing import Any


def as_chat_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = payload.get("instructions")
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    items = payload.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            _add_item(messages, item)
    return messages


def as_chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools in chat's shape (the function under `function`); the engine refuses other
    kinds, so they are left out of a count."""
    return [{"type": "function", "function": {"name": tool.get("name"), "parameters": tool.get("parameters") or
                                              {"type": "object"}, **_description(tool)}}
            for tool in tools if isinstance(tool, dict) and tool.get("type") == "function"]


def _description(tool: dict[str, Any]) -> dict[str, Any]:
    return {"description": tool["description"]} if isinstance(tool.get("description"), str) else {}


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item.get("role"), "content": _text(item.get("content"))})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
        last = messages[-1] if messages else {}
        if isinstance(last.get("tool_calls"), list):
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": _text(item.get("output"))})
    elif kind != "reasoning":
        messages.append({"role": "user", "content": json.dumps(item, ensure_ascii=False)})


def _text(content: Any) -> str:
    """Text parts (`input_text`, `output_text`) as one string; a part without text (an image,
    a file) as its JSON."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False)
    return "\n".join(part["text"] if isinstance(part, dict) and isinstance(part.get("text"), str)
                   else json.dumps(part, ensure_ascii=False) for part in content)

