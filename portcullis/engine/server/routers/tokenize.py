"""`POST /tokenize` and `POST /detokenize`, as vLLM's server has them (for clients that count
tokens before sending, such as the gateway's prompt-length caps)."""
from __future__ import annotations

from fastapi import APIRouter

from portcullis.engine.server.errors import bad_request
from portcullis.engine.server.limits import check_sizes
from portcullis.engine.server.prompts import fim_prompt_ids, render_chat
from portcullis.engine.server.protocol import DetokenizeRequest, TokenizeRequest
from portcullis.engine.server.state import State, Tenant
from portcullis.engine.server.tools import tool_plan
from portcullis.protocol.requests import messages_chars, text_chars

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State, tenant: Tenant) -> dict:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    check_sizes(body)
    tool_plan(body.tools, None)  # the same checks as the chat route's
    if body.suffix and body.prompt is None:
        raise bad_request("'suffix' goes with 'prompt' (fill-in-the-middle), not with 'messages'", "suffix")
    if body.prompt is not None:
        state.check_prompt_text(text_chars(body.prompt) + text_chars(body.suffix), None)
    else:
        state.check_prompt_text(messages_chars(body.messages), None, "messages")
    tokens, strs = await state.tokenizer_pool.run(tenant, _tokenize_with_strs, state.tokenizer, body)
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": strs}


def _tokenize_with_strs(tokenizer, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    tokens = _tokenize(tokenizer, body)
    return tokens, tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None


def _tokenize(tokenizer, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None and body.suffix:  # markers by id, user text with special tokens split
        return fim_prompt_ids(tokenizer, body.prompt, body.suffix)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    text = render_chat(  # tools as the chat route hands them to the template
        tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
        tools=body.tools,
    )
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State, tenant: Tenant) -> dict:
    state.check_model(body.model)
    vocab = len(state.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
    text = await state.tokenizer_pool.run(tenant, state.tokenizer.decode, body.tokens)
    return {"prompt": text}
