"""What one request may ask for. Each cap keeps a single request from stalling the server for
every other tenant: a list scanned once per generated token, words tokenized per request, a
client's code in the chat template, a body that fans out into more sequences than the engine
runs at once. A request over a cap is a 400 naming the field and the cap, before any work.

The caps follow OpenAI where it has one (128 tools, 20 top_logprobs for chat), vLLM for legacy
completions' logprobs (20, where OpenAI had 5: clients moving from vLLM keep working; both are
the engine's `MAX_LOGPROBS`), and
otherwise sit well above what real clients send: OpenAI allows 4 stop strings, but IDE
assistants send a dozen or so for code completion, hence 16.
"""
from __future__ import annotations

from typing import Any

from portcullis.engine.sampling_params import MAX_LOGPROBS  # noqa: F401  (top_logprobs and logprobs: the engine's cap)
from portcullis.engine.server.errors import MAX_JSON_DEPTH, bad_request

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 128  # a banned word must be one token; no token is longer
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_CHOICES = 256  # guided_choice / structured_outputs.choice
MAX_TOOLS = 128
MAX_MESSAGES = 2048

# The chat_template_kwargs real templates read (Qwen3, DeepSeek, gpt-oss, Qwen2-VL, Llama 3),
# as short scalars. Anything else could reach the template renderer as code (`chat_template`)
# or as unbounded data (`tools`, `documents`: those have their own request fields).
CHAT_TEMPLATE_KWARGS = frozenset({
    "enable_thinking", "thinking", "reasoning_effort", "add_vision_id", "tools_in_user_message", "date_string",
})
MAX_TEMPLATE_KWARG_CHARS = 128

# Request field -> (most entries, most characters in one entry, or None).
_LIST_CAPS: dict[str, tuple[int, int | None]] = {
    "stop": (MAX_STOP_STRINGS, MAX_STOP_CHARS),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, None),
    "bad_words": (MAX_BAD_WORDS, MAX_BAD_WORD_CHARS),
    "logit_bias": (MAX_LOGIT_BIAS, None),
    "allowed_token_ids": (MAX_ALLOWED_TOKEN_IDS, None),
    "guided_choice": (MAX_CHOICES, None),
    "tools": (MAX_TOOLS, None),
    "messages": (MAX_MESSAGES, None),
}


def check_sizes(req: Any) -> None:
    """400 naming the first list field with too many entries, or an entry too long."""
    for name, (most, chars) in _LIST_CAPS.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        entries = [value] if isinstance(value, str) else value
        if len(entries) > most:
            raise bad_request(f"'{name}' has {len(entries)} entries; at most {most} are allowed", name)
        if chars is not None and any(len(e) > chars for e in entries):
            raise bad_request(f"each entry of '{name}' must be at most {chars} characters", name)


def check_choices(choices: list[str] | None, field: str) -> None:
    if choices is not None and len(choices) > MAX_CHOICES:
        raise bad_request(f"'{field}' has {len(choices)} choices; at most {MAX_CHOICES} are allowed", field)


def check_fan_out(n: int, num_prompts: int, max_num_seqs: int) -> None:
    """One request may not ask for more sequences than the engine runs at once: it would fill
    the shared queue and turn every other tenant away with 503s."""
    if n * num_prompts <= max_num_seqs:
        return
    raise bad_request(
        f"this request asks for {n * num_prompts} sequences ({num_prompts} prompts x n={n}); the engine runs at "
        f"most {max_num_seqs} at once (--max-num-seqs, or the waiting queue's size if smaller): send fewer "
        "prompts or a lower n",
        "n" if n > 1 else "prompt",
    )


def template_kwargs_problem(kwargs: dict[str, Any]) -> str | None:
    """Why these chat_template_kwargs are refused, or None when they are fine."""
    allowed = ", ".join(sorted(CHAT_TEMPLATE_KWARGS))
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            return (f"{key!r} is not allowed; the template takes only {allowed}. Tools go in 'tools'; "
                    "the model's own chat template is always used")
        if not (value is None or isinstance(value, (bool, int, float, str))):
            return f"{key!r} must be a boolean, number or string"
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            return f"{key!r} must be at most {MAX_TEMPLATE_KWARG_CHARS} characters"
    return None


_CONTAINERS = frozenset({dict, list})


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests deeper than `limit`. Iterative, so there is no recursion to
    exhaust; a list or object of plain values is passed over at C speed (`map(type, ...)`):
    1.5M stop_token_ids cost the event loop 0.1 s here (a loop in Python took 0.8 s)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        if _CONTAINERS.isdisjoint(map(type, children)):
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
