"""One API call's generation: its choices as engine requests, their text as it arrives.

A call with P prompts and `n` samples becomes P*n engine requests (`<id>-<k>-0`, `<id>-<k>-1`,
...), submitted together (all or none). `<id>` is the call's request id (the client's
`x-request-id` when it sent one) and `<k>` a number no other call in this process has, so two
calls that reuse an `x-request-id` never collide in the engine. Each choice decodes its own
tokens incrementally, applies stop strings (which the engine does not know about: a choice that
hits one is aborted in the engine), and counts its usage. Whatever ends the consumer early (client disconnect, error)
aborts the choices still running, so their KV blocks are freed at the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import EngineDeadError, EngineRequest, OutputStream
from engine.core import check_context_length
from engine.detokenizer import IncrementalDetokenizer, StopStrings
from engine.errors import RequestError
from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError, bad_request
from engine.server.prompts import Prompt
from engine.server.protocol import SamplingRequest
from engine.server.sampling import plan_request
from engine.server.state import ServerState

_calls = itertools.count()  # makes every call's engine request ids unique

# xgrammar's messages start with a time and its own source file ("[08:10:14] /project/cpp/
# json_schema_converter.cc:5082: "), which mean nothing to a client.
_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass
class Delta:
    """New text for one choice; `finish_reason` is set on the choice's last delta only."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the tokens since the last delta


class Choice:
    def __init__(self, index: int, request_id: str, prompt: Prompt, params: SamplingParams, tokenizer,
                 req: SamplingRequest, stops: StopStrings):
        self.index = index
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.include_stop = req.include_stop_str_in_output
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=req.skip_special_tokens, stop=stops,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        self.prompt_tokens = len(prompt.token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.token_ids: list[int] = []
        self.logprobs: list = []  # TokenLogprobs per output token, when asked for
        self.prompt_logprobs: list | None = None
        self._unsent_logprobs: list = []

    @property
    def text(self) -> str:
        return self.detok.text

    def advance(self, out: StepOutput) -> Delta:
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        ids = out.new_token_ids
        self.token_ids += ids
        self._take_logprobs(out)
        # The engine says "stop" only for a stop token (EOS or stop_token_ids); like vLLM, its
        # text is not part of the output unless asked for.
        by_token = out.finish_reason == "stop" and bool(ids)
        text = self.detok.update(ids[:-1] if by_token and not self.include_stop else ids, final=out.finished,
                                 match_stop=out.num_output_tokens > self.params.min_tokens)
        if self.detok.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        elif out.finished:
            self.finish_reason = out.finish_reason
            if by_token and ids[-1] in self.params.stop_token_ids:
                self.stop_reason = ids[-1]
        delta = Delta(self.index, text, self.finish_reason, self.stop_reason)
        if text or self.finish_reason is not None:  # logprobs travel with the text they belong to
            delta.logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        return delta

    def _take_logprobs(self, out: StepOutput) -> None:
        new = out.logprobs
        if new:
            self.logprobs += new
            self._unsent_logprobs += new
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


class Generation:
    def __init__(self, state: ServerState, request_id: str, req: SamplingRequest, prompts: list[Prompt]):
        """Blocking (bad_words are tokenized): use `create`, which builds it off the event loop."""
        self.state = state
        self.request_id = request_id
        self.req = req
        self.prompts = prompts
        self.created = int(time.time())
        self.choices: list[Choice] = []
        engine_id = f"{request_id}-{next(_calls)}"
        self.plan = plan_request(req, state, [len(p.token_ids) for p in prompts])
        stops = StopStrings(req.stop_strings)  # prepared once, shared by every choice
        for p_idx, prompt in enumerate(prompts):
            for i in range(req.n):
                index = p_idx * req.n + i
                self.choices.append(Choice(index, f"{engine_id}-{index}", prompt, self.plan.choice_params(p_idx, i),
                                           state.tokenizer, req, stops))
        self._by_id = {c.request_id: c for c in self.choices}
        self._stream: OutputStream | None = None

    @classmethod
    async def create(cls, state: ServerState, request_id: str, req: SamplingRequest,
                     prompts: list[Prompt]) -> Generation:
        """A Generation built in the tokenizer thread, so that no request's preparation (however
        heavy the allowed fields make it) holds up the event loop: /health and every other
        tenant's stream keep going meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.tokenizer_pool, cls, state, request_id, req, prompts)

    async def start(self, arrival_time: float) -> None:
        """Hand every choice to the engine: 503 when the queue is full, 400 if the engine refuses."""
        engine = self.state.engine
        self._check_context_length()  # first: a prompt that can never fit must not be told to retry
        if engine.num_waiting + len(self.choices) > self.state.settings.max_waiting:
            raise APIError(503, "the engine is overloaded: too many requests are waiting; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"})
        grammar = await self._compile_grammar()
        requests = [EngineRequest(c.request_id, c.prompt.token_ids, c.params, self.req.cache_salt, grammar)
                    for c in self.choices]
        try:
            self._stream = await engine.add(requests, arrival_time)
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not serving: {exc}", code="engine_unavailable") from exc
        except RequestError as exc:
            raise bad_request(str(exc), exc.param) from exc
        except ValueError as exc:  # a refusal that names no field
            raise bad_request(str(exc)) from exc

    def _check_context_length(self) -> None:
        """The engine's own check, made before the queue and the grammar are consulted."""
        try:
            for c in self.choices:
                check_context_length(len(c.prompt.token_ids), c.params.max_tokens, self.state.max_model_len)
        except RequestError as exc:
            raise bad_request(str(exc), exc.param) from exc

    async def _compile_grammar(self):
        """Structured output's grammar, compiled once for all choices in the grammar thread:
        big schemas take long, and neither the engine thread nor other requests' tokenization
        may wait on them."""
        params = self.choices[0].params
        if params.structured_outputs is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.state.grammar_pool, self.state.engine.core.compile_grammar, params)
        except ValueError as exc:
            raise bad_request(_XGRAMMAR_PREFIX.sub("", str(exc)).strip(), self.plan.constraint_field) from exc

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's new text as it arrives, until every choice has finished."""
        unfinished = len(self.choices)
        try:
            async for out in self._stream:
                choice = self._by_id[out.request_id]
                if choice.finish_reason is not None:
                    continue  # the engine's echo of an abort we sent after a stop string
                delta = choice.advance(out)
                if delta.finish_reason is not None:
                    unfinished -= 1
                    if not out.finished:  # a stop string: the engine does not know it is done
                        self.state.engine.abort([choice.request_id], finish_reason="stop")
                if delta.text or delta.finish_reason is not None:
                    yield delta
                if not unfinished:
                    return
        finally:
            self.abort_unfinished()

    async def run(self) -> None:
        """Run every choice to its end, for a response that is not streamed."""
        try:
            async for _ in self.deltas():
                pass
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc

    def abort_unfinished(self) -> None:
        left = [c.request_id for c in self.choices if c.finish_reason is None]
        if left:
            self.state.engine.abort(left)

    def usage(self) -> dict:
        """Exact usage: each prompt counted once however many samples it had."""
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        n = self.req.n
        cached = sum(min(c.cached_tokens for c in self.choices[i : i + n]) for i in range(0, len(self.choices), n))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
