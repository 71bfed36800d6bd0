"""Request bodies of the OpenAI-compatible routes, as pydantic models.

Unknown fields are accepted and ignored with a warning (as vLLM does): SDKs and tools add new
OpenAI fields faster than servers learn them, and refusing them would break clients for
fields that do not change the output. Known fields this engine cannot honour yet are refused
with a 400 that names the field, unless they carry their default value (SDKs send defaults).
Wrong types are a 400 (see `errors`). A body nested deeper than `portcullis.protocol.json_body.MAX_JSON_DEPTH`, or
template arguments outside `portcullis.protocol.caps.CHAT_TEMPLATE_KWARGS`, are refused here, before any work.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import structlog
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from portcullis.engine.server import limits
from portcullis.engine.server.errors import TOO_DEEP, APIError, bad_request
from portcullis.protocol.json_body import json_depth_exceeds
from portcullis.protocol.requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_TOKEN_FIELDS,
    asked_max_tokens,
)

log = structlog.get_logger("portcullis.engine.server")

TokenIds = list[int]


class OpenAIModel(BaseModel):
    # JSON parsing lets `Infinity` and `NaN` through; no sampling value means anything with them.
    # Strict: each field takes its own JSON type only (an integer may stand for a number), as
    # the gateway checks them: a lax `"stream": 1` read as true here once streamed past the
    # gateway's token accounting, which had read it as false.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # OpenAI's fields are nullable and many clients send `"n": null` for "not set"; so a
        # null takes the field's default, rather than failing a non-optional type.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class RequestBody(OpenAIModel):
    """A whole request body: its nesting is checked before any field is looked at."""

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        if json_depth_exceeds(data):
            raise PydanticCustomError("json_too_deep", TOO_DEEP)
        return data


def _allowed_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    problem = limits.template_kwargs_problem(kwargs or {})
    if problem is not None:
        raise PydanticCustomError("template_kwarg", problem)
    return kwargs


def _no_client_template(_: Any) -> None:
    # A template is code: the client's would run in the server's one tokenizer thread.
    raise PydanticCustomError("client_template", "not accepted: every conversation is rendered with the "
                              "model's own chat template; remove this field")


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_allowed_template_kwargs)]
ClientTemplate = Annotated[Any, AfterValidator(_no_client_template)]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's; load tools such as GuideLLM send it


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    cache_salt: str | None = None
    priority: int = 0
    prediction: dict[str, Any] | None = None  # OpenAI's Predicted Outputs: {"type": "content", "content": ...}
    # Accepted so they can be refused by name until the sampler implements them.
    best_of: int | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def max_new_tokens(self) -> int | None:
        # None: up to the context length, as OpenAI and vLLM do for chat.
        return asked_max_tokens({n: getattr(self, n) for n in MAX_TOKEN_FIELDS})

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None  # fill-in-the-middle (`fim`); "" is no suffix, as in Ollama

    @property
    def num_prompts(self) -> int:
        """How many prompts `prompt` holds: a string or a list of token ids is one."""
        p = self.prompt
        return 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else max(len(p), 1)

    @property
    def max_new_tokens(self) -> int | None:
        asked = super().max_new_tokens
        return COMPLETIONS_DEFAULT_MAX_TOKENS if asked is None else asked


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: ClientTemplate = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: ClientTemplate = None
    tools: list[dict[str, Any]] | None = None  # rendered as the chat route renders them
    suffix: str | None = None  # with `prompt`: the fill-in-the-middle prompt /v1/completions would run
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: TokenIds


def _unset(v: Any) -> bool:
    return not v


# Features this server does not offer at all yet.
_NOT_YET: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _unset,
    "functions": _unset,
    "function_call": lambda v: v in (None, "none", "auto"),
}


def warn_unknown_fields(req: OpenAIModel, request_id: str) -> None:
    """Unknown top-level fields are ignored; say so, so a client can find out why one had no effect."""
    if req.model_extra:
        log.warning("ignoring unknown request fields", request_id=request_id, fields=sorted(req.model_extra))


def _not_supported(name: str) -> APIError:
    return bad_request(f"'{name}' is not supported by this server yet; remove it or use its default", name)


def refuse_unsupported(req: SamplingRequest) -> None:
    """400 naming the first field that asks for a feature the engine does not have yet."""
    fields = type(req).model_fields
    for name, is_default in _NOT_YET.items():
        if name in fields and not is_default(getattr(req, name)):
            raise _not_supported(name)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("'best_of' other than n is not supported by this server yet", "best_of")
