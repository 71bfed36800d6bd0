"""What every route needs, built once per app, and the `Annotated` dependencies that hand it out."""
from __future__ import annotations

import itertools
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from portcullis.engine.core.structured_output import GrammarCompiler
from portcullis.engine.frontend.async_engine import AsyncEngine
from portcullis.engine.sampling_params import SamplingParams
from portcullis.engine.server.errors import APIError, bad_request
from portcullis.engine.server.fair_pool import FairPool
from portcullis.engine.server.limits import check_prompt_chars
from portcullis.engine.server.logprobs import TokenText
from portcullis.engine.server.metrics import EngineMetrics
from portcullis.engine.server.settings import ServerSettings
from portcullis.protocol.channel import PROMPT_CAP_HEADER, TENANT_HEADER

_calls = itertools.count()


def engine_request_id(request_id: str) -> str:
    """The engine's id for one call: the request's id made unique in this process (a client may
    send the same `x-request-id` twice, and the engine refuses an id in use)."""
    return f"{request_id}-{next(_calls)}"


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    settings: ServerSettings
    metrics: EngineMetrics
    max_model_len: int
    token_text: TokenText
    weights_sha256: str | None = None  # the model's identity (engine.server.identity)
    started_at: float = field(default_factory=time.time)
    # One thread, tenants in turn: tokenizers are not safe to share across threads, and the
    # event loop must never block on them (nor on building a large response).
    tokenizer_pool: FairPool = field(init=False)
    # Structured output's grammars compile here (the compiler has its own tokenizer): a big
    # schema takes seconds, and must not hold up every other request's tokenization.
    grammar_pool: FairPool = field(init=False)
    _grammar_compiler: GrammarCompiler | None = None
    # The most characters one token stands for (its vocabulary string is at least as long as its
    # text: byte-level tokens spell each byte as one character). Read once, at start-up.
    max_token_chars: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        # As many may wait to be prepared as may wait in the engine; one tenant, at most half.
        queued = self.settings.max_waiting
        self.tokenizer_pool = FairPool("tokenizer", max(1, queued // 2), queued)
        self.grammar_pool = FairPool("grammar", max(1, queued // 2), queued)

    def check_prompt_text(self, chars: int, truncate: int | None, param: str = "prompt") -> None:
        """A prompt's text fits the context, or, truncated, may be any length (only its tail is
        tokenized) with a truncation the context can hold, as vLLM requires."""
        if truncate is None:
            check_prompt_chars(chars, self.max_model_len, self.max_token_chars, param)
        elif truncate > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens is {truncate}, more than this model's context of "
                              f"{self.max_model_len} tokens", "truncate_prompt_tokens")

    def compile_grammar(self, params: SamplingParams):
        """`params.structured_outputs` compiled for the served model. Slow for big schemas: only
        in `grammar_pool`, whose one thread is the only user of the compiler and its tokenizer."""
        if self._grammar_compiler is None:
            from transformers import AutoTokenizer

            info = self.engine.info
            tokenizer = AutoTokenizer.from_pretrained(info.tokenizer)
            self._grammar_compiler = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    @property
    def max_num_seqs(self) -> int:
        """The most sequences one request may ask for: what the engine runs at once, and what
        its queue takes (a request larger than the queue would be told to retry for ever)."""
        return min(self.engine.info.max_num_seqs, self.settings.max_waiting)

    def check_model(self, name: str | None) -> str:
        """The served name a request addresses (the first one when it names none); 404 if unknown."""
        if name is None:
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name


def get_state(request: Request) -> ServerState:
    return request.app.state.server


# An id a client (the gateway) sent is kept only if it is short and plain: it ends up in logs.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(headers: dict[bytes, bytes] | list[tuple[bytes, bytes]]) -> str:
    """The client's `x-request-id` if it is acceptable, else a fresh one."""
    for name, value in headers:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if _REQUEST_ID.match(given):
                return given
    return uuid.uuid4().hex


def get_request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


def get_tenant(request: Request) -> str:
    """Whose turn a request's preparation waits for: the gateway's opaque tenant tag; callers
    that send none (direct clients of the engine) share one turn."""
    return request.headers.get(TENANT_HEADER, "")[:128]


State = Annotated[ServerState, Depends(get_state)]
def get_prompt_cap(request: Request) -> int | None:
    """The caller's cap on prompt tokens (the gateway's max_prompt_tokens for the tenant), if any."""
    value = request.headers.get(PROMPT_CAP_HEADER, "")
    return int(value) if value.isdigit() else None


def check_prompt_cap(tokens: int, cap: int | None, param: str) -> None:
    """400 for a prompt longer than the caller's cap, counted as the engine renders it."""
    if cap is not None and tokens > cap:
        raise APIError(400, f"The prompt has {tokens} tokens; the limit here is {cap}.", param=param,
                       code="prompt_too_long")


RequestId = Annotated[str, Depends(get_request_id)]
PromptCap = Annotated[int | None, Depends(get_prompt_cap)]
Tenant = Annotated[str, Depends(get_tenant)]
