"""`POST /v1/chat/completions`: the conversation rendered with the model's chat template, then
generated like a completion; plain or streamed as OpenAI's chat chunks. With tools or a reasoning
parser each choice's text goes through a `ReplyParser` as it streams, so reasoning, content and
tool calls each arrive as their own deltas while they are generated."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from portcullis.engine.errors import RequestError
from portcullis.engine.frontend.async_engine import EngineDeadError
from portcullis.engine.server.errors import bad_request, error_body
from portcullis.engine.server.generation import Delta, Generation
from portcullis.engine.server.logprobs import chat_logprobs, prompt_logprobs
from portcullis.engine.server.prompts import Prompt, chat_prompt
from portcullis.engine.server.protocol import (
    ChatCompletionRequest,
    refuse_unsupported,
    warn_unknown_fields,
)
from portcullis.engine.server.reasoning import after_reasoning, replies_reason
from portcullis.engine.server.reply import ReplyFormat, ReplyParser
from portcullis.engine.server.sampling import check_request, constraint_field, structured_outputs
from portcullis.engine.server.settings import ServerSettings
from portcullis.engine.server.state import (
    PromptCap,
    RequestId,
    ServerState,
    State,
    Tenant,
    check_prompt_cap,
)
from portcullis.engine.server.streaming import SSEResponse, sse, unless_disconnected
from portcullis.engine.server.tool_parsers import compact_deltas
from portcullis.engine.server.tools import ToolPlan, template_tools, tool_plan
from portcullis.protocol.requests import (
    messages_chars,
    prompt_logprob_width,
    prompt_logprobs_problem,
)

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: State, request_id: RequestId,
                                 tenant: Tenant, prompt_cap: PromptCap):
    arrival = time.monotonic()
    model = state.check_model(body.model)
    check_request(body, state.max_num_seqs)
    refuse_unsupported(body)
    warn_unknown_fields(body, request_id)
    plan = _tool_plan(body, state.settings)
    state.check_prompt_text(messages_chars(body.messages), body.truncate_prompt_tokens, "messages")
    prompt = await _prompt(state, tenant, body, plan)
    check_prompt_cap(len(prompt.token_ids), prompt_cap, "messages")
    problem = prompt_logprobs_problem(body.n, len(prompt.token_ids), prompt_logprob_width(None, False, body.prompt_logprobs))
    if problem:  # before any scoring: the response would be built in one piece
        raise bad_request(problem, "prompt_logprobs")
    reply = ReplyFormat(replies_reason(state.settings.reasoning_parser, prompt.text, body.chat_template_kwargs), plan)
    await _constrain_content(state, tenant, body, reply)
    gen = await Generation.create(state, request_id, tenant, body, [prompt])
    await gen.start(arrival)
    cid = f"chatcmpl-{request_id}"
    if body.stream:
        return SSEResponse(_events(gen, model, cid, _echo(body), reply), gen.abort_unfinished)
    await unless_disconnected(request, gen.run())
    # Built and serialised in the tokenizer thread: with prompt logprobs it can be megabytes.
    return await state.tokenizer_pool.run(tenant, _json_response, gen, model, cid, _echo(body), reply)


async def prompt_tokens(state: ServerState, tenant: str, body: ChatCompletionRequest) -> int:
    """How many tokens the conversation's prompt takes, tools included, as this route renders it."""
    state.check_model(body.model)
    return len((await _prompt(state, tenant, body, _tool_plan(body, state.settings))).token_ids)


def _tool_plan(body: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan | None:
    """Validate tools; a forced call becomes a JSON Schema constraint on the reply."""
    plan = tool_plan(body.tools, body.tool_choice, settings.tool_call_parser if settings.enable_auto_tool_choice else None,
                     body.parallel_tool_calls is not False)
    if plan is not None and plan.constrained:
        if structured_outputs(body) is not None:
            raise bad_request("a forced tool_choice already constrains the reply; drop response_format / "
                              "structured_outputs", "tool_choice")
        body.structured_outputs = {"json": plan.call_schema()}
    if plan is not None and plan.parser_class is not None and plan.parser_class.special_tokens:
        body.skip_special_tokens = False  # the format's markers are special tokens: keep them to read them
    return plan


async def _constrain_content(state: ServerState, tenant: str, body: ChatCompletionRequest, reply: ReplyFormat) -> None:
    """With reasoning, structured output constrains only the content after it, as in vLLM (unless
    the server was told to constrain the reasoning too): the reasoning runs freely to `</think>`."""
    spec = structured_outputs(body)
    if spec is None or not reply.reasons or state.settings.structured_outputs_in_reasoning:
        return
    field = constraint_field(body)
    try:
        grammar = await state.grammar_pool.run(tenant, after_reasoning, spec)
    except RequestError as exc:  # the client's schema, regex or grammar; any other error is ours (500)
        raise bad_request(f"invalid {field} for structured output: {exc}", field) from exc
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        setattr(body, name, None)
    body.structured_outputs = {"grammar": grammar}


async def _prompt(state: ServerState, tenant: str, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> Prompt:
    def render() -> Prompt:
        return chat_prompt(
            state.tokenizer, body.messages, body.truncate_prompt_tokens, state.max_token_chars,
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs, tools=template_tools(body.tools, plan),
        )

    return await state.tokenizer_pool.run(tenant, render)


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


def _finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after making calls."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def _message(c, echo: str, reply: ReplyFormat) -> tuple[dict, str | None]:
    """The assistant message and finish reason of a whole reply."""
    if reply.plain:
        return {"role": "assistant", "content": echo + c.text, "tool_calls": []}, c.finish_reason
    message = reply.message(c.text, echo)
    return message, _finish_reason(c.finish_reason, bool(message["tool_calls"]))


def _json_response(gen: Generation, model: str, cid: str, echo: str, reply: ReplyFormat) -> JSONResponse:
    return JSONResponse(_response(gen, model, cid, echo, reply))


def _response(gen: Generation, model: str, cid: str, echo: str, reply: ReplyFormat) -> dict:
    choices = []
    for c in gen.choices:
        message, finish = _message(c, echo, reply)
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


async def _events(gen: Generation, model: str, cid: str, echo: str, reply: ReplyFormat) -> AsyncIterator[str]:
    for c in gen.choices:  # the role first, as OpenAI sends it
        yield sse(_chunk(gen, model, cid, c.index, {"role": "assistant", "content": echo}))
    parsed = None if reply.plain else _ParsedChunks(gen, model, cid, reply)
    try:
        async for d in gen.deltas():
            if parsed is None:
                yield sse(_delta_chunk(gen, model, cid, d))
                continue
            for chunk in parsed.chunks(d):
                yield sse(chunk)
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc), code="engine_unavailable"))
    else:
        if gen.req.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": model,
                       "choices": [], "usage": gen.usage()})
    yield sse("[DONE]")


class _ParsedChunks:
    """A streamed reply's chunks when its text is parsed: each engine delta becomes as many
    chunks as the parser has deltas for (none while it holds text back); logprobs travel with
    the next chunk that is sent."""

    def __init__(self, gen: Generation, model: str, cid: str, reply: ReplyFormat):
        self.gen, self.model, self.cid = gen, model, cid
        self.parsers: list[ReplyParser] = [reply.parser() for _ in gen.choices]
        self.unsent_logprobs: dict[int, list] = {}

    def chunks(self, d: Delta) -> list[dict]:
        parser = self.parsers[d.index]
        deltas = parser.feed(d.text) if d.text else []
        finish = None
        if d.finish_reason is not None:
            deltas = compact_deltas(deltas + parser.finish())
            finish = _finish_reason(d.finish_reason, parser.called)
        logprobs = self.unsent_logprobs.pop(d.index, []) + d.logprobs
        if not deltas and finish is None:
            if logprobs:
                self.unsent_logprobs[d.index] = logprobs
            return []
        *first, last = deltas or [{}]
        out = [_chunk(self.gen, self.model, self.cid, d.index, delta) for delta in first]
        out.append(_chunk(self.gen, self.model, self.cid, d.index, last, finish, d.stop_reason,
                          _logprobs(self.gen, logprobs)))
        return out
