"""`POST /v1/completions`: text completion, plain or streamed, OpenAI's legacy shape."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from portcullis.engine.frontend.async_engine import EngineDeadError
from portcullis.engine.server.errors import bad_request, error_body
from portcullis.engine.server.generation import Choice, Delta, Generation
from portcullis.engine.server.logprobs import completion_logprobs, prompt_logprobs
from portcullis.engine.server.prompts import Prompt, completion_prompts
from portcullis.engine.server.protocol import (
    CompletionRequest,
    refuse_unsupported,
    warn_unknown_fields,
)
from portcullis.engine.server.sampling import check_request
from portcullis.engine.server.state import (
    PromptCap,
    RequestId,
    ServerState,
    State,
    Tenant,
    check_prompt_cap,
)
from portcullis.engine.server.streaming import SSEResponse, sse, unless_disconnected
from portcullis.protocol.requests import prompt_logprob_width, prompt_logprobs_problem, text_chars

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: State, request_id: RequestId,
                            tenant: Tenant, prompt_cap: PromptCap):
    arrival = time.monotonic()
    model = state.check_model(body.model)
    check_request(body, state.max_num_seqs)
    refuse_unsupported(body)
    warn_unknown_fields(body, request_id)
    texts = isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str)
    batch = body.prompt if texts else [body.prompt]  # each text of a batch is its own sequence
    state.check_prompt_text(max(map(text_chars, batch), default=0) + text_chars(body.suffix), body.truncate_prompt_tokens)
    prompts = await state.tokenizer_pool.run(tenant, _prompts, state, body)
    check_prompt_cap(max((len(p.token_ids) for p in prompts), default=0), prompt_cap, "prompt")
    width = prompt_logprob_width(body.logprobs, bool(body.echo), body.prompt_logprobs)
    problem = prompt_logprobs_problem(body.n, sum(len(p.token_ids) for p in prompts), width)
    if problem:  # before any scoring: the response would be built in one piece
        raise bad_request(problem, "logprobs" if body.echo and body.logprobs is not None else "prompt_logprobs")
    body = _with_end_ids(body, prompts, state.engine.info.eos_token_ids)
    gen = await Generation.create(state, request_id, tenant, body, prompts)
    await gen.start(arrival)
    if body.stream:
        return SSEResponse(_events(gen, model, f"cmpl-{request_id}"), gen.abort_unfinished)
    await unless_disconnected(request, gen.run())
    # Built and serialised in the tokenizer thread: with echo and logprobs it can be megabytes.
    return await state.tokenizer_pool.run(tenant, _json_response, gen, model, f"cmpl-{request_id}")


def _prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """The prompts' token ids, and with echo their text. Blocking: in the tokenizer thread."""
    prompts = completion_prompts(body, state.tokenizer, state.max_token_chars)
    if body.echo:
        for p in prompts:
            if p.text is None:
                p.text = state.tokenizer.decode(p.token_ids)
    return prompts


def _with_end_ids(body: CompletionRequest, prompts: list[Prompt], eos_token_ids) -> CompletionRequest:
    """The request with its prompts' end tokens (FIM's end-of-middle) as stop token ids, so
    generation ends there and the token is not shown; EOS already ends it, and ignore_eos asks
    for max_tokens whatever comes."""
    given = list(body.stop_token_ids or [])
    known = {*given, *eos_token_ids}
    extra = [t for t in dict.fromkeys(t for p in prompts for t in p.end_ids) if t not in known]
    if not extra or body.ignore_eos:
        return body
    return body.model_copy(update={"stop_token_ids": given + extra})


def _response(gen: Generation, model: str, cid: str) -> dict:
    echo = bool(gen.req.echo)
    choices = []
    for c in gen.choices:
        choice = {"index": c.index, "text": (c.prompt.text if echo else "") + c.text,
                  "logprobs": _full_logprobs(gen, c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if gen.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(c.prompt_logprobs or [], gen.state.token_text)
        choices.append(choice)
    return {"id": cid, "object": "text_completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage(), "system_fingerprint": None}


def _json_response(gen: Generation, model: str, cid: str) -> JSONResponse:
    return JSONResponse(_response(gen, model, cid))


def _full_logprobs(gen: Generation, c: Choice) -> dict | None:
    if gen.req.logprobs is None:
        return None
    entries, ids = list(c.logprobs), [e.token_id for e in c.logprobs]
    if gen.req.echo:  # the prompt's logprobs first; its first token has none
        entries, ids = list(c.prompt_logprobs or [None] * len(c.prompt.token_ids)) + entries, c.prompt.token_ids + ids
    return completion_logprobs(entries, ids, gen.state.token_text, 0)


class _Offsets:
    """Where each choice's next token starts in its streamed text (for `text_offset`)."""

    def __init__(self):
        self.at: dict[int, int] = {}

    def logprobs(self, gen: Generation, index: int, entries: list, ids: list[int]) -> dict | None:
        if gen.req.logprobs is None:
            return None
        out = completion_logprobs(entries, ids, gen.state.token_text, self.at.get(index, 0))
        self.at[index] = self.at.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out


def _chunk(gen: Generation, model: str, cid: str, d: Delta, logprobs: dict | None = None) -> dict:
    chunk = {"id": cid, "object": "text_completion", "created": gen.created, "model": model,
             "choices": [{"index": d.index, "text": d.text, "logprobs": logprobs,
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}
    if gen.req.include_usage:
        chunk["usage"] = gen.usage() if gen.req.continuous_usage else None
    return chunk


async def _events(gen: Generation, model: str, cid: str) -> AsyncIterator[str]:
    offsets = _Offsets()
    try:
        async for d in gen.deltas():
            c = gen.choices[d.index]
            if gen.req.echo and c.index not in offsets.at:  # the prompt's logprobs may be many
                yield await gen.state.tokenizer_pool.run(gen.tenant, _echo_event, gen, model, cid, c, offsets)
            yield sse(_chunk(gen, model, cid, d, offsets.logprobs(gen, d.index, d.logprobs, [e.token_id for e in d.logprobs])))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc), code="engine_unavailable"))
    else:
        if gen.req.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": gen.created, "model": model,
                       "choices": [], "usage": gen.usage()})
    yield sse("[DONE]")


def _echo_event(gen: Generation, model: str, cid: str, c: Choice, offsets: _Offsets) -> str:
    """The prompt, sent before the choice's first text (with its logprobs, once they exist)."""
    entries = list(c.prompt_logprobs or [None] * len(c.prompt.token_ids))
    offsets.at.setdefault(c.index, 0)
    return sse(_chunk(gen, model, cid, Delta(c.index, c.prompt.text or ""),
                      offsets.logprobs(gen, c.index, entries, c.prompt.token_ids)))
