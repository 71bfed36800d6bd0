"""The engine's own checks of what one request may ask for, against the caps the gateway applies
too (`portcullis.protocol.caps`): a request over a cap is a 400 naming the field and the cap,
before any work. A body that fans out into more sequences than the engine runs at once is
refused here as well.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from portcullis.engine.server.errors import bad_request
from portcullis.protocol.caps import (
    CHAT_TEMPLATE_KWARGS,
    LIST_CAPS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CHOICES_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_TEMPLATE_KWARG_CHARS,
)
from portcullis.protocol.requests import prompt_chars_problem


def check_prompt_chars(chars: int, max_model_len: int, max_token_chars: int, param: str = "prompt") -> None:
    """Text of more characters than `max_model_len` tokens of the longest kind can hold cannot
    fit the context, and is refused before it is tokenized: a 3.5 MB prompt held the one tokenizer
    thread, and every other tenant behind it, for 5-10 s before its 400."""
    problem = prompt_chars_problem(chars, max_model_len, max_token_chars)
    if problem:
        raise bad_request(problem, param)


def check_sizes(req: Any) -> None:
    """400 naming the first list field with too many entries, an entry too long, or a grammar
    (JSON Schema, regex, EBNF) too long to compile."""
    for name, (most, chars) in LIST_CAPS.items():
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
