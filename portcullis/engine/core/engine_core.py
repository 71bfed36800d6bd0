"""The engine loop: `add_request`, `step` (schedule, run the model, apply the result) and `abort`.

Front-ends (`LLM`, the server's `AsyncEngine`) hand it token ids, parameters and, for structured
output, a grammar they compiled; they get request ids and `StepOutput`s back, and read what they
need of the engine from `info`. Only the scheduler holds `Request` objects.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

from portcullis.engine.config import EngineConfig
from portcullis.engine.core.kv_cache import KVCacheManager
from portcullis.engine.core.output import SchedulerOutput
from portcullis.engine.core.scheduler import Scheduler
from portcullis.engine.core.structured_output import StructuredOutputManager
from portcullis.engine.errors import RequestError
from portcullis.engine.outputs import StepOutput
from portcullis.engine.pooling import PoolingConfig, PoolingParams
from portcullis.engine.sampling_params import SamplingParams
from portcullis.engine.worker.model_runner import ModelRunner, SubmittedStep
from portcullis.engine.worker.tp_worker import WorkerGroup


@dataclass(frozen=True)
class EngineInfo:
    """What a front-end may know of the engine it drives; fixed once the engine is built."""

    model_path: str
    tokenizer: str  # where the tokenizer lives (the model's directory unless configured)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    hidden_size: int
    pooling: PoolingConfig | None  # set when the engine computes embeddings (runner "pooling"), not text


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        # Workers first: starting them sets this process's TP rank, which layers read as they shard.
        self.workers = WorkerGroup(config) if config.world_size > 1 else None
        self.model_runner = ModelRunner(config, broadcast=self.workers.send_step if self.workers else None)
        vocab_size = config.hf_config.vocab_size
        self.info = EngineInfo(
            str(config.model_path), str(config.tokenizer or config.model_path), vocab_size, _eos_ids(config),
            config.max_model_len, config.max_num_seqs, config.block_size, self.model_runner.num_blocks,
            config.hf_config.hidden_size, config.pooling,
        )
        self.kv = KVCacheManager(self.info.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 self.model_runner.kv_sliding_windows)
        self.structured_output = StructuredOutputManager(vocab_size)
        self.scheduler = Scheduler(config.scheduler_config, self.kv, self.structured_output)
        # Steps submitted and not yet collected, oldest first (pipeline stages only).
        self.batch_queue: deque[tuple[SchedulerOutput, SubmittedStep]] | None = (
            deque() if config.pipeline_parallel_size > 1 else None)
        if self.workers is not None:
            self.workers.start_heartbeat()

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        grammar=None,
        priority: int = 0,
        prediction: list[int] | None = None,
    ) -> str:
        """Queue a request; raises RequestError (and queues nothing) when it cannot be served.
        `grammar` is `params.structured_outputs` compiled by the front-end (`GrammarCompiler`):
        compiling is slow, and never happens in the step loop. With PoolingParams (an engine
        whose runner is "pooling") the request ends in an embedding (`StepOutput.pooled`).
        `priority` orders the waiting queue under the "priority" policy (lower first). `prediction`
        (token ids of the expected output, OpenAI's Predicted Outputs) is verified as proposals."""
        self._check_runner(params)
        self._validate(request_id, prompt_token_ids, params)
        if prediction is not None:
            self._check_prediction(prediction)
        if priority and self.config.scheduling_policy != "priority":
            raise RequestError("priority needs an engine started with --scheduling-policy priority; send 0", "priority")
        if isinstance(params, PoolingParams):
            self.scheduler.add(request_id, prompt_token_ids, params, cache_salt=cache_salt, arrival_time=arrival_time,
                               priority=priority)
            return request_id
        if params.n != 1:
            raise RequestError("EngineCore takes one sample per request; fan out with params.for_sample(i)", "n")
        if (params.structured_outputs is None) != (grammar is None):
            raise ValueError("give a compiled grammar exactly when params.structured_outputs is set")
        if grammar is not None:
            self.structured_output.add(request_id, grammar)
        self.scheduler.add(request_id, prompt_token_ids, params, eos_token_ids=self.info.eos_token_ids,
                           cache_salt=cache_salt, arrival_time=arrival_time, structured=grammar is not None,
                           priority=priority, prediction=prediction)
        return request_id

    def _check_runner(self, params: SamplingParams | PoolingParams) -> None:
        pooling = self.info.pooling
        if pooling is None and isinstance(params, PoolingParams):
            raise RequestError("this engine generates text; embeddings need an engine started with --runner pooling",
                               "input")
        if pooling is not None and not isinstance(params, PoolingParams):
            raise RequestError("this engine computes embeddings (--runner pooling); it does not generate text",
                               "model")
        if pooling is not None:
            params.check(pooling, self.info.hidden_size)

    def _check_prediction(self, prediction: list[int]) -> None:
        vocab = self.info.vocab_size
        if len(prediction) > self.info.max_model_len:
            raise RequestError(f"the prediction has {len(prediction)} tokens; at most the context length "
                               f"({self.info.max_model_len}) is useful", "prediction")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prediction):
            raise RequestError(f"prediction token ids must be integers in [0, {vocab})", "prediction")

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams | PoolingParams) -> None:
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestError("the prompt is empty; give at least one token", "prompt")
        vocab = self.info.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        max_len = self.config.max_model_len
        if isinstance(params, PoolingParams):
            check_input_length(len(prompt), max_len)
            total = len(prompt)
        else:
            check_context_length(len(prompt), params.max_tokens, max_len)
            total = len(prompt) + (params.max_tokens or max_len - len(prompt))
        blocks = self.kv.max_blocks_of(total, self.config.max_num_batched_tokens)
        if blocks > self.info.num_kv_blocks:
            raise RequestError(
                f"this request needs {blocks} KV-cache blocks but the pool has only "
                f"{self.info.num_kv_blocks}; raise kv_cache_memory or lower max_tokens", "max_tokens",
            )

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        """Stop requests now (finished ones are skipped); their last outputs."""
        return [out for rid in request_ids if (out := self.scheduler.abort(rid)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batch_queue)

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run, apply. With pipeline stages, vLLM's batch queue: while fewer steps than
        stages are in flight and some request is not in one, submit another and return; else
        finish the oldest. So every stage has a step to work on."""
        if self.batch_queue is None:
            out = self.scheduler.schedule()
            if not out.num_scheduled:
                return []
            with self._sending():
                result = self.model_runner.execute(out, self._grammar(out))
            return self.scheduler.update(out, result)
        if len(self.batch_queue) < self.config.pipeline_parallel_size:
            out = self.scheduler.schedule()
            if out.num_scheduled:
                with self._sending():
                    submitted = self.model_runner.submit(out, self._grammar(out))
                self.batch_queue.append((out, submitted))
                if len(self.batch_queue) < self.config.pipeline_parallel_size:
                    return []
        if not self.batch_queue:
            return []
        out, submitted = self.batch_queue.popleft()
        return self.scheduler.update(out, self.model_runner.collect(submitted))

    def _sending(self):
        """Held while a step goes out to the other ranks (their heartbeat waits for it)."""
        return contextlib.nullcontext() if self.workers is None else self.workers.lock

    def _grammar(self, out):
        return self.structured_output.bitmask(out.grammar_ids, out.grammar_proposals)

    def shutdown(self) -> None:
        """Finish the steps in flight, then stop the parallel workers, if any (they also die with
        this process)."""
        try:
            while self.batch_queue:
                out, submitted = self.batch_queue.popleft()
                self.scheduler.update(out, self.model_runner.collect(submitted))
        except RuntimeError:  # the group is broken (a rank died or hung): nothing more will come
            self.batch_queue.clear()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None

    # -- introspection for metrics and tests -----------------------------------------------------
    @property
    def stats(self):
        return self.scheduler.stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage()


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """The one context-length check (the server relies on it too): the prompt must leave room
    for a new token, and prompt plus max_tokens must fit. Worded as OpenAI's, which clients
    such as LiteLLM recognise as a context-window error."""
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens, leaving no room to generate. Shorten the prompt.", "prompt",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion), which exceeds the context length. Lower max_tokens or shorten the prompt.", "max_tokens",
        )


def check_input_length(prompt_len: int, max_model_len: int) -> None:
    """An embedding's input may fill the context: nothing is generated after it."""
    if prompt_len > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the input has {prompt_len} "
            "tokens. Shorten the input.", "input",
        )


def _eos_ids(config: EngineConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    import json

    ids = None
    gen = config.model_path / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(config.hf_config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (ids,)
