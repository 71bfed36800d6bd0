"""`POST /v1/chat/completions`: the conversation rendered with the model's chat template, then
generated like a completion; plain or streamed as OpenAI's chat chunks."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from engine.async_engine import EngineDeadError
from engine.server.errors import bad_request, error_body
from engine.server.generation import Delta, Generation
from engine.server.logprobs import chat_logprobs, prompt_logprobs
from engine.server.prompts import Prompt, chat_prompt
from engine.server.protocol import ChatCompletionRequest, refuse_unsupported, warn_unknown_fields
from engine.server.sampling import check_request, structured_outputs
from engine.server.state import RequestId, ServerState, State
from engine.server.streaming import SSEResponse, sse, unless_disconnected
from engine.server.tools import ToolPlan, parse_tool_calls, template_tools, tool_plan

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: State, request_id: RequestId):
    arrival = time.monotonic()
    model = state.check_model(body.model)
    check_request(body, state.max_num_seqs)
    refuse_unsupported(body)
    warn_unknown_fields(body, request_id)
    plan = _tool_plan(body)
    prompt = await _prompt(state, body, plan)
    gen = await Generation.create(state, request_id, body, [prompt])
    await gen.start(arrival)
    cid = f"chatcmpl-{request_id}"
    if body.stream:
        events = _tool_events(gen, model, cid, plan) if plan and plan.mode != "none" else _events(gen, model, cid, _echo(body))
        return SSEResponse(events, gen.abort_unfinished)
    await unless_disconnected(request, gen.run())
    return _response(gen, model, cid, _echo(body), plan)


def _tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """Validate tools; a forced call becomes a JSON Schema constraint on the reply."""
    plan = tool_plan(body.tools, body.tool_choice)
    if plan is not None and plan.constrained:
        if structured_outputs(body) is not None:
            raise bad_request("a forced tool_choice already constrains the reply; drop response_format / "
                              "structured_outputs", "tool_choice")
        body.structured_outputs = {"json": plan.call_schema()}
    return plan


async def _prompt(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> Prompt:
    loop = asyncio.get_running_loop()
    kwargs = dict(body.chat_template_kwargs or {})
    if template_tools(body.tools, plan):
        kwargs["tools"] = body.tools

    def render() -> Prompt:
        return chat_prompt(
            state.tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=kwargs,
        )

    prompt = await loop.run_in_executor(state.tokenizer_pool, render)
    if body.truncate_prompt_tokens is not None:
        prompt.token_ids = prompt.token_ids[-body.truncate_prompt_tokens :]
    return prompt


def _echo(body: ChatCompletionRequest) -> str:
    """vLLM's `echo` for chat: the last message's text, when it is the assistant's own."""
    last = body.messages[-1]
    if body.echo and last.role == "assistant" and isinstance(last.content, str):
        return last.content
    return ""


def _logprobs(gen: Generation, entries: list) -> dict | None:
    if not gen.req.logprobs:
        return None
    return chat_logprobs(entries, gen.state.token_text, gen.req.top_logprobs or 0)


def _message(c, echo: str, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """The assistant message and finish reason: tool calls when the reply is one."""
    calls = parse_tool_calls(c.text, plan) if plan is not None and c.finish_reason != "length" else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": echo + c.text, "tool_calls": []}, c.finish_reason


def _response(gen: Generation, model: str, cid: str, echo: str, plan: ToolPlan | None = None) -> dict:
    choices = []
    for c in gen.choices:
        message, finish = _message(c, echo, plan)
        choices.append({"index": c.index, "message": message, "logprobs": _logprobs(gen, c.logprobs),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    body = {"id": cid, "object": "chat.completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage(), "system_fingerprint": None}
    if gen.req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(gen.choices[0].prompt_logprobs or [], gen.state.token_text)
    return body


def _chunk(gen: Generation, model: str, cid: str, index: int, delta: dict, finish_reason: str | None = None,
           stop_reason: str | int | None = None, logprobs: dict | None = None) -> dict:
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason, "stop_reason": stop_reason}]}
    if gen.req.include_usage:
        chunk["usage"] = gen.usage() if gen.req.continuous_usage else None
    return chunk


def _delta_chunk(gen: Generation, model: str, cid: str, d: Delta) -> dict:
    delta = {"content": d.text} if d.text else {}
    return _chunk(gen, model, cid, d.index, delta, d.finish_reason, d.stop_reason, _logprobs(gen, d.logprobs))


async def _tool_events(gen: Generation, model: str, cid: str, plan: ToolPlan) -> AsyncIterator[str]:
    """Streaming with tools: a call can only be told from text once it is complete, so each
    choice's reply is sent whole, as one tool-call delta or one content delta, then finished."""
    for c in gen.choices:
        yield sse(_chunk(gen, model, cid, c.index, {"role": "assistant", "content": ""}))
    try:
        async for _ in gen.deltas():
            pass
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc), code="engine_unavailable"))
        yield sse("[DONE]")
        return
    for c in gen.choices:
        message, finish = _message(c, "", plan)
        if message["tool_calls"]:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
        else:
            delta = {"content": message["content"]}
        yield sse(_chunk(gen, model, cid, c.index, delta, finish, c.stop_reason, _logprobs(gen, c.logprobs)))
    if gen.req.include_usage:
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": model,
                   "choices": [], "usage": gen.usage()})
    yield sse("[DONE]")


async def _events(gen: Generation, model: str, cid: str, echo: str) -> AsyncIterator[str]:
    for c in gen.choices:  # the role first, as OpenAI sends it
        yield sse(_chunk(gen, model, cid, c.index, {"role": "assistant", "content": echo}))
    try:
        async for d in gen.deltas():
            yield sse(_delta_chunk(gen, model, cid, d))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc), code="engine_unavailable"))
    else:
        if gen.req.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": model,
                       "choices": [], "usage": gen.usage()})
    yield sse("[DONE]")
