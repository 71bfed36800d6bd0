"""A stub of the engine's private server, for gateway tests and the gateway benchmark.

It answers the engine contract (bearer token on every route but /health, OpenAI bodies,
SSE streams ending in `data: [DONE]`, `include_usage`, `x-request-id` echo, OpenAI error
bodies) instantly and deterministically, and records what it received so tests can check
what the gateway forwarded. A request body may carry two knobs of its own: `stub_delay_s`
(seconds between streamed events), `stub_break_after` (a streamed message drops its connection
after that many text deltas) and `stub_tool_calls` (a chat reply making that many tool
calls, streamed as OpenAI streams them). `/v1/embeddings` answers vectors of `dimensions`
(default 4) values. `/v1/messages` answers as the engine's Anthropic route does (a message, or
its events: message_start with the input tokens, text and tool_use blocks, message_delta with
the output tokens, message_stop), and `/v1/messages/count_tokens` counts as `/tokenize`.
`/v1/responses` answers as the engine's Responses route does: a Response object (a message item
of `max_output_tokens` (default 16) text tokens, then `stub_tool_calls` function calls), or its
numbered events from `response.created` to `response.completed` (`response.incomplete` when no
call was made: the reply ran to its length); `stub_break_after` breaks these streams too. Run alone:

    python -m portcullis.testing.stub_engine --uds /tmp/engine.sock --token-file TOKEN
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from portcullis import envs

MODELS = ("demo", "other", "secret-model")


@dataclass
class StubState:
    token: str
    chunk_delay_s: float = 0.0
    fail_status: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    streams_started: int = 0
    streams_finished: int = 0
    streams_aborted: int = 0
    models: tuple[str, ...] = MODELS  # the names it serves (a fleet test runs several stubs)
    max_model_len: int = 4096
    max_token_chars: int | None = None  # on its cards when set, as the engine gives it
    gauges: dict[str, float] = field(default_factory=dict)  # extra vllm:* values for /metrics

    def remember(self, request: Request, body: Any) -> None:
        self.requests.append({"method": request.method, "path": request.url.path,
                              "headers": dict(request.headers), "body": body})
        del self.requests[:-200]


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None,
           path: str = "") -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": "stub_error", "param": None, "code": code}}
    if path.startswith("/v1/messages"):  # Anthropic's envelope, as the engine answers there
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _usage(prompt: Any, completion: int) -> dict[str, Any]:
    prompt_tokens = len(json.dumps(prompt)) // 4 + 1
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": 0}}


def _chunk(kind: str, model: str, index: int, text: str) -> dict[str, Any]:
    choice = {"index": 0, "finish_reason": None}
    choice.update({"delta": {"content": text}} if kind == "chat" else {"text": text})
    return {"id": "cmpl-stub", "object": f"{kind}.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [choice]}


def _tool_call_chunks(model: str, calls: int) -> list[dict[str, Any]]:
    """OpenAI's streamed tool calls: per call, its id and name once, then `arguments` fragments
    under the same index; the last chunk has finish_reason "tool_calls"."""
    chunks = []
    for i in range(calls):
        first = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": ""}}
        fragments = [{"index": i, "function": {"arguments": part}} for part in ('{"q": ', f'"x{i}"}}')]
        for delta in (first, *fragments):
            chunk = _chunk("chat", model, 0, "")
            chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
            chunks.append(chunk)
    chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
    return chunks


def _tool_calls(calls: int) -> list[dict[str, Any]]:
    return [{"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "x{i}"}}'}}
            for i in range(calls)]


async def _events(state: StubState, kind: str, body: dict[str, Any], n: int):
    state.streams_started += 1
    model = body.get("model", "demo")
    delay = float(body.get("stub_delay_s", state.chunk_delay_s))
    calls = int(body.get("stub_tool_calls", 0)) if kind == "chat" else 0
    try:
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            yield f"data: {json.dumps(_chunk(kind, model, i, f' tok{i}'))}\n\n"
        for chunk in _tool_call_chunks(model, calls) if calls else ():
            yield f"data: {json.dumps(chunk)}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": "cmpl-stub", "object": "chunk", "model": model, "choices": [],
                     "usage": _usage(body.get("messages", body.get("prompt")), n)}
            yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"
        state.streams_finished += 1
    except (asyncio.CancelledError, GeneratorExit):
        state.streams_aborted += 1
        raise


def _completion(kind: str, body: dict[str, Any], n: int) -> dict[str, Any]:
    text = "".join(f" tok{i}" for i in range(n))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text, "tool_calls": []}} if kind == "chat" else {"text": text})
    calls = int(body.get("stub_tool_calls", 0)) if kind == "chat" else 0
    if calls:  # as the engine answers a reply that made calls
        choice["message"]["tool_calls"], choice["finish_reason"] = _tool_calls(calls), "tool_calls"
    return {"id": "cmpl-stub", "object": f"{kind}.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": body.get("model", "demo"), "choices": [choice],
            "usage": _usage(body.get("messages", body.get("prompt")), n)}


def _message_tokens(body: dict[str, Any]) -> int:
    """The stub's count of an Anthropic prompt (system and messages), as its /tokenize counts."""
    return len(json.dumps([body.get("system"), body.get("messages")]).split())


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _message(body: dict[str, Any], n: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "".join(f" tok{i}" for i in range(n))}]
    calls = int(body.get("stub_tool_calls", 0))
    content += [{"type": "tool_use", "id": f"toolu_{i}", "name": "lookup", "input": {"q": f"x{i}"}} for i in range(calls)]
    return {"id": "msg_stub", "type": "message", "role": "assistant", "model": body.get("model", "demo"),
            "content": content, "stop_reason": "tool_use" if calls else "max_tokens", "stop_sequence": None,
            "usage": {"input_tokens": _message_tokens(body), "output_tokens": n, "cache_read_input_tokens": 0}}


async def _message_events(state: StubState, body: dict[str, Any], n: int):
    state.streams_started += 1
    whole = _message(body, n)
    delay = float(body.get("stub_delay_s", state.chunk_delay_s))
    try:
        start = {**whole, "content": [], "stop_reason": None, "usage": {**whole["usage"], "output_tokens": 0}}
        yield _event("message_start", {"message": start})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            if i == body.get("stub_break_after"):  # the engine dies mid-stream: the connection drops
                raise RuntimeError("the stub engine broke off the stream")
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": f" tok{i}"}})
        yield _event("content_block_stop", {"index": 0})
        for index, block in enumerate(whole["content"][1:], start=1):
            yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield _event("content_block_delta", {"index": index, "delta": partial})
            yield _event("content_block_stop", {"index": index})
        yield _event("message_delta", {"delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
                                       "usage": {"output_tokens": n}})
        yield _event("message_stop", {})
        state.streams_finished += 1
    except (asyncio.CancelledError, GeneratorExit):
        state.streams_aborted += 1
        raise


def _response(body: dict[str, Any], n: int) -> dict[str, Any]:
    text = {"type": "output_text", "text": "".join(f" tok{i}" for i in range(n)), "annotations": []}
    output: list[dict[str, Any]] = [{"type": "message", "id": "msg_stub", "status": "completed",
                                     "role": "assistant", "content": [text]}]
    calls = int(body.get("stub_tool_calls", 0))
    output += [{"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "lookup",
                "arguments": json.dumps({"q": f"x{i}"}), "status": "completed"} for i in range(calls)]
    prompt = len(json.dumps([body.get("instructions"), body.get("input")]).split())
    usage = {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": "resp_stub", "object": "response", "created_at": int(time.time()),
            "status": "completed" if calls else "incomplete",
            "incomplete_details": None if calls else {"reason": "max_output_tokens"},
            "model": body.get("model", "demo"), "output": output, "usage": usage}


async def _response_events(state: StubState, body: dict[str, Any], n: int):
    state.streams_started += 1
    whole = _response(body, n)
    delay = float(body.get("stub_delay_s", state.chunk_delay_s))
    numbers = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        return _event(kind, {**data, "sequence_number": next(numbers)})

    try:
        start = {**whole, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        message = whole["output"][0]
        yield event("response.output_item.added", output_index=0, item={**message, "content": [], "status": "in_progress"})
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", item_id="msg_stub", output_index=0, content_index=0, part=part)
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            if i == body.get("stub_break_after"):  # the engine dies mid-stream: the connection drops
                raise RuntimeError("the stub engine broke off the stream")
            yield event("response.output_text.delta", item_id="msg_stub", output_index=0, content_index=0, delta=f" tok{i}")
        text = message["content"][0]
        yield event("response.output_text.done", item_id="msg_stub", output_index=0, content_index=0, text=text["text"])
        yield event("response.content_part.done", item_id="msg_stub", output_index=0, content_index=0, part=text)
        yield event("response.output_item.done", output_index=0, item=message)
        for index, call in enumerate(whole["output"][1:], start=1):
            yield event("response.output_item.added", output_index=index, item={**call, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index, delta=call["arguments"])
            yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index, arguments=call["arguments"])
            yield event("response.output_item.done", output_index=index, item=call)
        yield event(f"response.{whole['status']}", response=whole)
        state.streams_finished += 1
    except (asyncio.CancelledError, GeneratorExit):
        state.streams_aborted += 1
        raise


class _Guard:
    """Pure ASGI (no BaseHTTPMiddleware) so streams and disconnects pass through untouched."""

    def __init__(self, app: Any, state: StubState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if headers.get(b"authorization") != f"Bearer {self.state.token}".encode():
            return await _error(401, "Missing or invalid internal token.", "unauthorized",
                                path=scope["path"])(scope, receive, send)
        if self.state.fail_status:
            error = _error(self.state.fail_status, "Overloaded.", "overloaded", {"retry-after": "2"}, scope["path"])
            return await error(scope, receive, send)
        request_id = headers.get(b"x-request-id")

        async def echo_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and request_id:
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, echo_id)


def create_stub_app(token: str) -> tuple[FastAPI, StubState]:
    state = StubState(token=token)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(_Guard, state=state)

    async def generate(request: Request, kind: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "Bad JSON.", "bad_json")
        state.remember(request, body)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if body.get("stream"):
            return StreamingResponse(_events(state, kind, body, n), media_type="text/event-stream")
        return JSONResponse(_completion(kind, body, n))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "text")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = json.loads(await request.body())
        state.remember(request, body)
        if not isinstance(body.get("max_tokens"), int) or not body.get("messages"):
            return _error(400, "max_tokens and messages are required.", "bad_request", path=request.url.path)
        n = body["max_tokens"]
        if body.get("stream"):
            return StreamingResponse(_message_events(state, body, n), media_type="text/event-stream")
        return JSONResponse(_message(body, n))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        state.remember(request, body)
        return {"input_tokens": _message_tokens(body)}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = json.loads(await request.body())
        state.remember(request, body)
        if body.get("input") is None:
            return _error(400, "input is required.", "bad_request")
        n = int(body.get("max_output_tokens") or 16)
        if body.get("stream"):
            return StreamingResponse(_response_events(state, body, n), media_type="text/event-stream")
        return JSONResponse(_response(body, n))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        """A stored Response, read back: the engine keeps them per tenant (its tag header)."""
        state.remember(request, None)
        tenant = request.headers.get("x-portcullis-tenant", "")
        return JSONResponse({**_response({"input": "stored"}, 4), "id": response_id, "stored_for": tenant})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = json.loads(await request.body())
        state.remember(request, body)
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else inputs
        if not inputs:
            return _error(400, "'input' is empty.", "bad_request")
        tokens = [len(x.split()) + 1 if isinstance(x, str) else len(x) for x in inputs]
        size = int(body.get("dimensions") or 4)
        data = [{"object": "embedding", "index": i, "embedding": [0.5] * size} for i in range(len(inputs))]
        return JSONResponse({"object": "list", "data": data, "model": body.get("model", "demo"),
                             "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.remember(request, None)
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "stub", "max_model_len": state.max_model_len,
                                            "max_token_chars": state.max_token_chars} for m in state.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        state.remember(request, None)
        if model_id not in state.models:
            body = {"message": f"The model `{model_id}` does not exist.", "type": "not_found_error",
                    "param": "model", "code": "model_not_found"}  # as the engine words it
            return JSONResponse({"error": body}, status_code=404)
        return JSONResponse({"id": model_id, "object": "model", "owned_by": "stub", "max_model_len": state.max_model_len})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        state.remember(request, body)
        text = json.dumps(body.get("messages", body.get("prompt", "")))
        fim = 4 + len(json.dumps(body["suffix"]).split()) if body.get("suffix") else 0  # markers and suffix, as the engine
        return {"count": len(text.split()) + fim, "max_model_len": 4096, "tokens": []}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        state.remember(request, None)
        gauges = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, **state.gauges}
        return PlainTextResponse("".join(f'{k}{{model_name="stub"}} {v}\n' for k, v in gauges.items()))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "stub"}

    @app.post("/pause")
    async def pause(request: Request) -> dict[str, str]:
        state.remember(request, None)  # a control route: the gateway must never reach it
        return {"status": "paused"}

    return app, state


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uds", help="Unix socket path to listen on")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--token-file", help="file holding the internal token (else env STUB_ENGINE_TOKEN)")
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    parser.add_argument("--model", action="append", help="a model name it serves (repeat; default: "
                        + ", ".join(MODELS) + ")")
    args = parser.parse_args()
    token = open(args.token_file).read().strip() if args.token_file else envs.STUB_ENGINE_TOKEN.get()
    if not token:
        parser.error(f"give --token-file or set {envs.STUB_ENGINE_TOKEN.name}")
    app, state = create_stub_app(token)
    state.chunk_delay_s = args.chunk_delay_s
    state.models = tuple(args.model) if args.model else MODELS
    where = {"uds": args.uds} if args.uds else {"host": args.host, "port": args.port}
    uvicorn.run(app, log_level="warning", access_log=False, **where)


if __name__ == "__main__":
    main()
