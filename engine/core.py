"""The engine loop: `add_request`, `step` (schedule, run the model, update) and `abort`."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import RequestError
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import StepOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_output import GrammarCompiler, new_matcher
from engine.tp_worker import WorkerGroup


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        # Workers first: starting them sets this process's TP rank, which layers read as they shard.
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        self.model_runner = ModelRunner(config, broadcast=self.workers.send_step if self.workers else None)
        self.kv = KVCacheManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = _eos_ids(config)
        self._grammar_compiler: GrammarCompiler | None = None

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        grammar=None,
    ) -> Request:
        """Queue a request; raises RequestError (and queues nothing) when it cannot be served.
        `grammar` is the compiled form of `params.structured_outputs` (see `compile_grammar`);
        when omitted it is compiled here, in the caller's thread."""
        self._validate(request_id, prompt_token_ids, params)
        if params.n != 1:
            raise RequestError("EngineCore takes one sample per request; fan out with params.for_sample(i)", "n")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params)
        req = Request(
            request_id, prompt_token_ids, params,
            block_size=self.config.block_size, max_model_len=self.config.max_model_len,
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
            hash_blocks=self.config.enable_prefix_caching, arrival_time=arrival_time,
        )
        if grammar is not None:
            req.matcher = new_matcher(grammar)
        self.scheduler.add(req)
        return req

    def compile_grammar(self, params: SamplingParams):
        """Compile `params.structured_outputs` (slow for big schemas: call it off the step loop)."""
        if self._grammar_compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model_path)
            self._grammar_compiler = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestError("the prompt is empty; give at least one token", "prompt")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}", "prompt")
        max_len = self.config.max_model_len
        check_context_length(len(prompt), params.max_tokens, max_len)
        total = len(prompt) + (params.max_tokens or max_len - len(prompt))
        blocks = -(-total // self.config.block_size)
        if blocks > self.model_runner.num_blocks:
            raise RequestError(
                f"this request needs {blocks} KV-cache blocks but the pool has only "
                f"{self.model_runner.num_blocks}; raise kv_cache_memory or lower max_tokens", "max_tokens",
            )

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        outs = []
        for rid in request_ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                outs.append(_step_output(req, []))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        result = self.model_runner.execute(out)
        self.scheduler.update(out, result.token_ids)
        outputs = []
        for sched, token, logprobs in zip(out.scheduled, result.token_ids, result.logprobs):
            if token is None:
                continue
            step = _step_output(sched.request, [token])
            step.logprobs = None if logprobs is None else [logprobs]
            if sched.request.params.prompt_logprobs is not None and sched.request.num_output_tokens == 1:
                step.prompt_logprobs = [None, *sched.request.prompt_logprobs]
            outputs.append(step)
        return outputs

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (they also die with this process)."""
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


def _step_output(req: Request, new_tokens: list[int]) -> StepOutput:
    return StepOutput(
        request_id=req.request_id,
        new_token_ids=new_tokens,
        finish_reason=req.status.value if req.status.finished else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_output_tokens=req.num_output_tokens,
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
