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

import json
from collections.abc import Iterator
from typing import Any

from portcullis.engine.sampling_params import MAX_LOGPROBS  # noqa: F401  (top_logprobs and logprobs: the engine's cap)
from portcullis.engine.server.errors import bad_request

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 128  # a banned word must be one token; no token is longer
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_CHOICES = 256  # guided_choice / structured_outputs.choice
# A grammar compiles to about 260 bytes per character at worst (long alternatives: a choice list,
# or the same as an enum, regex or EBNF), in time that grows faster than its length: 16,384
# characters 0.1-0.2 s and 4.2 MB, 65,536 about 1 s and 17 MB, the red team's 256 choices x 410
# characters (105,000) 4 s and 28 MB (demo tokenizer; a synthetic 152K-token one gave the same).
# OpenAI's enums allow 15,000 characters of values: choices get just above that, each as long as
# a stop string; a JSON Schema (as JSON text), regex or grammar gets 65,536, where a schema of
# 1,400 properties compiles in 0.15 s to 6 MB.
MAX_CHOICE_CHARS = 256
MAX_CHOICES_CHARS = 16_384
MAX_GRAMMAR_CHARS = 65_536
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
    "guided_choice": (MAX_CHOICES, MAX_CHOICE_CHARS),
    "tools": (MAX_TOOLS, None),
    "messages": (MAX_MESSAGES, None),
}


def check_sizes(req: Any) -> None:
    """400 naming the first list field with too many entries, an entry too long, or a grammar
    (JSON Schema, regex, EBNF) too long to compile."""
    for name, (most, chars) in _LIST_CAPS.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        entries = [value] if isinstance(value, str) else value
        if len(entries) > most:
            raise bad_request(f"'{name}' has {len(entries)} entries; at most {most} are allowed", name)
        if chars is not None and any(len(e) > chars for e in entries):
            raise bad_request(f"each entry of '{name}' must be at most {chars} characters", name)
    for name, grammar in _grammars(req):
        chars = len(grammar) if isinstance(grammar, str) else len(json.dumps(grammar))
        if chars > MAX_GRAMMAR_CHARS:
            raise bad_request(f"'{name}' holds a grammar of {chars} characters; at most {MAX_GRAMMAR_CHARS} "
                              "are allowed", name)


def _grammars(req: Any) -> Iterator[tuple[str, Any]]:
    """The JSON Schemas, regexes and EBNF grammars a request gives, by field (choices: `check_choices`)."""
    rf = getattr(req, "response_format", None)
    schema = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(schema, dict) and schema.get("schema") is not None:
        yield "response_format", schema["schema"]
    so = getattr(req, "structured_outputs", None)
    if isinstance(so, dict):
        yield from (("structured_outputs", so[key]) for key in ("json", "regex", "grammar") if so.get(key) is not None)
    for name in ("guided_json", "guided_regex", "guided_grammar"):
        if getattr(req, name, None) is not None:
            yield name, getattr(req, name)


def check_choices(choices: list[str] | None, field: str) -> None:
    """400 for a choice list the grammar compiler would spend seconds and megabytes on."""
    if choices is None:
        return
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"'{field}' has {len(choices)} choices; at most {MAX_CHOICES} are allowed", field)
    if any(len(choice) > MAX_CHOICE_CHARS for choice in choices):
        raise bad_request(f"each choice of '{field}' must be at most {MAX_CHOICE_CHARS} characters", field)
    if (chars := sum(map(len, choices))) > MAX_CHOICES_CHARS:
        raise bad_request(f"the choices of '{field}' have {chars} characters in all; at most {MAX_CHOICES_CHARS} "
                          "are allowed", field)


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
