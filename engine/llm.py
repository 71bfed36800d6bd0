"""Offline batch API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


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

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. Prompts are strings, token-id lists, or
        `{"prompt_token_ids": [...]}`; one SamplingParams for all, or one per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        # Tokenise and validate everything before queueing anything: a bad prompt fails the call
        # without leaving half a batch behind in the engine.
        encoded = [self._encode(p) for p in prompts]
        reqs: list[Request] = []
        try:
            for (_, ids), sp in zip(encoded, params):
                reqs.append(self.engine.add_request(f"offline-{next(self._ids)}", ids, sp))
        except ValueError:
            self.engine.abort([r.request_id for r in reqs])
            raise
        self._run(len(reqs), use_tqdm)
        return [self._output(r, text) for r, (text, _) in zip(reqs, encoded)]

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

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    def _output(self, req: Request, prompt: str | None) -> RequestOutput:
        ids = req.output_token_ids
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        completion = CompletionOutput(0, text, ids, req.status.value)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time)
        return RequestOutput(
            req.request_id, prompt, req.prompt_token_ids, [completion], True, max(req.num_cached_tokens, 0), metrics
        )


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
