"""From an OpenAI request to the engine's `SamplingParams`: server defaults, the sampler's
extra fields, logprobs and structured output, each refused with a 400 that names the field
when it is wrong. The result is a `RequestPlan`, made once per request."""
from __future__ import annotations

import dataclasses
from typing import Any

from portcullis.engine.core.engine_core import check_context_length
from portcullis.engine.errors import RequestError
from portcullis.engine.sampling_params import SamplingParams, StructuredOutputsParams
from portcullis.engine.server import limits
from portcullis.engine.server.errors import bad_request
from portcullis.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from portcullis.engine.server.state import ServerState
from portcullis.protocol.caps import MAX_LOGPROBS, MAX_N

# Logits are divided by temperature and by repetition_penalty. Past this, sampling is uniform
# anyway; far past it (1e39, or its inverse) a divisor becomes infinite or zero in the sampler's
# float32, and the NaN it makes leaves nothing to draw.
MAX_SCALE = 1e4
_PASSTHROUGH = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "allowed_token_ids")


def check_request(req: SamplingRequest, max_num_seqs: int) -> None:
    """Checks that need no tokenizer; run before any work is done."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    limits.check_sizes(req)
    limits.check_fan_out(req.n, req.num_prompts, max_num_seqs)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.temperature is not None and req.temperature > MAX_SCALE:
        raise bad_request(f"temperature must be at most {MAX_SCALE:g}, got {req.temperature:g}", "temperature")
    if req.repetition_penalty is not None and not 1 / MAX_SCALE <= req.repetition_penalty <= MAX_SCALE:
        raise bad_request(f"repetition_penalty must be between {1 / MAX_SCALE:g} and {MAX_SCALE:g}, "
                          f"got {req.repetition_penalty:g}", "repetition_penalty")
    if any(not s for s in req.stop_strings):
        raise bad_request("stop strings must be non-empty", "stop")
    _check_logprobs(req)


def _check_logprobs(req: SamplingRequest) -> None:
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if isinstance(req, CompletionRequest) and req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """What one OpenAI request asks of the engine, worked out once (in the tokenizer thread:
    bad_words are tokenized on the way) and shared by all its choices."""

    prompt_params: tuple[SamplingParams, ...]  # one per prompt (with its n); same budget, same object
    constraint_field: str | None  # the request field its structured output came from, if any


def plan_request(req: SamplingRequest, state: ServerState, prompt_lens: list[int]) -> RequestPlan:
    """The engine's SamplingParams for each prompt, request values over the server's defaults.
    Raises RequestError when a prompt and its max_tokens cannot fit the context."""
    base = _request_kwargs(req, state)
    by_max_tokens: dict[int | None, SamplingParams] = {}
    out = []
    for prompt_len in prompt_lens:
        max_tokens = _max_tokens(req, state, prompt_len)
        check_context_length(prompt_len, max_tokens, state.max_model_len)
        if max_tokens not in by_max_tokens:
            by_max_tokens[max_tokens] = _build(base, max_tokens, state)
        out.append(by_max_tokens[max_tokens])
    constrained = base.get("structured_outputs") is not None
    return RequestPlan(tuple(out), constraint_field(req) if constrained else None)


def _max_tokens(req: SamplingRequest, state: ServerState, prompt_len: int) -> int | None:
    """The request's max_tokens, else the server's default cut to the room the prompt leaves.
    Whether it fits is the engine's context-length check (`check_context_length`)."""
    d = state.settings.generation
    room = state.max_model_len - prompt_len
    if req.max_new_tokens is None and d.max_new_tokens is not None and room > 0:
        return min(d.max_new_tokens, room)
    return req.max_new_tokens


def _request_kwargs(req: SamplingRequest, state: ServerState) -> dict[str, Any]:
    d = state.settings.generation
    kwargs: dict[str, Any] = dict(
        n=req.n,
        stop=req.stop_strings,
        include_stop_str_in_output=req.include_stop_str_in_output,
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_p=d.top_p if req.top_p is None else req.top_p,
        top_k=d.top_k if req.top_k is None else req.top_k,
        min_p=d.min_p if req.min_p is None else req.min_p,
        repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
        seed=None if req.seed is None else req.seed % 2**64,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
    )
    kwargs.update(_extras(req, state.tokenizer))
    return kwargs


def _build(kwargs: dict[str, Any], max_tokens: int | None, state: ServerState) -> SamplingParams:
    params = SamplingParams(**kwargs, max_tokens=max_tokens)
    check_token_ids(params, state.engine.info.vocab_size, state.engine.info.eos_token_ids)
    return params


def check_token_ids(params: SamplingParams, vocab_size: int, eos_token_ids) -> None:
    """Every choice must keep at least one token it may sample at every step: the sampler has
    no distribution to draw from in a row where all are banned."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise bad_request(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}", name)
    if params.allowed_token_ids is not None:
        banned = set(params.bad_token_ids or [])
        if params.min_tokens:  # until then the stop tokens are banned too
            banned |= {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
        if set(params.allowed_token_ids) <= banned:
            raise bad_request("allowed_token_ids leaves no token to sample once bad_words (and, before min_tokens, "
                              "the stop tokens) are taken out; allow more tokens", "allowed_token_ids")
    if params.structured_outputs is not None:
        # A grammar may allow only tokens that these ban (once it is complete, only the end).
        for name, used in (("min_tokens", params.min_tokens), ("allowed_token_ids", params.allowed_token_ids),
                           ("bad_words", params.bad_token_ids)):
            if used:
                raise bad_request(f"{name} cannot be combined with structured output (response_format, tools or "
                                  "structured_outputs) yet; drop one of them", name)


def _extras(req: SamplingRequest, tokenizer) -> dict[str, Any]:
    """The sampler's optional fields that the request sets."""
    out: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    if req.logit_bias:
        try:
            out["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from exc
    if req.bad_words:
        out["bad_token_ids"] = _bad_token_ids(req.bad_words, tokenizer)
    out.update(_logprobs(req))
    spec = structured_outputs(req)
    if spec is not None:
        out["structured_outputs"] = spec
    return out


def _bad_token_ids(words: list[str], tokenizer) -> list[int]:
    """vLLM's `bad_words` for words that are one token (with or without a leading space); the
    engine cannot ban a sequence of tokens yet."""
    ids = []
    for word in words:
        forms = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word.lstrip())]
        single = [f[0] for f in forms if len(f) == 1]
        if not single:
            raise bad_request(f"bad_words: {word!r} is several tokens; only single-token words can be banned yet",
                              "bad_words")
        ids += single
    return ids


def _logprobs(req: SamplingRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            out["logprobs"] = req.top_logprobs or 0
    elif isinstance(req, CompletionRequest) and req.logprobs is not None:
        out["logprobs"] = req.logprobs
        if req.echo:  # echo with logprobs reports the prompt's too (how lm-eval scores text)
            out["prompt_logprobs"] = req.logprobs
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = max(req.prompt_logprobs, out.get("prompt_logprobs", 0))
    return out


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, from OpenAI's `response_format` or vLLM's
    `structured_outputs` / `guided_*` fields."""
    given: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf and rf.get("type") != "text":
        given.append(("response_format", _from_response_format(rf)))
    if req.structured_outputs:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            given.append((field, {key: getattr(req, field)}))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {', '.join(f for f, _ in given)}", given[1][0])
    field, spec = given[0]
    try:
        params = StructuredOutputsParams(**spec)
    except (TypeError, RequestError) as exc:  # unknown keys, or not one constraint
        raise bad_request(f"{field}: {exc}", field) from exc
    limits.check_choices(params.choice, field)
    return params


MAX_PREDICTION_CHARS = 200_000


def prediction_ids(req: SamplingRequest, tokenizer) -> list[int] | None:
    """The token ids of OpenAI's `prediction` ({"type": "content", "content": text or text
    parts}), or None. Blocking (it tokenizes): called in the tokenizer thread."""
    p = req.prediction
    if p is None:
        return None
    content = p.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        content = "".join(part["text"] for part in content)
    if p.get("type") != "content" or not isinstance(content, str):
        raise bad_request("prediction must be {'type': 'content', 'content': <text or text parts>}", "prediction")
    if len(content) > MAX_PREDICTION_CHARS:
        raise bad_request(f"prediction has {len(content)} characters; at most {MAX_PREDICTION_CHARS} are accepted",
                          "prediction")
    return tokenizer.encode(content, add_special_tokens=False) if content else None


def constraint_field(req: SamplingRequest) -> str:
    """The request field an output constraint came from (a forced tool call is one too)."""
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice not in (None, "none", "auto"):
        return "tools"
    if req.response_format and req.response_format.get("type") != "text":
        return "response_format"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def _from_response_format(rf: dict) -> dict:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema must be a JSON Schema object", "response_format")
        return {"json": schema}
    raise bad_request(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                      "response_format")
