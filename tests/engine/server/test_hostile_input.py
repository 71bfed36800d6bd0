"""Hostile request fields (issue 13's red-team findings 3, 5, 6, 13 and 15, engine side): a
client cannot run its own template code, fan one request out past the engine's batch, stall
other tenants with huge lists, crash a route with deep JSON, or collide with another request's
id. Each refusal is a 400 with OpenAI's error body naming the field and the limit."""
from __future__ import annotations

import json
import threading
import time

import pytest

from portcullis.protocol import caps
from portcullis.protocol.json_body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH
from portcullis.protocol.requests import MAX_PROMPT_LOGPROB_ENTRIES
from tests.support.openai_errors import assert_error as assert_openai_error

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LOOPING_TEMPLATE = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"


def assert_error(r, status: int, *, param: str | None = None, says: tuple[str, ...] = ()) -> dict:
    err = assert_openai_error(r, status, param=param, says=says)
    assert err["type"] == "invalid_request_error"
    return err


@pytest.fixture
def http(server):
    with server.http() as c:
        yield c


# -- finding 3: a client's chat template never runs ------------------------------------------------

@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})])
@pytest.mark.parametrize("key", ["chat_template", "tools", "documents", "conversation", "anything_else"])
def test_template_kwargs_outside_the_allowlist_are_refused_by_name(http, path, body, key):
    kwargs = {key: LOOPING_TEMPLATE if key == "chat_template" else [{"x": 1}]}
    err = assert_error(http.post(path, json={**body, "chat_template_kwargs": kwargs}), 400,
                       param="chat_template_kwargs", says=(repr(key), "enable_thinking"))
    assert all(name in err["message"] for name in caps.CHAT_TEMPLATE_KWARGS)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})])
def test_a_top_level_chat_template_is_refused(http, path, body):
    assert_error(http.post(path, json={**body, "chat_template": LOOPING_TEMPLATE}), 400, param="chat_template",
                 says=("model's own chat template",))


@pytest.mark.parametrize("value", [{"a": 1}, ["x"], "x" * (caps.MAX_TEMPLATE_KWARG_CHARS + 1)])
def test_allowed_template_kwargs_take_only_short_scalars(http, value):
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": value}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="chat_template_kwargs",
                 says=("enable_thinking",))


def test_allowed_template_kwargs_still_work(http):
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "add_vision_id": None}
    assert http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs}).status_code == 200
    r = http.post("/tokenize", json={"messages": CHAT["messages"], "chat_template_kwargs": kwargs})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_tokenize_takes_tools_at_the_top_level_as_the_chat_route_renders_them(server, http):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    counted = http.post("/tokenize", json={"messages": CHAT["messages"], "tools": tools}).json()["count"]
    chat = http.post("/v1/chat/completions", json={**CHAT, "tools": tools}).json()
    assert counted == chat["usage"]["prompt_tokens"]


# -- findings 5 and 6: caps on what one request may ask for ---------------------------------------

@pytest.mark.parametrize("field, value, cap", [
    ("stop", ["x"] * (caps.MAX_STOP_STRINGS + 1), caps.MAX_STOP_STRINGS),
    ("stop", "y" * (caps.MAX_STOP_CHARS + 1), caps.MAX_STOP_CHARS),
    ("stop_token_ids", list(range(caps.MAX_STOP_TOKEN_IDS + 1)), caps.MAX_STOP_TOKEN_IDS),
    ("bad_words", ["word"] * (caps.MAX_BAD_WORDS + 1), caps.MAX_BAD_WORDS),
    ("bad_words", ["w" * (caps.MAX_BAD_WORD_CHARS + 1)], caps.MAX_BAD_WORD_CHARS),
    ("logit_bias", {str(i): 1 for i in range(caps.MAX_LOGIT_BIAS + 1)}, caps.MAX_LOGIT_BIAS),
    ("allowed_token_ids", list(range(caps.MAX_ALLOWED_TOKEN_IDS + 1)), caps.MAX_ALLOWED_TOKEN_IDS),
    ("guided_choice", [f"c{i}" for i in range(caps.MAX_CHOICES + 1)], caps.MAX_CHOICES),
    ("guided_choice", ["yes", "n" * (caps.MAX_CHOICE_CHARS + 1)], caps.MAX_CHOICE_CHARS),
    ("guided_choice", ["c" * caps.MAX_CHOICE_CHARS] * (caps.MAX_CHOICES_CHARS // caps.MAX_CHOICE_CHARS + 1),
     caps.MAX_CHOICES_CHARS),
    ("logprobs", caps.MAX_LOGPROBS + 1, caps.MAX_LOGPROBS),
    ("n", caps.MAX_N + 1, caps.MAX_N),
])
def test_completion_fields_over_their_cap_are_400_naming_field_and_cap(http, field, value, cap):
    assert_error(http.post("/v1/completions", json={**COMPLETION, field: value}), 400, param=field,
                 says=(field, str(cap)))


@pytest.mark.parametrize("field, value, cap", [
    ("messages", [{"role": "user", "content": "x"}] * (caps.MAX_MESSAGES + 1), caps.MAX_MESSAGES),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(caps.MAX_TOOLS + 1)],
     caps.MAX_TOOLS),
    ("top_logprobs", caps.MAX_LOGPROBS + 1, caps.MAX_LOGPROBS),
    ("structured_outputs", {"choice": ["a"] * (caps.MAX_CHOICES + 1)}, caps.MAX_CHOICES),
    ("structured_outputs", {"choice": ["a" * (caps.MAX_CHOICE_CHARS + 1)]}, caps.MAX_CHOICE_CHARS),
    ("structured_outputs", {"regex": "a" * (caps.MAX_GRAMMAR_CHARS + 1)}, caps.MAX_GRAMMAR_CHARS),
])
def test_chat_fields_over_their_cap_are_400_naming_field_and_cap(http, field, value, cap):
    body = {**CHAT, field: value, "logprobs": True}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=field, says=(field, str(cap)))


def test_the_red_team_sizes_are_refused(http):
    assert_error(http.post("/v1/completions", json={**COMPLETION, "stop": ["z" * 3000] * 100}), 400, param="stop")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "stop_token_ids": [7] * 1_500_000}), 400,
                 param="stop_token_ids")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "bad_words": ["hello"] * 50_000, "n": 8}), 400,
                 param="bad_words")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "n": 64, "logprobs": 21}), 400, param="logprobs")


def test_caps_allow_what_clients_really_send(http):
    body = {**COMPLETION, "stop": ["\n\n", "```", "<|endoftext|>", "/src/", "#", "def ", "class ", "\r\n\r\n"],
            "logprobs": caps.MAX_LOGPROBS, "n": 2, "stop_token_ids": [1, 2, 3]}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_sequences_of_one_request_are_bounded_by_the_engines_batch(server_factory):
    small = server_factory(engine={"max_num_seqs": 8})
    with small.http() as http:
        err = assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"], "n": 3}),
                           400, param="n", says=("9 sequences", "3 prompts", "8", "--max-num-seqs"))
        assert "n=3" in err["message"]
        assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["p"] * 9}), 400, param="prompt",
                     says=("9 sequences",))
        assert_error(http.post("/v1/chat/completions", json={**CHAT, "n": 9}), 400, param="n")
        ok = http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "n": 4})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
        assert small.core.num_waiting == 0 and small.core.num_running == 0


# -- finding 6: heavy but allowed work happens once, off the event loop --------------------------

def test_health_answers_while_a_request_is_being_prepared(server_factory):
    """bad_words are tokenized in the tokenizer thread, once per request: while that is slow (held
    here on purpose), the event loop still answers /health and other routes."""
    srv = server_factory()
    tok = srv.state.tokenizer
    release, entered, calls = threading.Event(), threading.Event(), []
    real_encode = tok.encode

    def slow_encode(text, *a, **kw):
        if text.strip() == "the":
            calls.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
        return real_encode(text, *a, **kw)

    tok.encode = slow_encode
    result: dict = {}
    body = {**COMPLETION, "prompt": "x y z", "bad_words": ["the"], "n": 8}

    def send() -> None:
        with srv.http() as c:
            result["r"] = c.post("/v1/completions", json=body)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert entered.wait(30), "the request never reached bad_words"
        with srv.http(timeout=5) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 200
    finally:
        release.set()
        sender.join(60)
        tok.encode = real_encode
    assert result["r"].status_code == 200, result["r"].text
    assert len(result["r"].json()["choices"]) == 8
    assert len(calls) == 2, "bad_words were tokenized per choice"  # the word, and " " + word, once
    assert all(name.startswith("tokenizer") for name in calls)


def test_tenants_take_turns_on_the_tokenizer_thread(server_factory):
    """Issue 29: one tenant's queue of slow tokenizations delays another tenant's request by one
    of them, not by all of them. Each hostile prompt is held in the tokenizer for a while; the
    victim, sent after all of them, is answered while most are still waiting."""
    srv = server_factory()
    tok = srv.state.tokenizer
    real_encode, done, lock = tok.encode, [], threading.Lock()

    def slow_encode(text, *a, **kw):
        if text.startswith("hostile"):
            time.sleep(0.4)
        return real_encode(text, *a, **kw)

    def send(tenant: str, prompt: str) -> None:
        with srv.http() as c:
            status = c.post("/tokenize", json={"prompt": prompt}, headers={"x-portcullis-tenant": tenant}).status_code
        with lock:
            done.append((tenant, status))

    tok.encode = slow_encode
    try:
        hostile = [threading.Thread(target=send, args=("hostile", f"hostile {i}")) for i in range(8)]
        for t in hostile:
            t.start()
        wait_until(lambda: srv.state.tokenizer_pool.queued >= 6)
        send("victim", "hello")
        for t in hostile:
            t.join(60)
    finally:
        tok.encode = real_encode
    assert ("victim", 200) in done and sorted(done)[-1] == ("victim", 200)
    assert done.index(("victim", 200)) <= 2, done  # behind the one running, at most one more
    assert done.count(("hostile", 200)) == 8


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- finding 13: deep JSON ------------------------------------------------------------------------

@pytest.mark.parametrize("raw,says", [
    # As deep as it is many: refused on its count of arrays, before any parse.
    (b"[" * 100_000 + b"]" * 100_000, ("arrays and objects", str(MAX_JSON_CONTAINERS))),
    (b'{"model":"tiny-llama","prompt":"x","metadata":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     ("arrays and objects", str(MAX_JSON_CONTAINERS))),
    (b'{"model":"tiny-llama","prompt":"x","metadata":' + b"[" * 500 + b"]" * 500 + b"}", ("nested", str(MAX_JSON_DEPTH))),
])
def test_deeply_nested_json_is_a_400_saying_so(http, raw, says):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, says=says)


# -- second review, finding 1: a body of many small containers ---------------------------------------

def test_a_body_of_many_containers_is_refused_before_it_is_parsed(http, monkeypatch):
    """380,000 `[[]]` in an extra field kept the event loop parsing for seconds; the count of
    arrays and objects is checked on the raw bytes first. Brackets inside strings (code) do not count."""
    import json

    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append(1) or real_loads(*a, **k))
    bomb = b'{"model":"tiny-llama","prompt":"x","extra":[' + b",".join([b"[[]]"] * 380_000) + b"]}"
    r = http.post("/v1/completions", content=bomb, headers={"content-type": "application/json"})
    assert not parsed  # refused on the bytes (before the test's own reading of the answer)
    assert_error(r, 400, says=("arrays and objects", str(MAX_JSON_CONTAINERS)))
    code = "x = [a[i] for i in b[0]] + [{k: v} for k in d]\n" * 4_000  # 20,000 brackets, all in a string
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": code[:400], "max_tokens": 1,
                                           "suffix_unused": code})
    assert r.status_code == 200, r.text


def test_a_deep_json_schema_never_reaches_the_grammar_compiler(http):
    # 450 nested objects took the grammar compiler 10 s, holding the tokenizer thread for everyone.
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, says=("nested",))
    shallow = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    body["response_format"]["json_schema"]["schema"] = shallow
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# -- finding 15: a reused x-request-id ------------------------------------------------------------

def test_two_requests_with_the_same_request_id_both_succeed(server):
    long = {**COMPLETION, "max_tokens": 300, "stream": True, "ignore_eos": True}
    with server.http() as a, server.http() as b:
        with a.stream("POST", "/v1/completions", json=long, headers={"x-request-id": "dup-1"}) as first:
            lines = first.iter_lines()
            next(lines)
            r = b.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "dup-1"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "dup-1" and first.headers["x-request-id"] == "dup-1"
            assert r.json()["id"] == "cmpl-dup-1"
            assert next(line for line in lines if line).startswith("data: {")  # the first still streams


# -- finding 6: a slow grammar compile holds up only other grammars -----------------------------

def test_plain_requests_are_served_while_a_grammar_compiles(server_factory):
    """A big JSON Schema takes the grammar compiler seconds (5,000 properties: 4 s); it compiles
    in its own thread, so other tenants' tokenization, and their requests, go on meanwhile."""
    srv = server_factory()
    state = srv.state  # the front-end owns grammar compilation
    release, entered = threading.Event(), threading.Event()
    real_compile = state.compile_grammar

    def slow_compile(params):
        entered.set()
        release.wait(30)
        return real_compile(params)

    state.compile_grammar = slow_compile
    result: dict = {}
    constrained = {**CHAT, "response_format": {"type": "json_object"}}

    def send() -> None:
        with srv.http() as c:
            result["r"] = c.post("/v1/chat/completions", json=constrained)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert entered.wait(30), "the constrained request never reached the grammar compiler"
        with srv.http(timeout=10) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200
    finally:
        release.set()
        sender.join(60)
        state.compile_grammar = real_compile
    assert result["r"].status_code == 200, result["r"].text


@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/completions", COMPLETION, "stream", 1),  # the review: streamed past the gateway's token count
    ("/v1/completions", COMPLETION, "stream", "true"),
    ("/v1/chat/completions", CHAT, "stream", 1),
    ("/v1/chat/completions", CHAT, "logprobs", 1),
    ("/v1/completions", COMPLETION, "echo", "yes"),
    ("/v1/completions", COMPLETION, "n", 2.0),
    ("/v1/completions", COMPLETION, "max_tokens", "2"),
    ("/v1/chat/completions", CHAT, "temperature", "0.5"),
    ("/v1/chat/completions", CHAT, "stream_options", {"include_usage": 1}),
])
def test_fields_take_their_json_type_only(http, path, body, field, value):
    """As the gateway does: a value the two would read differently (1 as a boolean) is a 400,
    so what the gateway charged for is what the engine runs."""
    assert_error(http.post(path, json={**body, field: value}), 400)


def test_json_numbers_of_the_other_kind_still_pass_where_openai_takes_them(http):
    assert http.post("/v1/completions", json={**COMPLETION, "temperature": 1, "top_p": 1,
                                               "logit_bias": {"5": -100}}).status_code == 200


def test_a_request_larger_than_the_waiting_queue_is_a_400_not_a_503_for_ever(server_factory):
    small_queue = server_factory(engine={"max_num_seqs": 8}, max_waiting=4)
    with small_queue.http() as http:
        assert_error(http.post("/v1/completions", json={**COMPLETION, "n": 5}), 400, param="n",
                     says=("5 sequences", "at most 4"))
        assert http.post("/v1/completions", json={**COMPLETION, "n": 4}).status_code == 200


# -- issue 29, finding 5: a grammar costs what its size allows ----------------------------------

def _no_compile(monkeypatch, server) -> list:
    """The grammar compiler's calls: a refusal must come before any compile."""
    calls: list = []
    real = server.state.compile_grammar
    monkeypatch.setattr(server.state, "compile_grammar", lambda params: calls.append(params) or real(params))
    return calls


def test_the_red_team_choice_lists_are_refused_before_any_compile(server, http, monkeypatch):
    # 256 unique ~410-character choices (105 KB): 4 s of the grammar thread and 28 MB of
    # compiled grammar each, kept for ever; five of them grew the engine by 480 MB.
    calls = _no_compile(monkeypatch, server)
    rng = __import__("random").Random(29)
    choices = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=410)) for _ in range(256)]
    assert_error(http.post("/v1/completions", json={**COMPLETION, "guided_choice": choices}), 400,
                 param="guided_choice")
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "structured_outputs": {"choice": choices}}), 400,
                 param="structured_outputs")
    # Under the per-choice cap but over the total: 256 x 200 characters.
    short = [c[:200] for c in choices]
    assert_error(http.post("/v1/completions", json={**COMPLETION, "guided_choice": short}), 400,
                 param="guided_choice", says=("characters",))
    assert calls == []


@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/completions", COMPLETION, "guided_regex", "(" + "|".join(f"word{i:06d}" for i in range(15_000)) + ")"),
    ("/v1/completions", COMPLETION, "guided_grammar",
     "root ::= " + " | ".join(f'"w{i:06d}"' for i in range(15_000))),
    ("/v1/completions", COMPLETION, "guided_json",
     {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(4_500)}}),
    ("/v1/chat/completions", CHAT, "response_format",
     {"type": "json_schema", "json_schema": {"name": "big", "schema": {
         "type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(4_500)}}}}),
    ("/v1/chat/completions", CHAT, "structured_outputs", {"regex": "a" * 150_000}),
])
def test_grammars_past_the_size_cap_are_refused_before_any_compile(server, http, monkeypatch, path, body, field,
                                                                   value):
    calls = _no_compile(monkeypatch, server)
    assert_error(http.post(path, json={**body, field: value}), 400, param=field,
                 says=("characters", str(caps.MAX_GRAMMAR_CHARS)))
    assert calls == []


def test_choices_and_grammars_at_their_caps_still_compile(http):
    longest = [f"{i:03d}" + "c" * (caps.MAX_CHOICE_CHARS - 3) for i in range(caps.MAX_CHOICES_CHARS
                                                                              // caps.MAX_CHOICE_CHARS)]
    r = http.post("/v1/completions", json={**COMPLETION, "guided_choice": longest, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json={**COMPLETION, "guided_choice": ["positive", "negative"]}).status_code == 200
    regex = "(" + "|".join(f"w{i:05d}" for i in range(caps.MAX_GRAMMAR_CHARS // 7 - 1)) + ")"
    assert len(regex) <= caps.MAX_GRAMMAR_CHARS
    assert http.post("/v1/completions", json={**COMPLETION, "guided_regex": regex}).status_code == 200


# -- second review, finding 3: a product of capped factors ----------------------------------------

def test_echoed_prompt_logprobs_are_capped_as_a_product(http):
    """Each factor was capped, their product not: 4 samples x 4 prompts x 1,000 tokens x 21
    logprobs built an 8 MB body in one piece and stalled every tenant for seconds."""
    body = {"model": "tiny-llama", "prompt": [[7] * 400] * 4, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert_error(r, 400, says=("prompt logprobs", str(MAX_PROMPT_LOGPROB_ENTRIES)))
    assert r.json()["error"]["param"] == "logprobs"
    lm_eval = {"model": "tiny-llama", "prompt": [[7] * 400], "echo": True, "logprobs": 1, "max_tokens": 1}
    r = http.post("/v1/completions", json=lm_eval)  # what lm-eval's loglikelihood sends: still served
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 401


# -- second review, finding 2: a prompt too long to fit, tokenized anyway -------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x" * 3_500_000}),
    ("/v1/completions", {"prompt": ["short", "y" * 3_500_000]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 3_500_000}]}]}),
    ("/tokenize", {"prompt": "x" * 3_500_000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 3_500_000}]}),
])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_the_tokenizer(server, http, path, body):
    """A 3.5 MB prompt held the one tokenizer thread (every tenant's) for 5-10 s before its 400.
    No text longer than the context times the longest token can fit: refused on its length."""
    calls = []
    tokenizer = server.state.tokenizer
    real_encode = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or real_encode(*a, **k)
    try:
        r = http.post(path, json={"model": "tiny-llama", **body})
    finally:
        del tokenizer.encode
    assert_error(r, 400, says=("characters", "context"))
    assert not calls


def test_the_model_card_gives_the_longest_token_the_gateway_measures_by(server, http):
    """The gateway refuses longer text itself, from the card (tests/gateway/test_requests.py)."""
    longest = max(map(len, server.state.tokenizer.get_vocab()))
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_token_chars"] == longest and card["max_model_len"] == server.state.max_model_len


def test_a_long_prompt_that_may_fit_is_still_tokenized(server, http):
    longest = server.state.max_token_chars
    fits = "x" * (server.state.max_model_len * longest)  # at the bound: the tokenizer decides
    r = http.post("/tokenize", json={"model": "tiny-llama", "prompt": fits[: 8 * longest]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": fits, "truncate_prompt_tokens": 8,
                                           "max_tokens": 1})
    assert r.status_code == 200, r.text  # truncation keeps the end: any length may be asked for


def test_samples_share_one_scoring_of_their_prompt(server, http):
    """Issue 29, finding 3: each of `n` samples used to score the whole prompt again (n prefills,
    paid for as one). Now the first scores it, the others take its blocks from the prefix cache,
    and every choice still shows the same prompt logprobs as a single sample does."""
    stats = server.core.scheduler.stats
    prompt = [(7 * i) % 500 + 3 for i in range(200)]  # long enough for whole blocks to share
    body = {"model": "tiny-llama", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1,
            "temperature": 0}
    one = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    computed = stats.num_computed_tokens
    choices = http.post("/v1/completions", json={**body, "n": 4, "prompt": [prompt[::-1]]}).json()["choices"]
    fed = stats.num_computed_tokens - computed
    assert fed < 2 * len(prompt), fed  # one prompt's worth and the samples' last tokens, not four
    reversed_one = http.post("/v1/completions", json={**body, "prompt": prompt[::-1]}).json()["choices"][0]["logprobs"]
    for choice in choices:
        shown = choice["logprobs"]
        assert shown["token_logprobs"][:len(prompt)] == reversed_one["token_logprobs"][:len(prompt)]
        assert shown["top_logprobs"][:len(prompt)] == reversed_one["top_logprobs"][:len(prompt)]
    assert one["token_logprobs"][0] is None and len(one["token_logprobs"]) == len(prompt) + 1
    # Streamed, each choice's echoed prompt carries them too (the first sample's reach the others).
    with http.stream("POST", "/v1/completions", json={**body, "n": 3, "stream": True, "prompt": [prompt[::-1]]}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    echoed = {}
    for event in events:
        for choice in event["choices"]:
            echoed.setdefault(choice["index"], choice["logprobs"]["token_logprobs"])
    assert sorted(echoed) == [0, 1, 2]
    assert all(lps[: len(prompt)] == reversed_one["token_logprobs"][: len(prompt)] for lps in echoed.values())


def test_vllm_prompt_logprobs_count_toward_the_same_product(http):
    """`prompt_logprobs` (vLLM's) builds the same prompt-sized answer as echo with logprobs, on
    completions and on chat: one cap for both (found by review after finding 3's fix)."""
    body = {"model": "tiny-llama", "prompt": [[7] * 400] * 4, "n": 4, "prompt_logprobs": 20, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert_error(r, 400, says=("prompt logprobs", str(MAX_PROMPT_LOGPROB_ENTRIES)))
    assert r.json()["error"]["param"] == "prompt_logprobs"


def test_a_batch_is_bounded_prompt_by_prompt_and_an_empty_id_prompt_is_refused(server, http):
    each = "x" * (server.state.max_model_len * server.state.max_token_chars // 2)  # each may fit; all would not
    r = http.post("/tokenize", json={"model": "tiny-llama", "prompt": each[:64]})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [each[:300]] * 3, "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [each, each, each], "max_tokens": 1})
    assert "characters" not in r.text  # refused, if at all, by the tokenizer's count: not by the sum
    assert_error(http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [[]], "max_tokens": 1}),
                 400, says=("empty",))


def test_a_body_that_is_not_utf8_is_refused_before_it_is_parsed(http):
    bomb = ('{"a":"\\"","b":[' + ",".join(["[[]]"] * 20_000) + '],"c":""}').encode("utf-16")  # counted as few
    r = http.post("/v1/completions", content=bomb, headers={"content-type": "application/json"})
    assert_error(r, 400, says=("UTF-8",))
