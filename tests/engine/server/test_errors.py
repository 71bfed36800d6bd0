"""Every refusal answers its status with OpenAI's error body, and nothing a client sends can
cause a 500."""
from __future__ import annotations

import pytest

from tests.support.openai_errors import assert_error

TOKEN = "test-internal-token"  # as the conftest sets it

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def http(server):
    with server.http() as c:
        yield c


@pytest.mark.parametrize("path, method", [("/v1/models", "GET"), ("/v1/completions", "POST"), ("/metrics", "GET"),
                                          ("/tokenize", "POST"), ("/version", "GET"), ("/admin/shutdown", "POST")])
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_401_everywhere_but_health(server, path, method, token):
    with server.http(token=token) as c:
        r = c.request(method, path, json=COMPLETION if method == "POST" else None)
        err = assert_error(r, 401)
        assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200


def test_token_scheme_is_case_insensitive_and_other_schemes_fail(server):
    with server.http(token=None) as c:
        assert c.get("/v1/models", headers={"authorization": f"bearer {TOKEN}"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": f"Basic {TOKEN}"}).status_code == 401
        assert c.get("/v1/models", headers={"authorization": TOKEN}).status_code == 401


def test_unknown_routes_and_methods(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    for hidden in ("/docs", "/openapi.json", "/redoc"):
        assert http.get(hidden).status_code == 404


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\"text\"", b"", b"\xff\xfe"])
def test_malformed_bodies_are_400(http, content):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert_error(http.post(path, content=content, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("max_tokens", "many"), ("n", 1.5), ("stop", 5), ("prompt", {"a": 1}),
    ("prompt", [1, "a"]), ("stream", {"yes": 1}), ("seed", 2**70), ("logit_bias", [1]), ("stream_options", 3),
    ("top_k", "x"), ("stop_token_ids", ["a"]), ("cache_salt", 7), ("priority", "high"),
])
def test_wrong_types_are_400_naming_the_field(http, field, value):
    assert_error(http.post("/v1/completions", json={**COMPLETION, field: value}), 400, param=field)


@pytest.mark.parametrize("body", [
    {**CHAT, "messages": "hi"}, {**CHAT, "messages": []}, {**CHAT, "messages": [{"content": "no role"}]},
    {**CHAT, "messages": [{"role": "user", "content": 5}]}, {"model": MODEL_NAME},
])
def test_bad_chat_bodies_are_400(http, body):
    assert_error(http.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_k", -5), ("n", 0), ("n", 1000), ("max_tokens", 0),
    ("min_tokens", 5), ("stop", [""]),
])
def test_invalid_values_are_400(http, field, value):
    body = {**COMPLETION, field: value}
    assert_error(http.post("/v1/completions", json=body), 400, param=field)


def test_prompt_plus_max_tokens_over_the_context_says_both_numbers(server, http):
    n_prompt = len(server.state.tokenizer.encode("hello"))
    err = assert_error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": 600}), 400, param="max_tokens")
    assert all(str(x) in err["message"] for x in (512, 600, n_prompt))
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 600}), 400,
                 param="max_tokens", says=("512", "600"))
    long_prompt = list(range(5, 600))
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt}), 400, param="prompt",
                 says=("512", "595"))


@pytest.mark.parametrize("extra, param", [
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"1": 200}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"top_k": -5}, "top_k"),
])
def test_sampling_params_refusals_reach_the_client_with_their_field(http, extra, param):
    """SamplingParams' own checks (the server does not repeat them) name their field through
    RequestError.param, not through the message's wording."""
    assert_error(http.post("/v1/completions", json={**COMPLETION, **extra}), 400, param=param, says=(param,))


def test_engine_refusals_reach_the_client_with_their_field(http):
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 99999]}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": list(range(5, 600)), "max_tokens": 600}),
                 400, param="prompt", says=("512", "595"))


def test_bad_token_ids_and_empty_prompts(http):
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 99999]}), 400, says=("token ids",))
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": []}), 400)
    assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [[]]}), 400, says=("empty",))
    assert_error(http.post("/detokenize", json={"tokens": [1, -1]}), 400, param="tokens")


def test_stream_options_without_stream(http):
    body = {**COMPLETION, "stream_options": {"include_usage": True}}
    assert_error(http.post("/v1/completions", json=body), 400, param="stream_options")
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "stream": False, "stream_options": {}}), 400,
                 param="stream_options")


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = assert_error(http.post(path, json={**body, "model": "gpt-4o"}), 404, param="model", says=("gpt-4o",))
        assert err["code"] == "model_not_found"


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),  # the legacy form of tools
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "priority", 1),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "use_beam_search", True),
])
def test_unsupported_fields_are_400_naming_the_field(http, path, field, value):
    body = COMPLETION if path == "/v1/completions" else CHAT
    assert_error(http.post(path, json={**body, field: value}), 400, param=field, says=(field,))


def test_default_values_of_every_field_are_accepted(http):
    defaults = {"presence_penalty": 0, "frequency_penalty": 0, "n": 1, "logit_bias": {}, "user": "someone",
                "response_format": {"type": "text"}, "repetition_penalty": 1.0, "min_p": 0, "best_of": 1,
                "priority": 0, "stream": False, "seed": None, "stop": None, "echo": False, "logprobs": None,
                "suffix": None, "some_future_openai_field": {"x": 1}}
    assert http.post("/v1/completions", json={**COMPLETION, **defaults}).status_code == 200
    chat = {**{k: v for k, v in defaults.items() if k not in ("echo", "suffix", "best_of")},
            "logprobs": False, "top_logprobs": 0, "tool_choice": "none", "parallel_tool_calls": True,
            "store": False, "metadata": {"a": "b"}}
    assert http.post("/v1/chat/completions", json={**CHAT, **chat}).status_code == 200


def test_what_guidellm_sends_is_accepted(http):
    body = {**CHAT, "max_completion_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_overload_is_503_with_retry_after(server_factory):
    busy = server_factory(engine={"max_num_seqs": 1}, max_waiting=1)
    long = {**COMPLETION, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with busy.http() as a, busy.http() as b, busy.http() as c:
        with a.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep it: a collected iterator closes the connection
            next(lines)  # it is running now
            with b.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # queued behind it
                r = c.post("/v1/completions", json=COMPLETION)
                assert_error(r, 503)
                assert r.headers["retry-after"] == "1"
                assert busy.core.num_running == 1 and next(lines) is not None  # still streaming
                # A prompt that can never fit is the client's error, not a reason to retry.
                too_long = c.post("/v1/completions", json={**COMPLETION, "prompt": "hello " * 5000})
                assert_error(too_long, 400, param="prompt")


def test_dead_engine_ends_streams_with_an_error_and_answers_503(server_factory):
    doomed = server_factory()
    long = {**COMPLETION, "max_tokens": 300, "stream": True, "ignore_eos": True}

    def lost(*_):
        raise RuntimeError("device lost")

    with doomed.http() as http:
        with http.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            next(lines)
            doomed.core.step = lost  # the next step fails
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and "(RuntimeError)" in rest[-2]
        assert "device lost" not in rest[-2]  # the log has the message; clients hear its type
        assert_error(http.get("/health"), 503)
        assert_error(http.post("/v1/completions", json=COMPLETION), 503, says=("not",))


def test_served_engine_exits_when_its_loop_dies(server_model, tmp_path):
    # What `portcullis engine` runs: serve() returns once the engine loop has died (the CLI then
    # exits 1), so a supervisor restarts it instead of a server that answers 503 forever.
    import threading

    import httpx

    from portcullis.engine.config import EngineConfig
    from portcullis.engine.core.engine_core import EngineCore
    from portcullis.engine.server import ServerSettings, create_app
    from portcullis.engine.server.run import bind_unix_socket, serve

    core = EngineCore(EngineConfig(model=str(server_model), max_model_len=512, kv_cache_memory=32 << 20))
    app = create_app(core, ServerSettings(served_model_names=[MODEL_NAME], token=TOKEN))
    uds = tmp_path / "engine.sock"
    engine = app.state.server.engine
    runner = threading.Thread(target=serve, args=(app, bind_unix_socket(uds)), kwargs={"engine": engine}, daemon=True)
    runner.start()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://engine",
                        headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    for _ in range(500):
        if uds.exists() and engine.is_alive:
            break
        threading.Event().wait(0.02)
    long = {**COMPLETION, "max_tokens": 300, "stream": True, "ignore_eos": True}

    def lost(*_):
        raise RuntimeError("device lost")

    with http, http.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        next(lines)
        core.step = lost
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"error"' in rest[-2] and "(RuntimeError)" in rest[-2]  # the client was told first
    runner.join(30)
    assert not runner.is_alive(), "the server kept running with a dead engine"
    assert isinstance(engine.failure, RuntimeError) and not uds.exists()
