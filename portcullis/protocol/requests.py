"""How a generating request's fields are read, the same on both sides of the private channel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Both names on both routes, the first one set winning: OpenAI's chat renamed `max_tokens` to
# `max_completion_tokens`; clients send either, and to either route.
MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def asked_max_tokens(fields: Mapping[str, Any]) -> int | None:
    """The completion length a request asks for, or None when it names none (an integer field
    only: the caller has checked the types)."""
    for name in MAX_TOKEN_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# Prompt logprobs one response carries at once (`echo` with `logprobs`): n x the prompts' tokens
# x (logprobs + 1) entries, scored and built in one piece before the first byte goes out.
# lm-eval's loglikelihood (echo, logprobs 1, n 1) of 16 prompts of 4,096 tokens is 131,072; the
# second review's 4 samples x 4 prompts x 1,000 tokens x 21 was 336,000 entries, an 8 MB body
# that stalled every other tenant 8-11 s.
MAX_PROMPT_LOGPROB_ENTRIES = 131_072


def prompt_logprob_width(logprobs: int | None, echo: bool, prompt_logprobs: int | None) -> int:
    """Entries a response carries for each prompt token, in every sample: echoed logprobs (the
    token and its alternatives) and vLLM's `prompt_logprobs`, each when asked for."""
    width = logprobs + 1 if echo and logprobs is not None else 0
    return width + (prompt_logprobs + 1 if prompt_logprobs is not None else 0)


def prompt_logprobs_problem(n: int, prompt_tokens: int, width: int) -> str | None:
    """Why scoring `prompt_tokens` prompt tokens (all prompts together) `width` wide for each of
    `n` samples is refused, or None."""
    entries = n * prompt_tokens * width
    if entries <= MAX_PROMPT_LOGPROB_ENTRIES:
        return None
    return (f"this request would return {entries} prompt logprobs (n={n} x {prompt_tokens} prompt tokens x {width} "
            f"for echo / prompt_logprobs); at most {MAX_PROMPT_LOGPROB_ENTRIES} are allowed in one response: send "
            "fewer or shorter prompts, a lower n or fewer logprobs")


def text_chars(value: Any) -> int:
    """The characters of every string in a prompt-like value (a string, a list of strings or of
    token ids, chat messages' contents and their parts), parsed (dicts) or validated (objects
    with a `text`): what the tokenizer would read."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return 0 if value and isinstance(value[0], int) else sum(map(text_chars, value))  # token ids: no text
    text = value.get("text") if isinstance(value, dict) else getattr(value, "text", None)
    return len(text) if isinstance(text, str) else 0


def messages_chars(messages: Any) -> int:
    """The characters of chat messages' contents (parsed or validated), as `text_chars` counts."""
    if not isinstance(messages, list):
        return 0
    return sum(text_chars(m.get("content") if isinstance(m, dict) else getattr(m, "content", None)) for m in messages)


def prompt_chars_problem(chars: int, max_model_len: int, max_token_chars: int) -> str | None:
    """Why text of `chars` characters cannot fit the context (more than `max_model_len` tokens
    of the longest kind could hold), or None: known before any tokenizer reads it. The engine
    gives `max_token_chars` on its model cards, and the gateway holds text counted by
    `text_chars` to the same bound (`gateway.body.check_fits`) before forwarding megabytes."""
    if chars <= max_model_len * max_token_chars:
        return None
    return (f"the prompt has {chars} characters, more than this model's context of {max_model_len} "
            f"tokens can hold (its longest token has {max_token_chars}): shorten the prompt")
