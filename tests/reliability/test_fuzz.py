"""Property-based fuzzing of the public API.

1. OpenAI chat/completions bodies, from plausible to hostile (wrong types, nulls, huge numbers,
   NaN, deep nesting, odd unicode, long strings, unknown fields), sent to a gateway in front of
   the real engine: never a 5xx but 503/504, never a stack trace or Python repr in a body,
   every error OpenAI-shaped, and the engine still serves afterwards.
2. Raw HTTP request lines and headers (bytes in paths, encoded dot segments, CR/LF, overlong
   paths, odd methods, `OPTIONS *`) against a gateway in front of the stub engine: nothing
   outside the allowlist ever reaches the engine, and every refusal is a clean 4xx, in
   OpenAI's error body and audited once (unless the HTTP parser refused it before the app).

CI runs a fixed, derandomized sample (about 250 cases); PORTCULLIS_FUZZ_EXAMPLES=N runs N
of each kind with fresh randomness.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import (
    DEMO,
    EngineProcess,
    GatewayFactory,
    RunningGateway,
    base_policy,
    report,
    wait_for,
)

EXAMPLES = int(os.environ.get("PORTCULLIS_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 100, derandomize=not EXAMPLES, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# What a leaked exception looks like in a body: a traceback, a repr, pydantic's internals.
LEAKS = re.compile(r"Traceback|File \"|object at 0x|<class '|pydantic|input_value=|errors\.pydantic\.dev")
ALLOWED_5XX = {503, 504}

# ---- strategies ---------------------------------------------------------------------------

HUGE = st.sampled_from([2**31, 2**53 + 1, 2**63, -(2**63) - 1, 10**100, -1, 0, 1e308, -1e-308])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE, st.floats(), st.text(max_size=40))
HOSTILE = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.text(max_size=12), kids, max_size=4), max_leaves=12)
LONG_TEXT = st.text(min_size=1, max_size=8).map(lambda s: s * 4000)  # tens of kilobytes
TEXT = st.one_of(st.text(max_size=120), LONG_TEXT, st.sampled_from(["", "\x00", "\u202e\ufeff", "{{ 7*7 }}"]))


def sane_or_hostile(sane: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(sane, sane, sane, HOSTILE)  # mostly plausible, so the engine is reached


SCHEMA = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "[a-z]{1,5}"}, {"type": "array", "items": {"type": "boolean"}}, {},
])
RESPONSE_FORMAT = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMA | HOSTILE))
SAMPLING: dict[str, st.SearchStrategy] = {
    "max_tokens": st.integers(-2, 20), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50), "min_p": st.floats(-0.5, 1.5), "n": st.integers(-1, 3),
    "seed": st.integers(), "stream": st.booleans(), "stop": st.lists(st.text(max_size=8), max_size=5) | st.text(max_size=8),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(0, 3),
    "logit_bias": st.dictionaries(st.integers(-5, 5000).map(str) | st.text(max_size=5), st.floats(-200, 200), max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(-1, 30), "stop_token_ids": st.lists(st.integers(-5, 5000), max_size=4),
    "bad_words": st.lists(st.text(max_size=6), max_size=3), "response_format": RESPONSE_FORMAT,
    "guided_choice": st.lists(st.text(min_size=1, max_size=6), max_size=3), "guided_regex": st.sampled_from(["[ab]+", "(", "a{2,3}"]),
    "user": st.text(max_size=20), "prompt_logprobs": st.integers(-1, 3),
}
CHAT_ONLY = {"logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25), "max_completion_tokens": st.integers(-1, 20),
             "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                 {"name": st.text(min_size=1, max_size=10)}, optional={"parameters": SCHEMA})}), max_size=2),
             "tool_choice": st.sampled_from(["auto", "none", "required"]), "chat_template_kwargs": HOSTILE,
             "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans()}
COMPLETION_ONLY = {"logprobs": st.integers(-1, 6), "echo": st.booleans(), "suffix": st.text(max_size=10)}

CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3))
MESSAGE = st.fixed_dictionaries(
    {"role": sane_or_hostile(st.sampled_from(["user", "system", "assistant", "developer", "tool", "root"])),
     "content": sane_or_hostile(CONTENT)},
    optional={"name": st.text(max_size=10), "tool_call_id": st.text(max_size=10), "tool_calls": HOSTILE})
MODEL = sane_or_hostile(st.sampled_from([DEMO, DEMO, DEMO, "other", "secret-model", "", "DEMO", "demo\x00", "../demo"]))
PROMPT = st.one_of(TEXT, st.lists(st.text(max_size=30), max_size=3), st.lists(st.integers(-5, 5000), max_size=20),
                   st.lists(st.lists(st.integers(0, 4095), max_size=5), max_size=2))
ODD_FIELDS = st.dictionaries(st.text(max_size=15), HOSTILE, max_size=3)


def body_of(required: dict, only: dict) -> st.SearchStrategy:
    optional = {name: sane_or_hostile(s) for name, s in {**SAMPLING, **only}.items()}
    fields = st.fixed_dictionaries(required, optional=optional)
    return st.builds(lambda odd, b: {**odd, **b}, ODD_FIELDS, fields)


# Plausible requests, most of which the engine runs (a few fields, each in its valid range).
PLAUSIBLE = {
    "max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "n": st.integers(1, 3),
    "stream": st.booleans(), "seed": st.integers(0, 2**32), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "response_format": RESPONSE_FORMAT,
    "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=2),
    "ignore_eos": st.booleans(), "frequency_penalty": st.floats(-2, 2),
}
USER_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=200)}),
                         min_size=1, max_size=3)
PLAUSIBLE_CHAT = st.fixed_dictionaries({"model": st.just(DEMO), "messages": USER_MESSAGES}, optional=PLAUSIBLE)
PLAUSIBLE_COMPLETION = st.fixed_dictionaries({"model": st.just(DEMO), "prompt": st.text(min_size=1, max_size=300)},
                                             optional=PLAUSIBLE)
CHAT = st.one_of(PLAUSIBLE_CHAT, body_of({"model": MODEL, "messages": sane_or_hostile(st.lists(MESSAGE, max_size=4))},
                                         CHAT_ONLY))
COMPLETION = st.one_of(PLAUSIBLE_COMPLETION, body_of({"model": MODEL, "prompt": sane_or_hostile(PROMPT)},
                                                     COMPLETION_ONLY))


def deep(depth: int) -> bytes:
    return b'{"model": "demo", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


RAW = st.one_of(st.binary(max_size=200), st.integers(10, 200_000).map(deep),
                st.builds(lambda b, cut: json.dumps(b).encode()[:cut], COMPLETION, st.integers(0, 60)))

# ---- checks -------------------------------------------------------------------------------


def assert_openai_error(payload: Any) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"], payload


def assert_no_leak(status: int, payload: dict) -> None:
    """Internals must not reach a client; the model's own output (``choices``) may say anything,
    the demo model writes Python that imports pydantic."""
    checked = json.dumps({k: v for k, v in payload.items() if k != "choices"})
    assert not LEAKS.search(checked), f"{status} leaks internals: {checked[:500]}"


def assert_clean(response: httpx.Response) -> None:
    status, text = response.status_code, response.text
    assert status < 500 or status in ALLOWED_5XX, f"{status}: {text[:500]}"
    if status >= 400:
        assert not LEAKS.search(text), f"{status} leaks internals: {text[:500]}"
        assert_openai_error(response.json())
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in text.split("\n\n") if e.strip()]
        assert events and (events[-1] == "data: [DONE]" or '"error"' in events[-1]), text[-300:]
        assert not LEAKS.search(events[-1]), f"{status} leaks internals: {events[-1][:500]}"
        for event in events[:-1]:
            assert event.startswith("data: {"), event[:200]
            assert_no_leak(status, json.loads(event[len("data: "):]))
    else:
        assert_no_leak(status, json.loads(text))


# ---- bodies against the real engine -------------------------------------------------------

@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Counter]:
    counts: Counter = Counter()
    yield counts
    cases = sum(v for k, v in counts.items() if not k.startswith("code"))
    report(request, f"fuzz: {cases} cases ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))})")


@pytest.fixture
def gw_fuzz(gateways: GatewayFactory, engine: EngineProcess) -> RunningGateway:
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [DEMO, "other"]
    policy["defaults"].update(max_tokens=16, max_body_bytes=1 << 20)  # each accepted case stays cheap
    policy["max_tokens_over_cap"] = "clamp"  # so large asks still reach the engine
    return gateways.start(policy, engine_url=f"unix://{engine.sock}")


def send(client: httpx.Client, path: str, content: bytes, tally: Counter) -> httpx.Response:
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    tally[f"body {response.status_code}"] += 1
    if response.status_code >= 400:
        tally[f"code {response.json()['error']['code']}"] += 1
    return response


@FUZZ
@given(body=st.one_of(CHAT, COMPLETION, HOSTILE.map(lambda v: {"value": v})))
@example(body={"model": DEMO, "prompt": "x", "max_tokens": float("nan")})
@example(body={"model": DEMO, "prompt": "x", "n": 10**30, "stream": 1})
@example(body={"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "stream": "true"})
def test_bodies_never_break_the_gateway_or_the_engine(gw_fuzz: RunningGateway, tally: Counter, body: dict):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    content = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as JavaScript writes them
    with httpx.Client(base_url=gw_fuzz.url, headers=gw_fuzz.auth(), timeout=60) as client:
        assert_clean(send(client, path, content, tally))


@settings(FUZZ, max_examples=EXAMPLES or 50)
@given(raw=RAW)
@example(raw=deep(100_000))
@example(raw=b'{"model": "demo", "prompt": "x", "max_tokens": 1e999}')
def test_raw_bodies_get_clean_errors(gw_fuzz: RunningGateway, tally: Counter, raw: bytes):
    with httpx.Client(base_url=gw_fuzz.url, headers=gw_fuzz.auth(), timeout=60) as client:
        assert_clean(send(client, "/v1/completions", raw, tally))


def test_the_engine_serves_after_the_fuzzing(gw_fuzz: RunningGateway, engine: EngineProcess):
    with httpx.Client(base_url=gw_fuzz.url, headers=gw_fuzz.auth(), timeout=60) as client:
        done = client.post("/v1/chat/completions", json={"model": DEMO, "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
    engine.wait_idle(10)
    assert engine.proc.poll() is None


# ---- raw request lines against the allowlist ----------------------------------------------

ALLOWLIST = {(r["method"], r["path"]) for r in base_policy()["routes"]}
SEGMENTS = st.sampled_from([
    "v1", "completions", "chat", "models", "metrics", "tokenize", "admin", "..", ".", "%2e%2e", "%2E.", ".%2e",
    "%2f", "%5c", "\\", "", "%00", "%0d%0a", "\r\nX-Injected: 1", "%252e%252e", ";", "?", "#", "v1;x=1",
    "\u00e9", "%c0%ae", "health", "readyz", "docs", "openapi.json",
])
PATH = st.one_of(
    st.lists(SEGMENTS, max_size=6).map(lambda parts: "/" + "/".join(parts)),
    st.binary(max_size=60).map(lambda b: "/" + b.decode("latin-1")),
    st.integers(1000, 100_000).map(lambda n: "/v1/" + "a" * n),
    st.sampled_from(["*", "", "//v1/models", "/v1//models", "/v1/models/", "/V1/MODELS", "http://x/v1/models"]),
)
METHOD = st.sampled_from(["GET", "POST", "OPTIONS", "HEAD", "PUT", "DELETE", "TRACE", "CONNECT", "PATCH", "get", "G\x00T", "BREW"])
HEADER = st.tuples(st.sampled_from(["x-request-id", "content-length", "transfer-encoding", "host", "x-forwarded-for",
                                    "authorization", "x-odd\r\nx-injected"]),
                   st.one_of(*[st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)] * 3,
                             st.binary(max_size=40).map(lambda b: b.decode("latin-1"))))


def exchange(port: int, request: bytes) -> tuple[int | None, dict[bytes, bytes], bytes]:
    """Send raw bytes; return the status (None if the server closed without one), headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    return (int(match[1]) if match else None), headers, body


def audit_lines_of(gw: RunningGateway, request_id: str) -> int:
    return sum(1 for record in gw.audit_records() if record["request_id"] == request_id)


@FUZZ
@given(method=METHOD, path=PATH, headers=st.lists(HEADER, max_size=2), authorised=st.booleans())
@example(method="OPTIONS", path="*", headers=[], authorised=True)
@example(method="GET", path="/v1/models%0d%0aX-Injected:%201", headers=[], authorised=True)
@example(method="POST", path="/v1/%2e%2e/metrics", headers=[], authorised=True)
@example(method="TRACE", path="/readyz", headers=[], authorised=False)  # found by a 500-example run
def test_nothing_outside_the_allowlist_is_reached(gw: RunningGateway, stub: Any, tally: Counter, method: str,
                                                  path: str, headers: list, authorised: bool):
    stub.requests.clear()
    lines = [f"{method} {path} HTTP/1.1", "host: gateway", "connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    if authorised:
        lines.append(gw.auth("root")["authorization"].join(["authorization: ", ""]))
    request = "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n"
    status, answer, body = exchange(int(gw.url.rsplit(":", 1)[1]), request)
    tally[f"raw-http {status or 'closed'}"] += 1
    for seen in stub.requests:  # whatever reached the engine was on the list, as listed
        assert (seen["method"], seen["path"]) in ALLOWLIST, f"{method} {path!r} reached {seen}"
    assert not LEAKS.search(body.decode("latin-1")), body[:300]
    if status is None:  # the HTTP parser hung up: nothing reached the app
        return
    if status < 400:  # forwarded (so on the list, checked above) or a health probe
        assert stub.requests or body.startswith(b'{"status"'), f"{status} for {method} {path!r}: {body[:200]!r}"
        return
    assert status < 500, f"{status} for {method} {path!r}: {body[:300]!r}"
    if body.startswith(b"{"):  # the gateway answered (not the HTTP parser): OpenAI body, audited once
        assert_openai_error(json.loads(body))
        request_id = answer[b"x-request-id"].decode()
        wait_for(lambda: audit_lines_of(gw, request_id) > 0, 5, f"the audit line of {method} {path!r}")
        assert audit_lines_of(gw, request_id) == 1


# ---- field combinations: each factor within its cap, their product still paid for ----------

TOKEN_PROMPT = st.lists(st.integers(5, 4000), min_size=1, max_size=300)
COMBINED_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(DEMO), "prompt": st.one_of(TOKEN_PROMPT, st.lists(TOKEN_PROMPT, min_size=1, max_size=4),
                                                 st.text(min_size=1, max_size=400))},
    optional={"n": st.integers(1, 4), "echo": st.booleans(), "logprobs": st.integers(0, 20),
              "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), "stream": st.booleans(),
              "guided_choice": st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=8),
              "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4), "ignore_eos": st.booleans()})
COMBINED_CHAT = st.fixed_dictionaries(
    {"model": st.just(DEMO), "messages": USER_MESSAGES},
    optional={"n": st.integers(1, 4), "logprobs": st.just(True), "top_logprobs": st.integers(0, 20),
              "max_tokens": st.integers(1, 4), "stream": st.booleans(), "ignore_eos": st.booleans(),
              "prediction": st.builds(lambda t: {"type": "content", "content": t}, st.text(max_size=400)),
              "response_format": RESPONSE_FORMAT,
              "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                  {"name": st.sampled_from(["lookup", "add"]), "parameters": SCHEMA})}), min_size=1, max_size=2),
              "tool_choice": st.sampled_from(["none", "required", "auto"])})


@settings(FUZZ, max_examples=EXAMPLES or 40)
@given(body=st.one_of(COMBINED_COMPLETION, COMBINED_CHAT))
@example(body={"model": DEMO, "prompt": [[7] * 300] * 4, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 1})
def test_combined_fields_are_refused_or_charged_what_the_engine_counted(gw_fuzz: RunningGateway, tally: Counter,
                                                                       body: dict):
    """Each field within its own cap, in combination (n x prompts x logprobs x echo x prediction
    x grammar x tools): either a clean 4xx naming a field, or served and charged exactly the
    tokens the engine reports (never an estimate, never free)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if body.get("stream"):  # so the usage the engine counted reaches this client too
        body = {**body, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=gw_fuzz.url, headers=gw_fuzz.auth(), timeout=120) as client:
        before = len(gw_fuzz.audit_records())
        response = send(client, path, json.dumps(body).encode(), tally)
        assert_clean(response)
    wait_for(lambda: len(gw_fuzz.audit_records()) > before, 10, "the request's audit line")
    record = gw_fuzz.audit_records()[-1]
    if response.status_code >= 400:
        assert 400 <= response.status_code < 500 and record["status"] == response.status_code
        return
    usage = _usage(response)
    assert usage is not None, "a served request must report its usage"
    assert not record["tokens_estimated"]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])


def _usage(response: httpx.Response) -> dict | None:
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.json().get("usage")
    chunks = [json.loads(e[len("data: "):]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    return next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
