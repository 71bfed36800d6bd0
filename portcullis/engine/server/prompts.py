"""Turning request bodies into prompt token ids: tokenization and the model's chat template.

These functions are blocking (tokenizers, Jinja); the routes run them in the server's
tokenizer thread, never on the event loop. Errors a client can fix raise a 400 `APIError`.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from portcullis.engine.server import fim
from portcullis.engine.server.errors import bad_request
from portcullis.engine.server.protocol import ChatMessage, CompletionRequest


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, when the client gave text (for echo)
    # Tokens that end this prompt's continuation besides EOS: a FIM template's end-of-middle.
    end_ids: tuple[int, ...] = ()


# Tokens of slack before the last `truncate_prompt_tokens`: the text is cut before it is
# tokenized, and a word cut in two tokenizes differently; these tokens absorb it.
TAIL_SLACK_TOKENS = 16


def truncation_tail(text: str, k: int | None, max_token_chars: int) -> str:
    """Enough of the end of `text` to hold its last `k` tokens, so that a long document sent to be
    truncated costs the tokenizer only what it keeps: (k + slack) tokens of the longest kind. The
    cut moves back to the nearest space or punctuation, where tokenizers' pre-tokenizers split
    too, so the kept tokens are those of the whole text. (Inside one run of letters longer than
    the slack, with no such break, the run's tokens may differ from the whole text's.)"""
    keep = (k + TAIL_SLACK_TOKENS) * max_token_chars if k is not None else len(text)
    if len(text) <= keep:
        return text
    start = len(text) - keep
    for at in range(start, max(-1, start - keep), -1):
        if not text[at].isalnum():
            return text[at:]
    return text[start:]


def completion_prompts(req: CompletionRequest, tokenizer, max_token_chars: int) -> list[Prompt]:
    """One Prompt per prompt in the request (a string, strings, token ids, or lists of ids),
    cut to `truncate_prompt_tokens`; with a `suffix`, each is the prefix of a FIM prompt.
    Text prompts keep their whole text for echo; only their tail is tokenized when truncated."""
    if req.suffix:
        return fim_prompts(req, tokenizer, max_token_chars)
    k = req.truncate_prompt_tokens

    def encode(text: str) -> list[int]:
        return tokenizer.encode(truncation_tail(text, k, max_token_chars))

    return [Prompt(ids if k is None else ids[-k:], text) for ids, text in _prompt_parts(req.prompt, encode)]


def _prompt_parts(p, encode) -> list[tuple[list[int], str | None]]:
    """Each prompt as token ids (text through `encode`), with its text when it was text."""
    if isinstance(p, str):
        return [(encode(p), p)]
    if not p:
        raise bad_request("'prompt' is empty", "prompt")
    if isinstance(p[0], int):
        return [(list(p), None)]
    if isinstance(p[0], str):
        return [(encode(s), s) for s in p]
    if not all(p):  # an empty prefix would still carry a suffix, a FIM prompt's whole cost, uncounted
        raise bad_request("'prompt' holds an empty list of token ids", "prompt")
    return [(list(ids), None) for ids in p]


def fim_prompts(req: CompletionRequest, tokenizer, max_token_chars: int) -> list[Prompt]:
    """Fill-in-the-middle: each prompt is a prefix, `suffix` follows it, in the model's own FIM
    template. A prompt's text (for echo) is the client's prefix, not the scaffolding. Token-id
    prompts are prefixes as they stand; `truncate_prompt_tokens` drops the prefix's oldest tokens."""
    template = fim_template(tokenizer)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs cannot be combined with 'suffix': the echoed prefix is not the "
                          "prompt the model scored; drop echo or logprobs", "echo")
    suffix_ids = template.encode_suffix(tokenizer, req.suffix)
    prompts = []
    k = req.truncate_prompt_tokens
    for prefix_ids, text in _prompt_parts(req.prompt, lambda s: template.encode_prefix(
            tokenizer, truncation_tail(s, k, max_token_chars))):
        prefix_ids = _fim_truncated(prefix_ids, len(suffix_ids) + template.num_markers, req.truncate_prompt_tokens)
        if text is None and req.echo:
            text = tokenizer.decode(prefix_ids)
        prompts.append(Prompt(template.build(prefix_ids, suffix_ids), text, template.end_ids))
    return prompts


def fim_template(tokenizer) -> fim.FimTemplate:
    """The model's FIM template, or a 400 naming `suffix` for a model that has none."""
    template = fim.detect(tokenizer)
    if template is None:
        raise bad_request("'suffix' (fill-in-the-middle) needs a model whose tokenizer has FIM tokens, such as "
                          "Qwen2.5-Coder, StarCoder2, CodeLlama or DeepSeek-Coder; this model has none. Send "
                          "the prompt without a suffix", "suffix")
    return template


def fim_prompt_ids(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The token ids `/v1/completions` runs for a text `prefix` and `suffix` (what `/tokenize` counts)."""
    template = fim_template(tokenizer)
    return template.build(template.encode_prefix(tokenizer, prefix), template.encode_suffix(tokenizer, suffix))


def _fim_truncated(prefix_ids: list[int], others: int, k: int | None) -> list[int]:
    """The prefix's last tokens that fit `k` together with the suffix and markers (`others`)."""
    if k is None or len(prefix_ids) + others <= k:
        return prefix_ids
    if others > k:
        raise bad_request(f"truncate_prompt_tokens={k} leaves no room for the prefix: the suffix and the FIM "
                          f"markers alone take {others} tokens", "truncate_prompt_tokens")
    return prefix_ids[len(prefix_ids) - (k - others) :]


def chat_messages(messages: list[ChatMessage], template: str = "", tools_text: str | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as one string, and OpenAI's
    `developer` role (its new name for `system`) as `system` for templates that do not know it.
    With `tools_text` (tools the template cannot show), the tools are described in the system
    message, and past calls and their results are written as text the template can render."""
    out = []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        msg["content"] = _text_content(m.content, i)
        if msg["role"] == "developer" and not _knows_role(template, "developer"):
            msg["role"] = "system"
        out.append(_calls_as_text(msg, template) if tools_text is not None else msg)
    return out if tools_text is None else _with_system_text(out, tools_text, template)


def _calls_as_text(msg: dict[str, Any], template: str) -> dict[str, Any]:
    """A past call as the generic format writes it, and a tool's result as a user turn when the
    template knows no `tool` role (many templates insist that users and the assistant alternate)."""
    calls = msg.pop("tool_calls", None)
    if msg["role"] == "assistant" and isinstance(calls, list):
        written = [json.dumps({"name": c.get("function", {}).get("name"), "arguments": _arguments(c)}, ensure_ascii=False)
                   for c in calls if isinstance(c, dict)]
        msg["content"] = "; ".join(filter(None, [msg["content"], *written]))
    if msg["role"] == "tool" and not _knows_role(template, "tool"):
        msg = {"role": "user", "content": f"Result of the tool call {msg.get('tool_call_id', '')}: {msg['content']}"}
    return msg


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def _with_system_text(conversation: list[dict[str, Any]], text: str, template: str) -> list[dict[str, Any]]:
    """`text` at the start of the system message (made if there is none), or of the first user
    turn for a template that knows no `system` role."""
    if conversation and conversation[0]["role"] == "system":
        return [{**conversation[0], "content": f"{text}\n\n{conversation[0]['content']}"}, *conversation[1:]]
    if _knows_role(template, "system") or not conversation:
        return [{"role": "system", "content": text}, *conversation]
    return [{**conversation[0], "content": f"{text}\n\n{conversation[0]['content']}"}, *conversation[1:]]


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
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation rendered with the model's own chat template; `tools` handed to it, or,
    when it cannot show them, described in the system message (the generic tool format)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    template = str(tokenizer.chat_template)  # a str, or a dict of named templates
    tools_text = None
    if tools and renders_tools(tokenizer):
        kwargs["tools"] = tools
    elif tools:
        tools_text = describe_tools(tools)
    conversation = chat_messages(messages, template, tools_text)
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs,
        )
    except TemplateSyntaxError:
        raise  # the model's own template is broken, whatever the messages: ours to fix (500)
    except _refusals(continue_final_message) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        if not _raised_while_rendering(exc):
            raise
        # The template ran on the client's data and choked on its shape (`tool_calls: 5` looped over).
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc


def _raised_while_rendering(exc: BaseException) -> bool:
    """Whether a compiled template's own code was running when `exc` was raised (Jinja compiles a
    template from a string to code whose file name is "<template>")."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def _refusals(continuing: bool) -> tuple[type[Exception], ...]:
    """What rendering raises on the client's messages: a template's own refusal (`raise_exception`)
    or a Jinja error on their content (`jinja2.TemplateError`) and, when the final message is to be
    continued, transformers' ValueError for one it cannot continue. Anything else is ours (500)."""
    return (TemplateError, ValueError) if continuing else (TemplateError,)


_PROBE_TOOL = "portcullis_probe_tool"


@functools.lru_cache(maxsize=8)
def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template shows the tools it is given (rendered once with a probe
    tool, as llama.cpp's server checks a template's capabilities)."""
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools cannot show them
        return False
    return _PROBE_TOOL in text


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """The tools, and how to call them, for a model whose template cannot show them: the generic
    format, whose calls `tool_parsers.GenericToolParser` reads (and forced calls' grammar makes)."""
    listing = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
    return ("You can call the following functions (their parameters are JSON Schema):\n" + listing + "\n"
            'To call a function, reply with only a JSON object {"name": <function name>, "arguments": '
            '<object of arguments>}; for several calls, separate the objects with ";". '
            "Otherwise reply as usual.")


def chat_prompt(tokenizer, messages: list[ChatMessage], truncate: int | None = None, max_token_chars: int = 0,
                **template_args) -> Prompt:
    """The rendered conversation's tokens, only its last `truncate` when given."""
    text = render_chat(tokenizer, messages, **template_args)
    # The template already wrote any special tokens it wants; adding BOS again would double it.
    ids = tokenizer.encode(truncation_tail(text, truncate, max_token_chars), add_special_tokens=False)
    return Prompt(ids if truncate is None else ids[-truncate:], text)
