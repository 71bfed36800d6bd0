"""End to end with the real engine (`python -m portcullis.engine` on a Unix socket, a tiny random-weight
Llama from the shared fixtures) and the official `openai` client in front of the gateway."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from portcullis.engine.server.identity import weights_sha256

from .conftest import ENGINE_TOKEN, base_policy

MODEL = "tiny"
STARTUP_S = 180


def _wait_healthy(sock: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    transport = httpx.HTTPTransport(uds=str(sock))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the engine exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with httpx.Client(transport=transport, timeout=2) as client:
                if client.get("http://engine/health").status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the engine did not become healthy in {STARTUP_S} s:\n{log.read_text()[-3000:]}")


def _engine(model: Path, *flags: str, names: tuple[str, ...] = (MODEL,)) -> Iterator[Path]:
    """`python -m portcullis.engine MODEL` on a Unix socket until the generator is closed; yields the socket."""
    folder = Path(tempfile.mkdtemp(prefix="ptc-engine-"))  # short: socket paths max out at 108
    (folder / "token").write_text(ENGINE_TOKEN)
    sock, log = folder / "engine.sock", folder / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "portcullis.engine", str(model), "--uds", str(sock), "--token-file",
             str(folder / "token"), "--served-model-name", *names, "--kv-cache-memory", "64MiB",
             "--max-model-len", "512", *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        _wait_healthy(sock, proc, log)
        yield sock
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def real_engine(llama_model: Path) -> Iterator[Path]:
    # Priority scheduling, so the priority the gateway sets is taken (an fcfs engine refuses it).
    yield from _engine(llama_model, "--scheduling-policy", "priority")


@pytest.fixture(scope="module")
def pooling_engine(llama_model: Path) -> Iterator[Path]:
    yield from _engine(llama_model, "--runner", "pooling")


@pytest.fixture
def gw_real(gateways, real_engine):
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [MODEL]
    policy["principals"]["bob"]["models"] = ["demo"]
    return gateways.start(policy, engine_url=f"unix://{real_engine}")


def _client(gw, who="alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.keys[who], max_retries=0)


async def test_openai_client_through_gateway_to_engine(gw_real, llama_model):
    client = _client(gw_real)
    assert [m.id async for m in client.models.list()] == [MODEL]
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.usage.completion_tokens == 4 and chat.usage.prompt_tokens > 0
    text = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=3)
    assert text.usage.completion_tokens == 3
    records = await gw_real.wait_audit(3)
    last = records[-1]
    assert (last["status"], last["prompt_tokens"], last["completion_tokens"]) == (200, text.usage.prompt_tokens, 3)
    assert last["cached_tokens"] is not None  # the engine's prompt_tokens_details came through
    assert last["model_weights_sha256"] == weights_sha256(llama_model)  # which weights answered


async def test_streaming_through_gateway_with_and_without_usage(gw_real):
    client = _client(gw_real)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
    chunks = [c async for c in stream]
    assert chunks and all(c.choices for c in chunks)  # the usage chunk the gateway asked for is gone
    record = (await gw_real.wait_audit(1))[-1]
    assert record["stream"] is True and record["completion_tokens"] == 5 and not record["tokens_estimated"]
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


async def test_refusals_reach_the_openai_client_as_openai_errors(gw_real):
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await _client(gw_real, "bob").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert denied.value.code == "model_not_allowed"
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{gw_real.url}/v1", api_key="ptc_nope.nope", max_retries=0
                                 ).models.list()
    with pytest.raises(openai.BadRequestError) as capped:
        await _client(gw_real).completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert capped.value.code == "max_tokens_over_cap"


async def test_engine_metrics_only_for_admins_and_request_ids_flow(gw_real):
    async with gw_real.client() as client:
        response, record = await gw_real.call(client, "GET", "/metrics", headers=gw_real.auth("root"))
        assert response.status_code == 200 and "vllm:" in response.text
        response, _ = await gw_real.call(client, "GET", "/metrics", headers=gw_real.auth("alice"))
        assert response.status_code == 404
        response, record = await gw_real.call(
            client, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers={**gw_real.auth(), "x-request-id": "trace-e2e-1"})
    # The gateway's own id names the engine request and the audit line; the client's is kept beside it.
    assert response.headers["x-request-id"] == record["request_id"] != "trace-e2e-1"
    assert response.headers["x-client-request-id"] == "trace-e2e-1" == record["client_request_id"]


async def test_prompt_cap_applies_to_each_prompt_of_a_batch_and_to_token_ids(gateways, real_engine):
    """A batch of prompts, or prompts given as token ids, is measured prompt by prompt (each is
    its own sequence), not refused with a 503 because /tokenize takes one string."""
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [MODEL]
    policy["defaults"]["max_prompt_tokens"] = 40
    gw = gateways.start(policy, engine_url=f"unix://{real_engine}")
    client = _client(gw)
    short, long = "one two three", " ".join(["word"] * 120)
    batch = await client.completions.create(model=MODEL, prompt=[short, short + " four"], max_tokens=2)
    assert len(batch.choices) == 2
    ids = await client.completions.create(model=MODEL, prompt=[5, 6, 7] * 10, max_tokens=2)
    assert ids.usage.prompt_tokens == 30
    many = await client.completions.create(model=MODEL, prompt=[[5, 6, 7]] * 3, max_tokens=2)
    assert len(many.choices) == 3
    for prompt in ([short, long], [5] * 41, [[5], [6] * 41]):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert refused.value.code == "prompt_too_long" and refused.value.param == "prompt"


# ---- IDE traffic (issue 15 item 5) and priority (issue 16 item 4) ---------------------------

def _ide_policy(**defaults):
    policy = base_policy()
    policy["routes"].append({"method": "POST", "path": "/v1/embeddings"})
    policy["tenants"]["acme"]["models"] = [MODEL]
    policy["tenants"]["acme"]["limits"] = {"tokens_per_minute": 100_000}
    policy["defaults"].update(defaults)
    return policy


async def test_embeddings_through_the_gateway_are_bounded_and_charged_from_usage(gateways, pooling_engine):
    if time.time() % 60 > 45:  # the sliding window weighs the minute before: keep to one minute
        time.sleep(60.5 - time.time() % 60)
    gw = gateways.start(_ide_policy(max_prompt_tokens=40), engine_url=f"unix://{pooling_engine}")
    client = _client(gw)
    result = await client.embeddings.create(model=MODEL, input=["def add(a, b):", "hello"])  # base64 on the wire
    assert len(result.data) == 2 and len(result.data[0].embedding) > 0
    record = (await gw.wait_audit(1))[-1]
    assert (record["route"], record["status"]) == ("/v1/embeddings", 200)
    assert record["prompt_tokens"] == result.usage.prompt_tokens and not record["tokens_estimated"]
    assert await gw.gateway.limiter.tokens_used("tenant:acme") == result.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:  # measured by the engine's own /tokenize
        await client.embeddings.create(model=MODEL, input=["short", " ".join(["word"] * 120)])
    assert refused.value.code == "prompt_too_long" and refused.value.param == "input"


async def test_priority_and_a_suffix_reach_the_engine_as_the_policy_says(gateways, real_engine):
    policy = _ide_policy(max_prompt_tokens=60)
    policy["tenants"]["acme"]["priority"] = 10
    gw = gateways.start(policy, engine_url=f"unix://{real_engine}")
    client = _client(gw)
    done = await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": 0})
    assert done.usage.completion_tokens == 2
    assert (await gw.wait_audit(1))[-1]["priority"] == 10
    # The tiny model has no FIM tokens: the engine's 400 comes through, audited with the hash.
    with pytest.raises(openai.BadRequestError) as no_fim:
        await client.completions.create(model=MODEL, prompt="def f():", suffix="    return 1", max_tokens=2)
    assert no_fim.value.param == "suffix"
    record = (await gw.wait_audit(2))[-1]
    assert record["status"] == 400 and record["suffix_hmac"] and record["priority"] == 10
    # A suffix long enough to be counted: the engine's /tokenize gives the same 400 (a model
    # with FIM tokens has its count checked: test_a_fim_prompt_is_counted_as_the_engine_runs_it).
    with pytest.raises(openai.BadRequestError) as long:
        await client.completions.create(model=MODEL, prompt="def f():", suffix=" ".join(["word"] * 60), max_tokens=2)
    assert long.value.param == "suffix" and "FIM" in long.value.message


# ---- a fleet: two engines behind one gateway (issue 17) ------------------------------------

@pytest.fixture(scope="module")
def second_engine(llama_model: Path) -> Iterator[Path]:
    """The demo model again, answering to `tiny` and to `tiny-b`."""
    yield from _engine(llama_model, "--scheduling-policy", "priority", names=(MODEL, "tiny-b"))


async def test_two_engines_routed_by_model_and_by_prefix(gateways, real_engine, second_engine, llama_model):
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [MODEL, "tiny-b"]
    policy["upstreams"] = [{"name": "a", "url": f"unix://{real_engine}", "models": [MODEL]},
                           {"name": "b", "url": f"unix://{second_engine}", "models": [MODEL, "tiny-b"]}]
    gw = gateways.start(policy, upstream_health_interval_s=0.5)
    client = _client(gw)
    cards = {m.id: m.model_extra["max_model_len"] async for m in client.models.list()}
    assert cards == {MODEL: 512, "tiny-b": 512}
    await client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # The listing is audited too (no upstream): its line, then the completion's.
    records = await gw.wait_audit(2)
    assert [r["route"] for r in records] == ["/v1/models", "/v1/chat/completions"] and records[-1]["upstream"] == "b"
    # Affinity yields to load (a busy owner spills): start from two idle engines, as the module's
    # earlier tests share them (a fresh-clone CI run once saw a prefix spill from leftover load).
    fleet, deadline = gw.gateway.fleet, time.monotonic() + 30
    while any(r.running or r.waiting or r.in_flight for r in fleet.replicas.values()):
        assert time.monotonic() < deadline, {r.name: (r.running, r.waiting, r.in_flight) for r in fleet.replicas.values()}
        await asyncio.sleep(0.1)
    systems = [f"prompt {i}: " + " ".join(f"w{i}{j}" for j in range(60)) for i in range(4)]
    for round_ in range(3):
        for system in systems:
            await client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"q{round_}"}])
    records = (await gw.wait_audit(2 + 12))[-12:]
    by_prompt: dict[int, set[str]] = {}
    for i, record in enumerate(records):
        by_prompt.setdefault(i % 4, set()).add(record["upstream"])
    assert all(len(names) == 1 for names in by_prompt.values()), by_prompt
    assert all(r["cached_tokens"] > 0 for r in records[4:]), [r["cached_tokens"] for r in records]
    assert {r["model_weights_sha256"] for r in records} == {weights_sha256(llama_model)}


async def test_a_cap_holds_whichever_max_tokens_field_a_completion_names(gateways, real_engine):
    """Finding 9 of the second review: `max_completion_tokens` on /v1/completions was capped by the
    gateway but ignored by the engine, which generated its default 16 against a cap of 8. Both read
    the field the same way now (`portcullis.protocol`): either name, on either route."""
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [MODEL]
    policy["defaults"]["max_tokens"] = 8
    gw = gateways.start(policy, engine_url=f"unix://{real_engine}")
    async with gw.client() as client:
        for path, body in (("/v1/completions", {"prompt": "once upon"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for field in ("max_completion_tokens", "max_tokens"):
                response, _ = await gw.call(client, "POST", path, headers=gw.auth(), json={
                    "model": MODEL, **body, field: 8, "ignore_eos": True})
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 8, (path, field)
            response, _ = await gw.call(client, "POST", path, headers=gw.auth(), json={
                "model": MODEL, **body, "max_completion_tokens": 3, "ignore_eos": True})
            assert response.json()["usage"]["completion_tokens"] == 3, path


async def test_tokenize_through_the_gateway_is_charged_the_tokens_it_read(gateways, real_engine):
    """Second review, finding 2: /tokenize cost the engine's tokenizer work and was charged
    nothing, so a key could tokenize without limit. Now it pays the count the engine returns."""
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [MODEL]
    policy["tenants"]["acme"]["limits"] = {"tokens_per_minute": 100_000}
    gw = gateways.start(policy, engine_url=f"unix://{real_engine}")
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/tokenize", headers=gw.auth(),
                                         json={"model": MODEL, "prompt": "count these words " * 20})
    assert response.status_code == 200, response.text
    count = response.json()["count"]
    assert count > 20 and record["prompt_tokens"] == count
    assert await gw.gateway.limiter.tokens_used("tenant:acme") == count


@pytest.fixture(scope="module")
def demo_engine() -> Iterator[Path]:
    from portcullis.engine.assets import DEMO_MODEL_DIR

    yield from _engine(DEMO_MODEL_DIR, names=("demo",))  # a tokenizer with FIM and chat markers


async def test_a_fim_prompt_is_counted_as_the_engine_runs_it(gateways, demo_engine):
    """Second review, finding 6: marker strings in a FIM prefix and suffix are text to the
    completions route (split into many tokens) but were counted by /tokenize as single special
    tokens: 1,753 tokens ran under a cap of 512 (counted 254). The engine's /tokenize now counts
    the FIM prompt itself, as /v1/completions builds it."""
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 512
    gw = gateways.start(policy, engine_url=f"unix://{demo_engine}")
    hostile = {"model": "demo", "prompt": "<|im_start|>" * 200, "suffix": "<|im_end|>" * 50, "max_tokens": 1}
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(), json=hostile)
        assert response.status_code == 400 and record["reason"] == "prompt_too_long", response.text
        fits = {"model": "demo", "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 4}
        response, _ = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(), json=fits)
        assert response.status_code == 200, response.text
        counted = await gw.call(client, "POST", "/tokenize", headers=gw.auth(),
                                json={"model": "demo", "prompt": fits["prompt"], "suffix": fits["suffix"]})
        assert counted[0].json()["count"] == response.json()["usage"]["prompt_tokens"]
        ids = {**fits, "prompt": [5, 6, 7] * 170}  # token-id prefix: 510 + the suffix and markers > 512
        response, record = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(), json=ids)
        assert response.status_code == 400 and record["reason"] == "prompt_too_long", response.text
