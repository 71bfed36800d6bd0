"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API, as Claude Code
and other agents speak it, served by the chat route.

A request is translated into a chat completion (`system`, content blocks, `tool_use` and
`tool_result`, `tools` with `input_schema`, `tool_choice` auto/any/tool/none, `stop_sequences`)
and its answer back into a message: `content` blocks (`thinking`, `text`, `tool_use`),
`stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and `usage` in input and output
tokens; streamed, as Anthropic's events (`message_start`, `content_block_start`/`_delta`/`_stop`,
`message_delta`, `message_stop`). Errors use Anthropic's envelope (`errors.error_response`).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from portcullis.engine.server.errors import bad_request
from portcullis.engine.server.protocol import ChatCompletionRequest, OpenAIModel
from portcullis.engine.server.routers import chat
from portcullis.engine.server.state import PromptCap, RequestId, State, Tenant
from portcullis.engine.server.streaming import SSEResponse

router = APIRouter()

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class MessagesRequest(OpenAIModel):
    model: str | None = None
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(OpenAIModel):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, state: State, request_id: RequestId,
                         tenant: Tenant, prompt_cap: PromptCap):
    chat_body = as_chat(body)
    answer = await chat.create_chat_completion(chat_body, request, state, request_id, tenant, prompt_cap)
    mid = f"msg_{request_id}"
    model = body.model or state.settings.model_name
    if isinstance(answer, SSEResponse):
        return SSEResponse(_events(answer.body_iterator, mid, model), answer.on_close)
    return JSONResponse(as_message(json.loads(answer.body), mid, model))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State, tenant: Tenant) -> dict:
    chat_body = as_chat(MessagesRequest.model_validate({**body.model_dump(exclude_none=True), "max_tokens": 1}))
    return {"input_tokens": await chat.prompt_tokens(state, tenant, chat_body)}


# ---- request: Anthropic -> chat -------------------------------------------------------------

def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    for name in ("n", "best_of"):  # a message is one reply
        if (body.model_extra or {}).get(name) not in (None, 1):
            raise bad_request(f"'{name}' is not part of the Messages API: a message is one reply", name)
    messages = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, i)
    fields: dict[str, Any] = {  # fields Anthropic has no name for (vLLM's guided_*, ...) pass as they came
        **(body.model_extra or {}),
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
        "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
    }
    if body.stream:  # every chunk carries usage: message_start needs the input tokens at once
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
        fields.update(_tool_choice(body.tool_choice))
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str):
        fields["user"] = user
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise bad_request(f"the request cannot be served: {exc}") from exc


def _chat_messages(message: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results first, each its own
    `tool` message, then its text; an assistant turn's text and tool calls together."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"messages.{index}.role must be 'user' or 'assistant'", f"messages.{index}.role")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise bad_request(f"messages.{index}.content must be a string or a list of content blocks",
                          f"messages.{index}.content")
    out, texts, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{index}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text(block.get("content") or "", where)})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                "name": str(block.get("name", "")), "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # a past turn's reasoning: not shown to the model again, as chat templates do
        else:
            raise bad_request(f"{where}: content blocks of type {kind!r} are not supported here; this model "
                              "takes text, tool_use and tool_result blocks", where)
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _text(value: str | list | Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "\n".join(str(b.get("text", "")) for b in value)
    raise bad_request(f"{where} must be a string or a list of text blocks", where)


def _tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools.{index} must be {{'name': ..., 'input_schema': {{...}}}}", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    kind = (choice or {}).get("type", "auto")
    fields: dict[str, Any] = {"parallel_tool_calls": not (choice or {}).get("disable_parallel_tool_use", False)}
    if kind in ("auto", "none"):
        fields["tool_choice"] = kind
    elif kind == "any":
        fields["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                          "tool_choice")
    return fields


# ---- answer: chat -> Anthropic ---------------------------------------------------------------

def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "", finish_reason), None


def as_message(answer: dict[str, Any], mid: str, model: str) -> dict[str, Any]:
    choice = answer["choices"][0]
    message, content = choice["message"], []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"))
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(answer.get("usage"))}


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(chunks: AsyncIterator[str], mid: str, model: str) -> AsyncIterator[str]:
    """The chat route's stream as Anthropic's events: each run of reasoning, text or one tool
    call's arguments is a content block, opened when it starts and closed when the next starts."""
    blocks = _Blocks()
    usage: dict[str, Any] = {}
    stop: tuple[str | None, str | None] = ("end_turn", None)
    started = False
    async for raw in chunks:
        data = raw.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:  # the engine failed mid-stream: Anthropic's error event, and no message_stop
            error = chunk["error"]
            yield _event("error", {"error": {"type": "overloaded_error" if error.get("code") == "engine_unavailable"
                                             else "api_error", "message": error.get("message", "")}})
            return
        usage = chunk.get("usage") or usage
        if not started:
            started = True
            yield _event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {**_usage(usage), "output_tokens": 0}}})
        for choice in chunk["choices"]:
            for event in blocks.feed(choice["delta"]):
                yield event
            if choice.get("finish_reason"):
                stop = _stop(choice["finish_reason"], choice.get("stop_reason"))
    for event in blocks.close():
        yield event
    yield _event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                   "usage": {"output_tokens": _usage(usage)["output_tokens"]}})
    yield _event("message_stop", {})


class _Blocks:
    """The content blocks of a streamed message: which one is open, and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[Literal["thinking", "text", "tool_use"], int | None] | None = None

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._ensure(("thinking", None), {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._ensure(("text", None), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            out += self._ensure(("tool_use", call.get("index")), {"type": "tool_use", "id": call.get("id", ""),
                                                                 "name": function.get("name", ""), "input": {}})
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _ensure(self, which: tuple, start: dict[str, Any]) -> list[str]:
        if self.open == which:
            return []
        out = self.close()
        self.index += 1
        self.open = which
        return [*out, _event("content_block_start", {"index": self.index, "content_block": start})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})
