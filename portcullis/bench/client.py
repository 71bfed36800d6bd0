"""One streamed OpenAI request, timed chunk by chunk: time to the first token, the gaps
between tokens, the end-to-end latency and the server's own token counts."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from portcullis.bench.datasets import SampleRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (COMPLETIONS, CHAT)


@dataclass
class RequestResult:
    """One request's outcome; times in seconds, `start_time` on the perf_counter clock."""

    prompt_len: int
    success: bool = False
    output_tokens: int | None = None  # the server's usage; None when it sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class RequestPlan:
    """What every request of a run shares."""

    url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool
    extra_body: dict[str, Any]

    def body(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == CHAT:
            body.update(messages=[{"role": "user", "content": request.prompt}],
                        max_completion_tokens=request.expected_output_len)
        else:
            body.update(prompt=request.prompt, max_tokens=request.expected_output_len)
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


async def send(client: httpx.AsyncClient, plan: RequestPlan, request: SampleRequest,
               request_id: str) -> RequestResult:
    """Never raises: a refusal, a broken connection or a malformed stream is a failed result. A
    pooled keep-alive connection the server had already closed (no response at all) is retried
    once on a new one, as browsers do: llama.cpp's server closes idle connections that httpx
    would otherwise count as failed requests."""
    result = await _send_once(client, plan, request, request_id)
    if result.error.startswith(_STALE):
        result = await _send_once(client, plan, request, request_id)
    return result


_STALE = "RemoteProtocolError: Server disconnected without sending a response"


async def _send_once(client: httpx.AsyncClient, plan: RequestPlan, request: SampleRequest,
                     request_id: str) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    result.start_time = last = time.perf_counter()
    try:
        async with client.stream("POST", plan.url, json=plan.body(request),
                                 headers={**plan.headers, "x-request-id": request_id}) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_message(await response.aread())}"
                return result
            async for line in response.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                # Read on past [DONE] to the body's end: leaving early would close the
                # connection under a server still finishing, which it logs as a client abort.
                if not data or data == "[DONE]":
                    continue  # also event separators and SSE comments (keep-alive pings)
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {_message(data.encode())}"
                    return result
                now = time.perf_counter()
                _count_usage(result, chunk)
                piece = _token_text(chunk)
                if piece is None:
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - result.start_time
                else:
                    result.itl.append(now - last)
                last = now
                result.generated_text += piece
    except Exception as exc:  # httpx errors, a cut or garbled stream: counted, never fatal
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    result.latency = last - result.start_time
    result.success = result.ttft > 0.0
    if not result.success:
        result.error = "the stream ended before any token"
    return result


def _token_text(chunk: dict[str, Any]) -> str | None:
    """The text of a chunk that carries tokens; None for the usage chunk and for the chat
    chunk that only announces the assistant's role (sent before prefill, not a token)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return None if "role" in delta else delta.get("content") or ""
    return choice.get("text") or ""


def _count_usage(result: RequestResult, chunk: dict[str, Any]) -> None:
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = usage.get("completion_tokens")
        if usage.get("prompt_tokens") is not None:  # what the server counted, chat template included
            result.prompt_len = usage["prompt_tokens"]


def _message(body: bytes) -> str:
    """The OpenAI error body's message, else the start of the body."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message") or error)[:200]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body.decode(errors="replace").strip()[:200] or "(empty body)"
