"""Offline batch API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from portcullis.engine.config import EngineConfig
from portcullis.engine.core.engine_core import EngineCore
from portcullis.engine.core.structured_output import GrammarCompiler
from portcullis.engine.frontend.output_processor import OutputProcessor, SampleOutput, fan_out
from portcullis.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from portcullis.engine.pooling import PoolingParams
from portcullis.engine.sampling_params import SamplingParams, generation_config_defaults

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str, skip_tokenizer_init: bool = False, generation_config: str = "auto", **kwargs):
        """`kwargs` are `EngineConfig` fields (dtype, block_size, max_model_len, ...). With
        `skip_tokenizer_init`, prompts must be token ids and outputs carry no text, as in vLLM.
        `generation_config` ("auto": the model's generation_config.json, "vllm": none, or a
        folder) sets what `generate` samples with when given no SamplingParams, as in vLLM."""
        self.config = EngineConfig(model=model, **kwargs)
        self._defaults = generation_config_defaults(generation_config, self.config.model_path)
        try:
            self.get_default_sampling_params()
        except ValueError as exc:
            raise ValueError(f"generation config {generation_config!r} of {model}: {exc}") from exc
        self.engine = EngineCore(self.config)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.engine.info.tokenizer)
        self._grammar_compiler: GrammarCompiler | None = None
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (max_new_tokens as max_tokens)."""
        fields = dict(self._defaults)
        if "max_new_tokens" in fields:
            fields["max_tokens"] = fields.pop("max_new_tokens")
        return SamplingParams(**fields)

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
        defaulted = sampling_params is None
        params = _as_params_list(self.get_default_sampling_params() if defaulted else sampling_params, len(prompts))
        # Tokenise, validate and compile grammars before queueing anything: a bad prompt fails
        # the call without leaving half a batch behind in the engine.
        encoded = [self._encode(p) for p in prompts]
        if defaulted:  # the model's max_new_tokens is a default, not a demand: cut to the room left
            params = [self._within_context(sp, len(ids)) for sp, (_, ids) in zip(params, encoded)]
        grammars = {id(sp): self.compile_grammar(sp) for sp in params if sp.structured_outputs is not None}
        groups: list[_Group] = []
        try:
            for (text, ids), sp in zip(encoded, params):
                groups.append(self._add(text, ids, sp, grammars.get(id(sp))))
        except ValueError:
            self.engine.abort([rid for g in groups for rid in g.request_ids])
            raise
        self._run(OutputProcessor([s for g in groups for s in g.samples]), use_tqdm)
        return [g.output() for g in groups]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """`generate` on conversations (one, or a list of them) rendered by the model's own chat
        template with the assistant's turn opened, as vLLM's `LLM.chat`."""
        if self.tokenizer is None:
            raise ValueError("chat needs the tokenizer: build the LLM without skip_tokenizer_init")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order, from an LLM built with `runner="pooling"`
        (or a checkpoint without an LM head), as vLLM's `LLM.embed`."""
        params = pooling_params or PoolingParams()
        encoded = [self._encode(p) for p in _as_prompt_list(prompts)]
        ids = [f"embed-{next(self._ids)}" for _ in encoded]
        try:
            for rid, (_, tokens) in zip(ids, encoded):
                self.engine.add_request(rid, tokens, params)
        except ValueError:
            self.engine.abort(ids)
            raise
        vectors: dict[str, list[float]] = {}
        bar = _progress(use_tqdm, len(ids))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.pooled is not None:
                    vectors[out.request_id] = out.pooled.tolist()
                    bar.update(1)
        bar.close()
        return [EmbeddingRequestOutput(rid, tokens, EmbeddingOutput(vectors[rid])) for rid, (_, tokens) in zip(ids, encoded)]

    def compile_grammar(self, params: SamplingParams):
        """`params.structured_outputs` compiled for this model (slow for big schemas)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the tokenizer: create the LLM without skip_tokenizer_init")
            info = self.engine.info
            self._grammar_compiler = GrammarCompiler(self.tokenizer, info.vocab_size, info.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    def _within_context(self, sp: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.config.max_model_len - prompt_len
        if sp.max_tokens is None or sp.max_tokens <= room or room < 1:
            return sp  # (no room at all: the engine's check says so)
        return dataclasses.replace(sp, max_tokens=room)

    def _add(self, text: str | None, ids: list[int], sp: SamplingParams, grammar) -> _Group:
        group = _Group(f"offline-{next(self._ids)}", text, ids)
        for index, (rid, params) in enumerate(fan_out(group.request_id, sp)):
            self.engine.add_request(rid, ids, params, grammar=grammar)
            group.samples.append(SampleOutput(index, rid, params, self.tokenizer, incremental=False, prompt_token_ids=ids))
        return group

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

    def _run(self, outputs: OutputProcessor, use_tqdm: bool) -> None:
        bar = _progress(use_tqdm, outputs.num_unfinished)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                delta, abort = outputs.process(out)
                if abort:
                    for last in self.engine.abort([out.request_id]):
                        outputs.process(last)
                if delta is not None and delta.finish_reason is not None:
                    bar.update(1)
        bar.close()


def _progress(use_tqdm: bool, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)


@dataclass
class _Group:
    """One prompt's samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleOutput] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.samples]

    def output(self) -> RequestOutput:
        first = self.samples[0]
        completions = [
            CompletionOutput(s.index, s.text, s.token_ids, s.finish_reason,
                             sum(lp.logprob for lp in s.logprobs) if s.params.logprobs is not None else None,
                             s.logprobs if s.params.logprobs is not None else None)
            for s in self.samples
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, True,
                             first.cached_tokens, first.metrics, first.prompt_logprobs)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
