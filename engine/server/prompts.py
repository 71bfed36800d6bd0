"""Turning request bodies into prompt token ids: tokenization and the model's chat template.

These functions are blocking (tokenizers, Jinja); the routes run them in the server's
tokenizer thread, never on the event loop. Errors a client can fix raise a 400 `APIError`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.server.errors import bad_request
from engine.server.protocol import ChatMessage, CompletionRequest


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, when the client gave text (for echo)


def completion_prompts(req: CompletionRequest, tokenizer) -> list[Prompt]:
    """One Prompt per prompt in the request: a string, strings, token ids, or lists of ids."""
    p = req.prompt
    if isinstance(p, str):
        return [Prompt(tokenizer.encode(p), p)]
    if not p:
        raise bad_request("'prompt' is empty", "prompt")
    if isinstance(p[0], int):
        return [Prompt(list(p), None)]
    if isinstance(p[0], str):
        return [Prompt(tokenizer.encode(s), s) for s in p]
    return [Prompt(list(ids), None) for ids in p]


def chat_messages(messages: list[ChatMessage], template: str = "") -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as one string, and OpenAI's
    `developer` role (its new name for `system`) as `system` for templates that do not know it."""
    out = []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        msg["content"] = _text_content(m.content, i)
        if msg["role"] == "developer" and not _knows_role(template, "developer"):
            msg["role"] = "system"
        out.append(msg)
    return out


def _knows_role(template: str, role: str) -> bool:
    """Whether a chat template names `role` as a string literal (a role it compares against),
    not merely mentions the word (say, in a comment)."""
    return f"'{role}'" in template or f'"{role}"' in template


def _text_content(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}]: content parts of type {part.type!r} are not supported; "
                "this model takes text only",
                f"messages.{index}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def render_chat(
    tokenizer,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation rendered with the model's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    template = str(tokenizer.chat_template)  # a str, or a dict of named templates
    conversation = chat_messages(messages, template)
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template error (Jinja, ValueError) is the client's input
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc


def chat_prompt(tokenizer, messages: list[ChatMessage], **template_args) -> Prompt:
    text = render_chat(tokenizer, messages, **template_args)
    # The template already wrote any special tokens it wants; adding BOS again would double it.
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)
