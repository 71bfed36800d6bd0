"""Offline batch API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


@dataclass
class _Sample:
    """One of a prompt's `n` samples while it runs."""

    request: Request
    index: int
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    detok: IncrementalDetokenizer | None = None  # only for samples with stop strings

    @property
    def stopped_by_string(self) -> bool:
        return self.detok is not None and self.detok.stopped


class LLM:
    def __init__(self, model: str, skip_tokenizer_init: bool = False, **kwargs):
        """`kwargs` are `EngineConfig` fields (dtype, block_size, max_model_len, ...). With
        `skip_tokenizer_init`, prompts must be token ids and outputs carry no text, as in vLLM."""
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model_path)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. Prompts are strings, token-id lists, or
        `{"prompt_token_ids": [...]}`; one SamplingParams for all, or one per prompt. A prompt
        with `n > 1` gets n samples that share its prompt's KV blocks through the prefix cache."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        # Tokenise, validate and compile grammars before queueing anything: a bad prompt fails
        # the call without leaving half a batch behind in the engine.
        encoded = [self._encode(p) for p in prompts]
        grammars = self._compile_grammars(params)
        samples: list[list[_Sample]] = []
        try:
            for (_, ids), sp in zip(encoded, params):
                samples.append(self._add(ids, sp, grammars.get(id(sp))))
        except ValueError:
            self.engine.abort([s.request.request_id for group in samples for s in group])
            raise
        self._run(samples, use_tqdm)
        return [self._output(group, text) for group, (text, _) in zip(samples, encoded)]

    def _add(self, ids: list[int], sp: SamplingParams, grammar) -> list[_Sample]:
        base = f"offline-{next(self._ids)}"
        if sp.n == 1:
            return [self._sample(self.engine.add_request(base, ids, sp, grammar=grammar), 0)]
        return [
            self._sample(self.engine.add_request(f"{base}-{i}", ids, sp.for_sample(i), grammar=grammar), i)
            for i in range(sp.n)
        ]

    def _sample(self, req: Request, index: int) -> _Sample:
        detok = None
        if req.params.stop and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.params.skip_special_tokens,
                                           stop=req.params.stop,
                                           include_stop_str_in_output=req.params.include_stop_str_in_output)
        return _Sample(req, index, detok=detok)

    def _compile_grammars(self, params: list[SamplingParams]) -> dict[int, object]:
        return {id(sp): self.engine.compile_grammar(sp) for sp in params if sp.structured_outputs is not None}

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and (isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)):
            raise ValueError("this LLM was created with skip_tokenizer_init=True: give prompts as token ids")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def _run(self, samples: list[list[_Sample]], use_tqdm: bool) -> None:
        by_id = {s.request.request_id: s for group in samples for s in group}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(by_id), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                finished = self._collect(by_id[out.request_id], out)
                if finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    def _collect(self, sample: _Sample, out: StepOutput) -> bool:
        if out.logprobs:
            sample.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            sample.prompt_logprobs = out.prompt_logprobs
        if sample.detok is not None:
            # Stop strings are matched on the text, incrementally, so they may span tokens.
            sample.detok.update(out.new_token_ids, final=out.finished,
                                match_stop=out.num_output_tokens > sample.request.params.min_tokens)
            if sample.detok.stopped:
                if not out.finished:
                    self.engine.abort([out.request_id])
                return True
        return out.finished

    def _output(self, group: list[_Sample], prompt: str | None) -> RequestOutput:
        completions = [self._completion(s) for s in group]
        first = group[0].request
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time)
        return RequestOutput(
            first.request_id.rsplit("-", 1)[0] if len(group) > 1 else first.request_id, prompt,
            first.prompt_token_ids, completions, True, max(first.num_cached_tokens, 0), metrics,
            group[0].prompt_logprobs,
        )

    def _completion(self, sample: _Sample) -> CompletionOutput:
        req = sample.request
        ids = req.output_token_ids
        if sample.stopped_by_string:
            text = sample.detok.text
        elif self.tokenizer is None:
            text = ""
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        reason = "stop" if sample.stopped_by_string else req.status.value
        logprobs = sample.logprobs if req.params.logprobs is not None else None
        cumulative = sum(lp.logprob for lp in sample.logprobs) if logprobs else None
        return CompletionOutput(sample.index, text, ids, reason, cumulative, logprobs)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
