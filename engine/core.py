"""The engine loop: `add_request`, `step` (schedule, run the model, update) and `abort`."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import StepOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_runner = ModelRunner(config)
        self.kv = KVCacheManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = _eos_ids(config)

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; raises ValueError (and queues nothing) when it cannot be served."""
        self._validate(request_id, prompt_token_ids, params)
        req = Request(
            request_id, prompt_token_ids, params,
            block_size=self.config.block_size, max_model_len=self.config.max_model_len,
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
            hash_blocks=self.config.enable_prefix_caching, arrival_time=arrival_time,
        )
        self.scheduler.add(req)
        return req

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        max_len = self.config.max_model_len
        if len(prompt) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but the context length is {max_len}: "
                "it must leave room for at least one new token; shorten the prompt"
            )
        if params.max_tokens is not None and len(prompt) + params.max_tokens > max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {max_len} tokens; lower max_tokens or shorten the prompt"
            )
        total = len(prompt) + (params.max_tokens or max_len - len(prompt))
        blocks = -(-total // self.config.block_size)
        if blocks > self.model_runner.num_blocks:
            raise ValueError(
                f"this request needs {blocks} KV-cache blocks but the pool has only "
                f"{self.model_runner.num_blocks}; raise kv_cache_memory or lower max_tokens"
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
        sampled = self.model_runner.execute(out)
        changed = self.scheduler.update(out, sampled)
        return [_step_output(req, req.all_token_ids[-1:]) for req in changed]

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
