"""Results shaped like vLLM's `RequestOutput`, so code written for vLLM ports unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    cumulative_logprob: float | None = None
    logprobs: list | None = None  # one TokenLogprobs per output token, when asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None  # None for the first prompt token, then TokenLogprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass
class StepOutput:
    """What one engine step produced for one request: at most one new token."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list | None = None  # TokenLogprobs of the new tokens, when asked for
    prompt_logprobs: list | None = None  # with a request's first output, when asked for
    metrics: RequestMetrics | None = None  # with its first output token and its last output
    pooled: object = None  # an embedding request's vector (a float32 tensor), with its last output
    num_accepted_prediction_tokens: int | None = None  # with a prediction: its tokens accepted so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelRunnerOutput:
    """What the runner produced in one step, for the scheduler to apply: entry i of `token_ids`
    and `logprobs` belongs to the i-th scheduled request. Its new tokens: none for a prefill
    chunk that has not reached the end of its prompt, one for a decode, and with speculative
    decoding the accepted proposals followed by the model's own next token."""

    token_ids: list[list[int]]
    logprobs: list  # per request: its new tokens' TokenLogprobs, or None when not asked for
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # request id -> newly scored positions
    pooled: dict[str, object] = field(default_factory=dict)  # request id -> embedding (a pooling request's end)
