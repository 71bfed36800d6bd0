"""Many clients at once share the engine through continuous batching and get exactly what the
offline API gives; a client that leaves frees its KV blocks at once."""
from __future__ import annotations

import asyncio
import time

import httpx

from portcullis.engine import SamplingParams

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named


async def test_64_concurrent_streams_each_equal_offline_greedy_output(server, offline):
    prompts = [f"Client {i} asks about topic {i * 7 % 13}:" for i in range(64)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    client = server.async_client()

    async def one(prompt: str) -> tuple[str, list]:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, reasons

    async with client:
        results = await asyncio.gather(*(one(p) for p in prompts))
    for (text, reasons), want in zip(results, expected):
        assert text == want.outputs[0].text
        assert reasons[-1] == want.outputs[0].finish_reason and reasons.count(reasons[-1]) == 1
    assert server.core.stats.num_generated_tokens >= 64 * 8


def wait_until(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.005)
    return time.monotonic() - start


def blocks_free(core) -> bool:
    return not core.has_unfinished_requests() and core.kv.pool.num_free == core.kv.pool.num_blocks


def test_stream_disconnect_aborts_and_frees_blocks(server):
    core = server.core
    wait_until(lambda: blocks_free(core))
    body = {"model": MODEL_NAME, "prompt": "x " * 100, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        held = core.kv.pool.num_blocks - core.kv.pool.num_free
        assert held >= 7  # 100+ prompt tokens in 16-token blocks, still generating
    generated = core.stats.num_generated_tokens
    wait_until(lambda: blocks_free(core))
    assert core.stats.num_generated_tokens - generated < 50  # stopped long before 400 tokens
    core.kv.pool.check_integrity()


def test_non_stream_disconnect_aborts_and_frees_blocks(server):
    core = server.core
    wait_until(lambda: blocks_free(core))
    body = {"model": MODEL_NAME, "prompt": "y " * 60, "max_tokens": 450, "ignore_eos": True}
    with server.http(timeout=httpx.Timeout(60, read=0.3)) as http:
        try:
            http.post("/v1/completions", json=body)
            raise AssertionError("the request should have timed out on the client side")
        except httpx.ReadTimeout:
            pass
    assert core.has_unfinished_requests() or core.stats.num_generated_tokens > 0
    generated = core.stats.num_generated_tokens
    wait_until(lambda: blocks_free(core))
    assert core.stats.num_generated_tokens - generated < 100
    core.kv.pool.check_integrity()
    with server.http() as http:
        metrics = http.get("/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}' in metrics
