"""One API call's generation: its choices as engine requests, their text as it arrives.

A call with P prompts and `n` samples becomes P*n engine requests (`<id>-<k>-0`, `<id>-<k>-1`,
...), submitted together (all or none). `<id>` is the call's request id (the client's
`x-request-id` when it sent one) and `<k>` a number no other call in this process has, so two
calls that reuse an `x-request-id` never collide in the engine. Each choice is a `SampleOutput`,
as in `LLM`: it decodes its tokens, applies stop strings (which the engine does not know about: a
choice that hits one is aborted in the engine), and counts its usage. Whatever ends the consumer
early (client disconnect, error) aborts the choices still running, so their KV blocks are freed at
the next step.
"""
from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

from portcullis.engine.errors import RequestError
from portcullis.engine.frontend.async_engine import EngineDeadError, EngineRequest, OutputStream
from portcullis.engine.frontend.detokenizer import StopStrings
from portcullis.engine.frontend.output_processor import (
    Delta,
    OutputProcessor,
    SampleOutput,
    fan_out,
)
from portcullis.engine.sampling_params import SamplingParams
from portcullis.engine.server.errors import APIError, bad_request
from portcullis.engine.server.prompts import Prompt
from portcullis.engine.server.protocol import SamplingRequest
from portcullis.engine.server.sampling import plan_request, prediction_ids
from portcullis.engine.server.state import ServerState, engine_request_id

# xgrammar's messages start with a time and its own source file ("[08:10:14] /project/cpp/
# json_schema_converter.cc:5082: "), which mean nothing to a client.
_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")


class Choice(SampleOutput):
    """One choice of an API call: a sample, and the prompt it continues."""

    def __init__(self, index: int, request_id: str, prompt: Prompt, params: SamplingParams, tokenizer,
                 stops: StopStrings, incremental: bool):
        super().__init__(index, request_id, params, tokenizer, stops, incremental, prompt.token_ids)
        self.prompt = prompt
        self.prompt_tokens = len(prompt.token_ids)


class Generation:
    def __init__(self, state: ServerState, request_id: str, tenant: str, req: SamplingRequest, prompts: list[Prompt]):
        """Blocking (bad_words are tokenized): use `create`, which builds it off the event loop."""
        self.state = state
        self.request_id = request_id
        self.tenant = tenant
        self.req = req
        self.prompts = prompts
        self.created = int(time.time())
        self.choices: list[Choice] = []
        engine_id = engine_request_id(request_id)
        self.plan = plan_request(req, state, [len(p.token_ids) for p in prompts])
        self.prediction = prediction_ids(req, state.tokenizer)
        stops = StopStrings(req.stop_strings)  # prepared once, shared by every choice
        incremental = bool(req.stream or stops)  # else each choice's text is decoded once, at its end
        for p_idx, (prompt, params) in enumerate(zip(prompts, self.plan.prompt_params)):
            for rid, choice_params in fan_out(engine_id, params, first_index=p_idx * req.n):
                index = len(self.choices)
                self.choices.append(Choice(index, rid, prompt, choice_params, state.tokenizer, stops, incremental))
        self.outputs = OutputProcessor(self.choices)
        self._stream: OutputStream | None = None

    @classmethod
    async def create(cls, state: ServerState, request_id: str, tenant: str, req: SamplingRequest,
                     prompts: list[Prompt]) -> Generation:
        """A Generation built in the tokenizer thread, in `tenant`'s turn, so that no request's
        preparation (however heavy the allowed fields make it) holds up the event loop: /health and
        every other tenant's stream keep going meanwhile. Its plan checks that every prompt fits the
        context first: a prompt that can never fit must not be told to retry by the queue check."""
        return await state.tokenizer_pool.run(tenant, cls, state, request_id, tenant, req, prompts)

    async def start(self, arrival_time: float) -> None:
        """Hand every choice to the engine: 503 when the queue is full, 400 if the engine refuses."""
        engine = self.state.engine
        if engine.num_waiting + len(self.choices) > self.state.settings.max_waiting:
            raise APIError(503, "the engine is overloaded: too many requests are waiting; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"})
        grammar = await self._compile_grammar()
        requests = [EngineRequest(c.request_id, c.prompt.token_ids, c.params, self.req.cache_salt, grammar,
                                  self.req.priority, self.prediction) for c in self.choices]
        try:
            self._stream = await engine.add(requests, arrival_time)
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not serving: {exc}", code="engine_unavailable") from exc

    async def _compile_grammar(self):
        """Structured output's grammar, compiled once for all choices in the grammar thread:
        big schemas take long, and neither the engine thread nor other requests' tokenization
        may wait on them."""
        params = self.choices[0].params
        if params.structured_outputs is None:
            return None
        try:
            return await self.state.grammar_pool.run(self.tenant, self.state.compile_grammar, params)
        except RequestError as exc:  # the grammar does not parse: the client's schema, regex or grammar
            raise bad_request(_XGRAMMAR_PREFIX.sub("", str(exc)).strip(), self.plan.constraint_field) from exc

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's new text as it arrives, until every choice has finished."""
        try:
            async for out in self._stream:
                delta, abort = self.outputs.process(out)
                if out.prompt_logprobs is not None:
                    self._share_prompt_logprobs(out.request_id)
                if abort:  # a stop string: the engine does not know the choice is done
                    self.state.engine.abort([out.request_id], finish_reason="stop")
                if delta is not None:
                    yield delta
                if not self.outputs.num_unfinished:
                    return
        finally:
            self.abort_unfinished()

    def _share_prompt_logprobs(self, request_id: str) -> None:
        """The first sample of a prompt scores it (`SamplingParams.for_sample`); its siblings show
        the same prompt logprobs. It reaches its first output no later than they do: it is admitted
        first and computes the prompt blocks they take from the cache."""
        n = self.req.n
        first = next(c for c in self.choices if c.request_id == request_id)
        for sibling in self.choices[first.index - first.index % n : first.index - first.index % n + n]:
            sibling.prompt_logprobs = first.prompt_logprobs

    async def run(self) -> None:
        """Run every choice to its end, for a response that is not streamed."""
        try:
            async for _ in self.deltas():
                pass
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc

    def abort_unfinished(self) -> None:
        left = self.outputs.unfinished_ids()
        if left:
            self.state.engine.abort(left)

    def usage(self) -> dict:
        """Exact usage: each prompt counted once however many samples it had."""
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        n = self.req.n
        cached = sum(min(c.cached_tokens for c in self.choices[i : i + n]) for i in range(0, len(self.choices), n))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.prediction is not None:  # OpenAI's: prediction tokens used, and those not used
            accepted = sum(c.accepted_prediction_tokens for c in self.choices)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": max(0, len(self.prediction) * len(self.choices) - accepted),
            }
        return usage
