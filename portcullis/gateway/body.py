"""Request-body checks and rewrites: size, JSON, model, types, caps, prompt, cache salt, usage,
priority; for OpenAI's routes (its Responses API, `/v1/responses`, included) and for Anthropic's
Messages API (`/v1/messages`): the engine serves both of these through its chat route.

The body the engine receives is the client's JSON with exactly these changes: `max_tokens`
(`max_output_tokens` on the Responses API) capped (or filled in), `cache_salt` set to the tenant's, `stream_options.include_usage`
turned on so token limits can be charged from the engine's exact count, and `priority` raised
to the policy's (a larger number runs later). Every field the gateway
reads, or the engine would coerce, must have its exact JSON type: the gateway and the engine
must never read one request two ways (`"stream": 1` is a stream to the engine's pydantic).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from portcullis.gateway.access import Access
from portcullis.gateway.connection import REFUSED_KEY
from portcullis.gateway.errors import Refusal
from portcullis.gateway.responses_input import as_chat_messages, as_chat_tools
from portcullis.protocol import caps
from portcullis.protocol.json_body import (
    MAX_JSON_DEPTH,
    json_depth_exceeds,
    too_deep_message,
    too_many_containers,
    too_many_message,
)
from portcullis.protocol.requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_TOKEN_FIELDS,
    asked_max_tokens,
    messages_chars,
    text_chars,
)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
TOKENIZE_PATH = "/tokenize"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MESSAGES_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API
# Chat templates add role markers and special tokens around the text the client sent.
TEMPLATE_ALLOWANCE_TOKENS = 64
# A chat reply without max_tokens (none asked, no policy cap) may fill the model's context, and
# reserves that (`bound_open_ended`). Where the gateway cannot learn the context length (an engine
# whose /v1/models has no max_model_len, or that did not answer), it sends this as max_tokens, so
# what is reserved is what may be generated.
UNKNOWN_CONTEXT_MAX_TOKENS = 256

BOOL_FIELDS = ("stream", "echo", "ignore_eos", "add_generation_prompt", "continue_final_message",
               "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
               "use_beam_search")
INT_FIELDS = ("n", "best_of", "max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs",
              "prompt_logprobs", "truncate_prompt_tokens", "top_k", "priority", "seed", "dimensions")
OBJECT_FIELDS = ("stream_options", "chat_template_kwargs", "logit_bias", "response_format")
STRING_FIELDS = ("suffix",)
STREAM_OPTION_BOOLS = ("include_usage", "continuous_usage_stats")
# Lists the engine scans per request or per token: (most items, item type, longest string), with
# the engine's own caps (`portcullis.protocol.caps`), so the gateway refuses exactly what the
# engine would, before forwarding it.
LIST_ITEM_TYPES: dict[str, type] = {
    "stop": str, "bad_words": str, "guided_choice": str, "stop_token_ids": int, "allowed_token_ids": int,
    "logit_bias": object, "tools": dict, "messages": dict,
}
LIST_CAPS: dict[str, tuple[int, type, int | None]] = {
    name: (most, LIST_ITEM_TYPES[name], longest) for name, (most, longest) in caps.LIST_CAPS.items()
}


@dataclass(frozen=True)
class PromptAudit:
    """What an audit line says about a prompt: its fingerprint (`prompt_hmac`, an HMAC-SHA256
    under the audit keyring's fingerprint key: equal prompts match, guesses cannot be tested
    without the key), and the text itself only when the policy logs prompts."""

    fingerprint: Callable[[bytes], str]
    log_prompts: bool = False


@dataclass
class PreparedBody:
    payload: dict[str, Any]
    model: str | None
    stream: bool
    strip_usage_chunk: bool
    prompt_bytes: int  # the prompt and everything else the template renders (tools, a FIM suffix)
    prompt_fields: dict[str, Any]
    sequences: int = 1  # n x prompts (or embedding inputs): what the engine runs at once for this request
    reserve_tokens: int = 0  # the most this request can cost: held against tokens_per_minute
    counts_always: bool = False  # the template renders more than the prompt (tools, kwargs)
    open_ended: bool = False  # chat without max_tokens: `bound_open_ended` reserves its worst case
    priority: int | None = None  # what the engine is sent, when the client or the policy set one
    longest_input_bytes: int | None = None  # embeddings: each input is measured against the cap alone
    prompt_capped: bool = True  # held to max_prompt_tokens (not a count_tokens request: see there)
    max_tokens_field: str = "max_tokens"  # the reply-length field `bound_open_ended` fills in

    @property
    def prompt_estimate(self) -> int:
        return self.prompt_bytes // 4  # about four bytes a token in English text and JSON

    def encode(self) -> bytes:
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False).encode()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it is known to exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        refused = request.scope.get(REFUSED_KEY)  # the connection cut off a body that came too slowly
        if refused is not None:
            raise Refusal(*refused) from None
        raise Refusal(499, "The client closed the request.", "client_disconnected") from None
    return b"".join(chunks)


def _too_large(limit: int) -> Refusal:
    return Refusal(413, f"Request body is larger than {limit} bytes.", "body_too_large")


def parse_json(raw: bytes) -> dict[str, Any]:
    if too_many_containers(raw):  # before the parse: it is the parse that costs
        raise Refusal(400, too_many_message(), "malformed_json")
    try:
        payload = json.loads(raw.decode("utf-8"))  # RFC 8259; json.loads(bytes) would take UTF-16 and -32 too
    except (ValueError, UnicodeDecodeError):
        raise Refusal(400, "The request body is not valid JSON.", "malformed_json") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(payload, dict):
        raise Refusal(400, "The request body must be a JSON object.", "malformed_json")
    # Counting brackets is C-fast; only a body with that many of them can be too deep.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth_exceeds(payload):
        raise _too_deep()
    return payload


def _too_deep() -> Refusal:
    return Refusal(400, too_deep_message(), "malformed_json")


def check_model(payload: dict[str, Any], access: Access, hide: bool) -> str | None:
    model = payload.get("model")
    if model is None:
        if access.any_model:  # only an unrestricted principal may leave it to the engine
            return None
        raise Refusal(400, "The 'model' field is required.", "model_required", param="model")
    if not isinstance(model, str):
        raise Refusal(400, "'model' must be a string.", "malformed_request", param="model")
    if access.allows_model(model):
        return model
    raise model_refusal(model, hide)


def model_refusal(model: str, hide: bool) -> Refusal:
    """What a principal hears of a model it may not use: 403, or, when the policy hides models,
    the 404 the engine gives for a model it does not have."""
    if hide:
        return Refusal(404, f"The model `{model[:100]}` does not exist.", "model_not_found", param="model")
    return Refusal(403, f"You are not allowed to use the model '{model[:100]}'.", "model_not_allowed", param="model")


def cap_max_tokens(payload: dict[str, Any], access: Access, over_cap: str) -> None:
    cap = access.max_tokens
    if cap is None or not _generates(payload):
        return
    asked = [(f, payload[f]) for f in MAX_TOKEN_FIELDS if payload.get(f) is not None]
    for field, value in asked:
        payload[field] = _capped(field, value, cap, access, over_cap)
    if not asked:  # an absent cap would let the engine run to the context length
        payload["max_tokens"] = cap


def _capped(field: str, value: Any, cap: int | None, access: Access, over_cap: str) -> int:
    """A reply length within the policy's max_tokens: refused over it, or lowered to it."""
    if not _is_int(value) or value < 1:
        raise Refusal(400, f"'{field}' must be a positive integer.", "malformed_request", param=field)
    if cap is None:
        return value
    if value > cap and over_cap == "reject":
        raise _over_cap(field, f"'{field}' is {value}; the limit here is {cap}.", access.cap_field("max_tokens"),
                        "max_tokens_over_cap")
    return min(value, cap)


def _generates(payload: dict[str, Any]) -> bool:
    return "prompt" in payload or "messages" in payload


def _prompt_of(payload: dict[str, Any], path: str) -> Any:
    if path == EMBEDDINGS_PATH:
        return payload.get("input")
    if path in MESSAGES_PATHS:
        return chat_messages(payload)
    if path == RESPONSES_PATH:
        return as_chat_messages(payload)
    return payload.get("messages", payload.get("prompt"))


def chat_messages(payload: dict[str, Any]) -> Any:
    """An Anthropic request's conversation as the engine renders it: its `system` first, as a
    system message, then its messages (fingerprinted, sized and routed as a chat prompt is)."""
    messages, system = payload.get("messages"), payload.get("system")
    if system is None or not isinstance(messages, list):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _fim_suffix(payload: dict[str, Any], path: str) -> str | None:
    """The fill-in-the-middle suffix the engine will use ("" is none, as the engine reads it)."""
    suffix = payload.get("suffix") if path == COMPLETIONS_PATH else None
    return suffix if isinstance(suffix, str) and suffix else None


def prompt_fields(payload: dict[str, Any], audit: PromptAudit, path: str = "") -> tuple[int, dict[str, Any]]:
    """(size of the prompt in bytes, what the audit line says about it). A FIM suffix is part
    of the prompt: counted in its size, and fingerprinted (or logged) beside it as `suffix`."""
    prompt = _prompt_of(payload, path)
    if prompt is None:
        return 0, {}
    size, fields = _audited("prompt", prompt, audit)
    suffix = _fim_suffix(payload, path)
    if suffix is not None:
        more, suffix_fields = _audited("suffix", suffix, audit)
        size, fields = size + more, {**fields, **suffix_fields}
    return size, fields


def prompt_text(value: Any) -> bytes:
    """The bytes a fingerprint covers: the text itself, or a structured prompt (chat messages,
    token ids) as JSON with sorted keys."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text.encode()


def _audited(name: str, value: Any, audit: PromptAudit) -> tuple[int, dict[str, Any]]:
    """(size in bytes, `<name>_hmac` and, when the policy logs prompts, the value itself)."""
    encoded = prompt_text(value)
    fields: dict[str, Any] = {f"{name}_hmac": audit.fingerprint(encoded)}
    if audit.log_prompts:
        fields[name] = value
    return len(encoded), fields


def needs_token_count(prepared: PreparedBody, cap: int | None) -> bool:
    """A token is at least one byte, so a short prompt is under the cap without tokenizing;
    but a template that renders tools or keyword arguments adds text of its own: count those."""
    if cap is None or not prepared.prompt_capped:
        return False
    size = prepared.prompt_bytes if prepared.longest_input_bytes is None else prepared.longest_input_bytes
    return prepared.counts_always or size + TEMPLATE_ALLOWANCE_TOKENS > cap


# What the engine's /tokenize reads to render a prompt exactly as the generation routes do.
TOKENIZE_FIELDS = ("model", "messages", "prompt", "add_generation_prompt", "continue_final_message",
                   "chat_template_kwargs")


@dataclass(frozen=True)
class PromptCount:
    """How to measure a request's longest prompt: `known` tokens for prompts given as token ids,
    and one /tokenize body for each prompt given as text (a batch is measured prompt by prompt:
    each prompt is its own sequence, and /tokenize takes one). With a FIM suffix each text body
    carries it, and the engine counts the whole FIM prompt as /v1/completions builds it; token-id
    prefixes add `known_suffix`'s count (the suffix and markers around an empty prefix)."""

    known: int
    bodies: tuple[bytes, ...]
    param: str  # the request field a refusal names
    known_suffix: bytes | None = None
    route: str = TOKENIZE_PATH  # the engine route that counts each body (see COUNT_FIELDS)


# Where each counting route's answer holds the count.
COUNT_FIELDS = {TOKENIZE_PATH: "count", COUNT_TOKENS_PATH: "input_tokens"}
# What the engine's /v1/messages/count_tokens reads: the prompt as /v1/messages renders it.
COUNT_TOKENS_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "chat_template_kwargs")


def prompt_count(payload: dict[str, Any], path: str = "", cap: int = 0) -> PromptCount:
    if path == EMBEDDINGS_PATH:
        return _inputs_count(payload, cap)
    if path == MESSAGES_PATH:  # counted by the engine exactly as the route will render it
        body = {k: payload[k] for k in COUNT_TOKENS_FIELDS if k in payload}
        return PromptCount(0, (json.dumps(body).encode(),), "messages", route=COUNT_TOKENS_PATH)
    if path == RESPONSES_PATH:
        return _response_count(payload)
    base = {k: payload[k] for k in TOKENIZE_FIELDS if k in payload and k != "prompt"}
    tools = _rendered_tools(payload)
    if tools:
        base["tools"] = tools  # /tokenize renders them into the template as the chat route does
    suffix = _fim_suffix(payload, path)
    if suffix is not None:
        base["suffix"] = suffix  # counted by the engine as the FIM prompt it will run
    counted = _prompts_count(payload, base)
    prompt = payload.get("prompt")
    ids = isinstance(prompt, list) and any(isinstance(p, (int, list)) for p in prompt)  # even [[]]
    if suffix is None or not ids:
        return counted
    empty_prefix = json.dumps({**base, "prompt": ""}).encode()
    return PromptCount(counted.known, counted.bodies, counted.param, empty_prefix)


def _prompts_count(payload: dict[str, Any], base: dict[str, Any]) -> PromptCount:
    prompt = payload.get("prompt")
    if "messages" in payload or isinstance(prompt, str):
        return PromptCount(0, (json.dumps({**base, "prompt": prompt} if isinstance(prompt, str) else base).encode(),),
                           "messages" if "messages" in payload else "prompt")
    prompts = prompt if isinstance(prompt, list) else []
    if all(isinstance(p, int) for p in prompts):
        return PromptCount(len(prompts), (), "prompt")
    texts = [json.dumps({**base, "prompt": p}).encode() for p in prompts if isinstance(p, str)]
    ids = [len(p) for p in prompts if isinstance(p, list)]
    return PromptCount(max(ids, default=0), tuple(texts), "prompt")


def _rendered_tools(payload: dict[str, Any]) -> list[Any] | None:
    """The tools the chat template sees: all of them, unless tool_choice is "none"."""
    tools = payload.get("tools")
    return tools if tools and payload.get("tool_choice") != "none" else None


def ask_for_usage(payload: dict[str, Any]) -> bool:
    """Turn on the final usage chunk; True when the client did not ask for it itself."""
    if payload.get("stream") is not True:
        return False
    options = payload.get("stream_options") or {}
    wanted = options.get("include_usage") is True
    payload["stream_options"] = {**options, "include_usage": True}
    return not wanted


def set_cache_salt(payload: dict[str, Any], salt: str | None) -> None:
    if salt is not None:
        payload["cache_salt"] = salt  # overwrites whatever the client sent


def set_priority(payload: dict[str, Any], floor: int | None) -> int | None:
    """The priority the engine is sent (lower runs first): the client's, but never below the
    policy's `floor`: a client may lower its own priority, not raise it past the policy's."""
    asked = payload.get("priority")
    if floor is None:
        return asked
    payload["priority"] = floor if asked is None else max(asked, floor)
    return payload["priority"]


# ---- types and caps -------------------------------------------------------------------------

def _malformed(field: str, wanted: str, value: Any) -> Refusal:
    shown = json.dumps(value)[:40]
    return Refusal(400, f"'{field}' must be {wanted} (got {shown}).", "malformed_request", param=field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _type_rules(chat: bool) -> tuple[tuple[str, str, Any], ...]:
    """(field, what it must be, its test), in the order refusals name them. `logprobs` is a
    flag in chat and a count in legacy completions."""
    bools = (*BOOL_FIELDS, "logprobs") if chat else BOOL_FIELDS
    ints = INT_FIELDS if chat else (*INT_FIELDS, "logprobs")
    return (*((name, "true or false", _is_bool) for name in bools),
            *((name, "an integer", _is_int) for name in ints),
            *((name, "a JSON object", _is_object) for name in OBJECT_FIELDS),
            *((name, "a string", _is_str) for name in STRING_FIELDS))


TYPE_RULES = {True: _type_rules(chat=True), False: _type_rules(chat=False)}  # built once, not per request


def check_types(payload: dict[str, Any], chat: bool) -> None:
    """Exact JSON types for the fields whose meaning the gateway or the engine depends on.
    A null is "not set" on both sides, so it passes."""
    for name, wanted, ok in TYPE_RULES[chat]:
        value = payload.get(name)
        if value is not None and not ok(value):
            raise _malformed(name, wanted, value)
    options = payload.get("stream_options") or {}
    for name in STREAM_OPTION_BOOLS:
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise _malformed(f"stream_options.{name}", "true or false", value)


def check_lists(payload: dict[str, Any]) -> None:
    """Refuse lists and strings the engine would scan per token (or per request) past its own
    caps: a few thousand stop characters or bad words stall every tenant's batch."""
    for name, (most, item_type, longest) in LIST_CAPS.items():
        value = payload.get(name)
        if value is None:
            continue
        items = [value] if name == "stop" and isinstance(value, str) else value
        if not isinstance(items, dict if name == "logit_bias" else list):
            raise _malformed(name, "an object" if name == "logit_bias" else "a list", value)
        if len(items) > most:
            raise _over_cap(name, f"'{name}' has {len(items)} entries; at most {most} are accepted.")
        if item_type is not object and not all(_of_type(item, item_type) for item in items):
            raise _malformed(name, f"a list of {item_type.__name__}s", value)
        if longest is not None and any(len(item) > longest for item in items):
            raise _over_cap(name, f"an entry of '{name}' is longer than {longest} characters.")


def _of_type(item: Any, wanted: type) -> bool:
    return _is_int(item) if wanted is int else isinstance(item, wanted)


def _over_cap(field: str, message: str, policy_field: str | None = None, reason: str = "over_request_cap") -> Refusal:
    if policy_field:
        message += f" Lower it, or raise {policy_field} in the policy."
    return Refusal(400, message, reason, param=field)


def check_fan_out(payload: dict[str, Any], access: Access, chat: bool) -> tuple[int, int]:
    """(n, prompts) within the policy's caps; their product is the engine's work at once."""
    n = payload.get("n") or 1
    if n > access.max_n:
        raise _over_cap("n", f"'n' is {n}; the limit here is {access.max_n}.", access.cap_field("max_n"))
    prompts = 1 if chat else _prompt_count(payload.get("prompt"))
    if prompts > access.max_prompts:
        raise _over_cap("prompt", f"'prompt' holds {prompts} prompts; the limit here is {access.max_prompts}.",
                        access.cap_field("max_prompts_per_request"))
    for name in ("top_logprobs", "prompt_logprobs") if chat else ("logprobs", "prompt_logprobs"):
        value = payload.get(name)
        if value is not None and value > access.max_logprobs:
            raise _over_cap(name, f"'{name}' is {value}; the limit here is {access.max_logprobs}.",
                            access.cap_field("max_logprobs"))
    return max(1, n), prompts


def _prompt_count(prompt: Any) -> int:
    """A string or one list of token ids is one prompt; a list of either is that many."""
    if not isinstance(prompt, list) or not prompt or _is_int(prompt[0]):
        return 1
    return len(prompt)


def _max_new_tokens(payload: dict[str, Any], chat: bool) -> int | None:
    """The completion length the engine will allow, as its routes read the fields; None for
    chat without one, which the engine lets run to the end of the context."""
    asked = asked_max_tokens(payload)
    if asked is not None:
        return max(0, asked)
    return None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS


def longest_text(payload: dict[str, Any], path: str) -> tuple[int, str] | None:
    """(characters, field) of the longest text one sequence of this request would tokenize, as
    the engine's routes count it before tokenizing; None where the engine does not hold the text
    to the context (a `truncate_prompt_tokens` keeps only the tail; the Anthropic and Responses
    routes are converted first)."""
    if path == TOKENIZE_PATH:
        if "prompt" in payload:
            return text_chars(payload["prompt"]) + text_chars(payload.get("suffix")), "prompt"
        return messages_chars(payload.get("messages")), "messages"
    if payload.get("truncate_prompt_tokens") is not None:
        return None
    if path == CHAT_PATH:
        return messages_chars(payload.get("messages")), "messages"
    if path == COMPLETIONS_PATH:
        return _longest_of_batch(payload.get("prompt")) + text_chars(payload.get("suffix")), "prompt"
    if path == EMBEDDINGS_PATH:
        return _longest_of_batch(payload.get("input")), "input"
    return None


def _longest_of_batch(value: Any) -> int:
    """A list of strings is a batch, each text its own sequence; anything else is one."""
    batch = value if isinstance(value, list) and value and isinstance(value[0], str) else [value]
    return max(map(text_chars, batch))


# Text this long is measured against the engine's cards (read if the gateway has none) before
# it is forwarded; shorter text costs less to forward than a read of the cards, and the engine
# refuses it by the same rule before tokenizing. A 3.6 MB prompt's 400 took 40 ms from the
# engine, 20 ms from the gateway; other tenants' small requests beside it went from 2.6-3.1x
# their time alone to 1.6-2.0x (test_noisy_neighbour.py, two cores).
FIT_CHECK_CHARS = 1 << 16


def check_fits(longest: tuple[int, str], max_chars: int | None) -> None:
    """400 for text longer than any engine serving the model can fit (`max_chars`: its context
    times its longest token, from its cards), before megabytes are encoded and forwarded."""
    if max_chars is None or longest[0] <= max_chars:
        return
    raise Refusal(400, f"the prompt has {longest[0]} characters, more than this model's context can hold "
                  f"(at most {max_chars}, as many as its longest tokens would fill): shorten the prompt",
                  "invalid_request", param=longest[1])


def bound_open_ended(prepared: PreparedBody, context: int | None) -> None:
    """Reserve what an open-ended chat reply may really use. Its prompt and reply together fit
    in the model's context, so n sequences hold at most n x `context` tokens (its prompt
    estimate if larger: a prompt that long is refused, not run). Without a known context the
    reply is capped instead: `UNKNOWN_CONTEXT_MAX_TOKENS` is sent and reserved."""
    if context is None:
        prepared.payload[prepared.max_tokens_field] = UNKNOWN_CONTEXT_MAX_TOKENS
        prepared.reserve_tokens = prepared.prompt_estimate + prepared.sequences * UNKNOWN_CONTEXT_MAX_TOKENS
    else:
        prepared.reserve_tokens = max(prepared.prompt_estimate, prepared.sequences * context)


def _template_bytes(payload: dict[str, Any]) -> int:
    extras = [payload[k] for k in ("tools", "chat_template_kwargs") if payload.get(k)]
    return len(json.dumps(extras, ensure_ascii=False).encode()) if extras else 0


def prepare(payload: dict[str, Any], access: Access, policy_hide: bool, over_cap: str,
            salt: str | None, audit: PromptAudit, path: str) -> PreparedBody:
    chat = path in (CHAT_PATH, RESPONSES_PATH) or path in MESSAGES_PATHS  # extra fields go to the engine's chat route
    model = check_model(payload, access, policy_hide)
    check_types(payload, chat)
    check_lists(payload)
    if path == EMBEDDINGS_PATH:
        return _prepare_embeddings(payload, model, access, salt, audit)
    if path in MESSAGES_PATHS:
        return _prepare_messages(payload, model, access, over_cap, salt, audit, path)
    if path == RESPONSES_PATH:
        return _prepare_responses(payload, model, access, over_cap, salt, audit)
    n, prompts = check_fan_out(payload, access, chat)
    cap_max_tokens(payload, access, over_cap)
    size, fields = prompt_fields(payload, audit, path)
    strip = ask_for_usage(payload)
    if _generates(payload) or "cache_salt" in payload:
        set_cache_salt(payload, salt)
    prepared = PreparedBody(payload, model, payload.get("stream") is True, strip,
                            size + _template_bytes(payload), fields)
    if path in GENERATION_PATHS:
        prepared.sequences = n * prompts
        new_tokens = _max_new_tokens(payload, chat)
        prepared.open_ended = new_tokens is None
        prepared.reserve_tokens = prepared.prompt_estimate + n * prompts * (new_tokens or 0)
        prepared.counts_always = bool(payload.get("tools") or payload.get("chat_template_kwargs"))
        prepared.priority = set_priority(payload, access.priority)
    elif path == TOKENIZE_PATH:  # tokenizing is work too: charged as the prompt it reads
        prepared.reserve_tokens = prepared.prompt_estimate
    return prepared


# ---- Anthropic's Messages API ------------------------------------------------------------------

# Anthropic's fields that the engine's MessagesRequest takes as JSON objects only (it is strict).
MESSAGES_OBJECT_FIELDS = ("tool_choice", "metadata")


def _prepare_messages(payload: dict[str, Any], model: str | None, access: Access, over_cap: str,
                      salt: str | None, audit: PromptAudit, path: str) -> PreparedBody:
    """/v1/messages and its count_tokens: checked and charged as a chat request, which is what
    the engine runs. `max_tokens` is required (as Anthropic's API has it), so the reservation
    is always bounded; there is no `n`, one message per request. A count_tokens request runs
    nothing: it is charged as the prompt it reads, and not held to max_prompt_tokens, since
    learning the count is how a client (Claude Code's compaction) trims its prompt to fit."""
    _check_messages_fields(payload)
    counting = path == COUNT_TOKENS_PATH
    if not counting:
        if payload.get("max_tokens") is None:
            raise Refusal(400, "'max_tokens' is required: the most tokens the reply may have.",
                          "malformed_request", param="max_tokens")
        cap_max_tokens(payload, access, over_cap)
    size, fields = prompt_fields(payload, audit, path)
    set_cache_salt(payload, salt)
    prepared = PreparedBody(payload, model, payload.get("stream") is True and not counting, False,
                            size + _template_bytes(payload), fields, prompt_capped=not counting)
    if counting:
        prepared.reserve_tokens = prepared.prompt_estimate
        return prepared
    prepared.reserve_tokens = prepared.prompt_estimate + max(0, asked_max_tokens(payload) or 0)
    prepared.counts_always = bool(payload.get("tools") or payload.get("chat_template_kwargs"))
    prepared.priority = set_priority(payload, access.priority)
    return prepared


def _check_messages_fields(payload: dict[str, Any]) -> None:
    for name in ("n", "best_of"):  # the engine's chat route would take them: one sample only here
        if payload.get(name) not in (None, 1):
            raise Refusal(400, f"'{name}' is not part of the Messages API: it answers one message per "
                          "request.", "malformed_request", param=name)
    if payload.get("messages") is None:
        raise Refusal(400, "'messages' is required.", "malformed_request", param="messages")
    system = payload.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise _malformed("system", "a string or a list of text blocks", system)
    for name in MESSAGES_OBJECT_FIELDS:
        value = payload.get(name)
        if value is not None and not isinstance(value, dict):
            raise _malformed(name, "a JSON object", value)
    _check_stop_sequences(payload.get("stop_sequences"))


def _check_stop_sequences(value: Any) -> None:
    """The engine runs `stop_sequences` as chat's `stop`: the same caps."""
    if value is None:
        return
    most, longest = caps.LIST_CAPS["stop"]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _malformed("stop_sequences", "a list of strings", value)
    if len(value) > most:
        raise _over_cap("stop_sequences", f"'stop_sequences' has {len(value)} entries; at most {most} are accepted.")
    if longest is not None and any(len(item) > longest for item in value):
        raise _over_cap("stop_sequences", f"an entry of 'stop_sequences' is longer than {longest} characters.")


# ---- OpenAI's Responses API -----------------------------------------------------------------

# Chat fields the engine's chat route would take from a Responses request's extra fields, and
# the Responses API's own name for each: one reply per request, its length `max_output_tokens`.
NOT_RESPONSES_FIELDS = {"n": None, "best_of": None, "max_tokens": "max_output_tokens",
                        "max_completion_tokens": "max_output_tokens"}


def _prepare_responses(payload: dict[str, Any], model: str | None, access: Access, over_cap: str,
                       salt: str | None, audit: PromptAudit) -> PreparedBody:
    """/v1/responses: checked and charged as the chat request the engine makes of it (see
    `responses_input`): `max_output_tokens` is held to the policy's max_tokens, and without one
    the reply is open-ended as chat's is (`bound_open_ended`). The stream carries its own usage
    (its `response.completed` event): nothing is asked for, nothing stripped."""
    _check_responses_fields(payload)
    asked = _cap_max_output_tokens(payload, access, over_cap)
    size, fields = prompt_fields(payload, audit, RESPONSES_PATH)
    set_cache_salt(payload, salt)
    prepared = PreparedBody(payload, model, payload.get("stream") is True, False, size + _template_bytes(payload),
                            fields, max_tokens_field="max_output_tokens")
    prepared.open_ended = asked is None
    prepared.reserve_tokens = prepared.prompt_estimate + (asked or 0)
    prepared.counts_always = bool(payload.get("tools") or payload.get("chat_template_kwargs"))
    prepared.priority = set_priority(payload, access.priority)
    return prepared


def _cap_max_output_tokens(payload: dict[str, Any], access: Access, over_cap: str) -> int | None:
    """The reply length sent: the client's within the cap, else the cap itself (an absent one
    would let the engine run to the context length), else none (open-ended)."""
    asked, cap = payload.get("max_output_tokens"), access.max_tokens
    if asked is None and cap is None:
        return None
    length = cap if asked is None else _capped("max_output_tokens", asked, cap, access, over_cap)
    payload["max_output_tokens"] = length
    return length


def _check_responses_fields(payload: dict[str, Any]) -> None:
    for name, instead in NOT_RESPONSES_FIELDS.items():
        if payload.get(name) is not None and (instead or payload[name] != 1):
            hint = f"use '{instead}'" if instead else "it answers one response per request"
            raise Refusal(400, f"'{name}' is not part of the Responses API: {hint}.", "malformed_request", param=name)
    items = payload.get("input")
    if items is None:
        raise Refusal(400, "'input' is required.", "malformed_request", param="input")
    if not isinstance(items, str) and not (isinstance(items, list) and all(isinstance(i, dict) for i in items)):
        raise _malformed("input", "a string or a list of input items", items)
    most = caps.LIST_CAPS["messages"][0]
    if isinstance(items, list) and len(items) > most:
        raise _over_cap("input", f"'input' has {len(items)} items; at most {most} are accepted.")
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _malformed("instructions", "a string", instructions)
    tool_choice = payload.get("tool_choice")
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise _malformed("tool_choice", "a string or a JSON object", tool_choice)


def _response_count(payload: dict[str, Any]) -> PromptCount:
    """The engine's `/tokenize` renders the conversation `responses_input` builds, with the
    function tools in chat's shape, as the chat route will (the engine has no count route for
    the Responses API). The count names `input` when it refuses."""
    body: dict[str, Any] = {k: payload[k] for k in ("model", "chat_template_kwargs") if k in payload}
    body["messages"] = as_chat_messages(payload)
    tools = _rendered_tools(payload)
    if tools and as_chat_tools(tools):
        body["tools"] = as_chat_tools(tools)
    return PromptCount(0, (json.dumps(body).encode(),), "input")


# ---- embeddings -----------------------------------------------------------------------------

def _prepare_embeddings(payload: dict[str, Any], model: str | None, access: Access, salt: str | None,
                        audit: PromptAudit) -> PreparedBody:
    """/v1/embeddings: each input is a prompt of its own (one engine sequence), bounded as
    prompts are: how many per request, and tokens each (`needs_token_count`); their tokens are
    the request's whole cost, held against tokens_per_minute until the engine's usage says."""
    if payload.get("stream") is True:
        raise Refusal(400, "Embeddings are not streamed; leave out 'stream'.", "malformed_request", param="stream")
    inputs = embedding_inputs(payload.get("input"))
    if len(inputs) > access.max_prompts:
        raise _over_cap("input", f"'input' holds {len(inputs)} inputs; the limit here is {access.max_prompts}.",
                        access.cap_field("max_prompts_per_request"))
    if "cache_salt" in payload:
        set_cache_salt(payload, salt)
    size, fields = prompt_fields(payload, audit, EMBEDDINGS_PATH)
    prepared = PreparedBody(payload, model, False, False, size, fields, sequences=len(inputs))
    prepared.reserve_tokens = prepared.prompt_estimate
    prepared.longest_input_bytes = max(_input_bytes(item) for item in inputs)
    return prepared


def _input_bytes(item: str | list[int]) -> int:
    return len(item.encode()) if isinstance(item, str) else len(item)


def embedding_inputs(value: Any) -> list[str] | list[list[int]]:
    """OpenAI's four shapes of `input`, as a list of inputs: a string, a list of strings, a list
    of token ids, or a list of such lists. Anything else is refused here rather than read one
    way by the gateway and another by the engine."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if all(_is_int(item) for item in value):
            return [value]
        if all(isinstance(item, list) and item and all(_is_int(t) for t in item) for item in value):
            return value
    if value == []:
        raise Refusal(400, "'input' is empty; give a string, a list of strings or token ids.",
                      "malformed_request", param="input")
    raise _malformed("input", "a string, a list of strings, a list of token ids or a list of non-empty "
                     "token-id lists", value)


def _inputs_count(payload: dict[str, Any], cap: int) -> PromptCount:
    """Only an input that could be over the cap is measured (a token is at least one byte), so
    an indexing batch of short chunks costs no /tokenize call."""
    inputs = embedding_inputs(payload.get("input"))
    if not isinstance(inputs[0], str):
        return PromptCount(max(len(ids) for ids in inputs), (), "input")
    base = {"model": payload["model"]} if "model" in payload else {}
    long = [text for text in inputs if len(text.encode()) + TEMPLATE_ALLOWANCE_TOKENS > cap]
    return PromptCount(0, tuple(json.dumps({**base, "prompt": text}).encode() for text in long), "input")
