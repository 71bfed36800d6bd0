"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API (the OpenAI Agents
SDK's and Codex's default), served by the chat route.

A request's `instructions`, `input` items (messages, `function_call`, `function_call_output`)
and, with `previous_response_id`, the stored conversation it continues, become a chat
completion; `tools`, `tool_choice`, `text.format` and `max_output_tokens` map onto chat's. The
answer comes back as a Response: `output` items (`reasoning`, `message` with `output_text`,
`function_call`), `status` (`incomplete` at `max_output_tokens`) and `usage`; streamed, as the
Responses API's semantic events. Stored responses are kept per tenant (the gateway's tenant tag):
another tenant's id is unknown. The store is bounded in bytes, oldest out first.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from portcullis.engine.server.errors import APIError, bad_request
from portcullis.engine.server.protocol import ChatCompletionRequest, OpenAIModel
from portcullis.engine.server.routers import chat
from portcullis.engine.server.state import PromptCap, RequestId, State, Tenant
from portcullis.engine.server.streaming import SSEResponse

router = APIRouter()

STORE_BYTES = 32 << 20  # stored conversations, all tenants together: the oldest go first


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


class ResponseStore:
    """Finished responses and the conversation each ends, by (tenant, id), bounded in bytes."""

    def __init__(self, limit_bytes: int = STORE_BYTES):
        self.limit_bytes = limit_bytes
        self._items: OrderedDict[tuple[str, str], tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0

    def put(self, tenant: str, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps([response, conversation]))
        if size > self.limit_bytes:
            return
        self._items[(tenant, response["id"])] = (response, conversation, size)
        self._bytes += size
        while self._bytes > self.limit_bytes:
            self._bytes -= self._items.popitem(last=False)[1][2]

    def get(self, tenant: str, response_id: str) -> tuple[dict, list[dict]] | None:
        found = self._items.get((tenant, response_id))
        return None if found is None else found[:2]


_store = ResponseStore()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: State, request_id: RequestId,
                          tenant: Tenant, prompt_cap: PromptCap):
    conversation = _conversation(body, tenant)
    chat_body = as_chat(body, conversation)
    answer = await chat.create_chat_completion(chat_body, request, state, request_id, tenant, prompt_cap)
    shell = _shell(body, f"resp_{request_id}", body.model or state.settings.model_name)
    if isinstance(answer, SSEResponse):
        return SSEResponse(_events(answer.body_iterator, shell, conversation, tenant, body.store), answer.on_close)
    whole = json.loads(answer.body)
    response = _finished(shell, _output_items(whole), whole.get("usage"), whole["choices"][0]["finish_reason"] == "length")
    _keep(body.store, tenant, response, conversation)
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, tenant: Tenant) -> dict:
    found = _store.get(tenant, response_id)
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")
    return found[0]


# ---- request: Responses -> chat ---------------------------------------------------------------

def _conversation(body: ResponsesRequest, tenant: str) -> list[dict]:
    """The chat messages this response continues: the stored conversation of
    `previous_response_id` (this tenant's only), then this request's input."""
    earlier: list[dict] = []
    if body.previous_response_id is not None:
        found = _store.get(tenant, body.previous_response_id)
        if found is None:
            raise bad_request(f"Previous response with id '{body.previous_response_id}' not found.",
                              "previous_response_id")
        earlier = found[1]
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    return earlier + _chat_messages(items)


def _chat_messages(items: list[dict]) -> list[dict]:
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            out.append({"role": item["role"], "content": _text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(item.get("output"), f"input.{i}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again, as chat templates do
        else:
            raise bad_request(f"input.{i}: items of type {kind!r} are not supported; this model takes messages, "
                              "function_call and function_call_output items", "input")
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    raise bad_request(f"{where} must be text (a string or input_text parts); this model takes text only", "input")


def as_chat(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    extra = body.model_extra or {}
    for name in ("n", "best_of"):
        if extra.get(name) not in (None, 1):
            raise bad_request(f"'{name}' is not part of the Responses API: a response is one reply", name)
    for name in ("max_tokens", "max_completion_tokens"):  # one length field, as the gateway caps it
        if name in extra:
            raise bad_request(f"'{name}' is chat's; the Responses API's is 'max_output_tokens'", name)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {  # fields the Responses API has no name for (vLLM's guided_*, ...) pass as they came
        **(body.model_extra or {}),
        "model": body.model, "messages": system + conversation, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:  # every chunk carries usage: the events need the input tokens at the end at least
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    fields["response_format"] = _format((body.text or {}).get("format"))
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise bad_request(f"the request cannot be served: {exc}") from exc


def _tool(tool: dict, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools.{index}: only function tools ({{'type': 'function', 'name': ..., 'parameters': "
                          "{...}}) are served here", "tools")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "auto", "required", "none", None, or what the chat route refuses by name


def _format(form: dict | None) -> dict | None:
    kind = (form or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(form.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": form.get("name", "response"), "schema": form["schema"],
                                                       "strict": form.get("strict")}}
    raise bad_request("text.format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', 'name': ..., "
                      "'schema': {...}}", "text")


# ---- answer: chat -> Response -------------------------------------------------------------------

def _shell(body: ResponsesRequest, rid: str, model: str) -> dict:
    """The Response object before its output: what the request asked for, echoed as OpenAI does."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "usage": None, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": body.store}


def _output_items(answer: dict) -> list[dict]:
    message = answer["choices"][0]["message"]
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def _finished(shell: dict, items: list[dict], usage: dict | None, cut: bool) -> dict:
    """The whole Response: its output items, usage, and whether max_output_tokens cut it."""
    usage = usage or {}
    return {**shell, "output": items, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                      "total_tokens": usage.get("total_tokens", 0),
                      "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                          "cached_tokens") or 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def _keep(store: bool, tenant: str, response: dict, conversation: list[dict]) -> None:
    """Keep the response and its whole conversation, for `previous_response_id` and GET."""
    if store:
        replies = _chat_messages([_as_input(i) for i in response["output"] if i["type"] != "reasoning"])
        _store.put(tenant, response, conversation + replies)


def _as_input(item: dict) -> dict:
    """An output item as the input item that stands for it in the next turn."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return item


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message_item(text: str) -> dict:
    return {"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


# ---- streamed: chat chunks -> Responses events -------------------------------------------------

class _Events:
    """Numbered events, and the output item open now (reasoning, message, or one call)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict] = []
        self.open: tuple[str, Any] | None = None

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def feed(self, delta: dict) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._ensure(("reasoning", None), lambda: _reasoning_item(""))
            out += self._text_delta("response.reasoning_text.delta", delta["reasoning_content"])
        if delta.get("content"):
            out += self._ensure(("message", None), lambda: _message_item(""))
            out += self._text_delta("response.output_text.delta", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            out += self._ensure(("call", call.get("index")),
                                lambda c=call, f=function: _call_item(c.get("id", ""), f.get("name", ""), ""))
            if function.get("arguments"):
                item = self.items[-1]
                item["arguments"] += function["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, delta=function["arguments"]))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        kind, _ = self.open
        self.open = None
        item, index = self.items[-1], len(self.items) - 1
        out = []
        if kind == "call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            out.append(self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"]))
            if kind == "message":
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        return [*out, self.event("response.output_item.done", output_index=index, item=item)]

    def _ensure(self, which: tuple[str, Any], make) -> list[str]:
        if self.open == which:
            return []
        out = self.close()
        self.open, item = which, make()
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item={**item, "status": "in_progress"} if "status" in item else item))
        if which[0] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _text_delta(self, kind: str, text: str) -> list[str]:
        item = self.items[-1]
        item["content"][0]["text"] += text
        return [self.event(kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text)]


async def _events(chunks: AsyncIterator[str], shell: dict, conversation: list[dict], tenant: str,
                  store: bool) -> AsyncIterator[str]:
    events, usage, cut = _Events(), None, False
    yield events.event("response.created", response=shell)
    yield events.event("response.in_progress", response=shell)
    async for raw in chunks:
        data = raw.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:  # the engine failed mid-stream: the error event, and no completed event
            error = chunk["error"]
            yield events.event("error", code=error.get("code"), message=error.get("message", ""), param=None)
            return
        for choice in chunk["choices"]:
            for event in events.feed(choice["delta"]):
                yield event
            cut |= choice.get("finish_reason") == "length"
        usage = chunk.get("usage") or usage
    for event in events.close():
        yield event
    response = _finished(shell, events.items, usage, cut)
    _keep(store, tenant, response, conversation)
    yield events.event("response.completed" if response["status"] == "completed" else "response.incomplete",
                       response=response)
