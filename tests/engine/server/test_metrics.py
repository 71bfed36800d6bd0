"""`/metrics` exposes vLLM's metric names, labelled with the model, with values that move; the
status line reports what the engine did."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from portcullis.engine.frontend.async_engine import EngineSnapshot
from portcullis.engine.server.metrics import EngineMetrics, StatusReporter

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named

NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_success",
]


def scrape(server) -> dict[str, float]:
    """Every sample as `name{label=value,...}` -> value."""
    with server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def value(samples: dict[str, float], name: str, **labels) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted({"model_name": MODEL_NAME, **labels}.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)


def test_metrics_have_vllm_names_and_move(server, client):
    before = scrape(server)
    for name in NAMES:
        assert any(k.startswith(name) and f"model_name={MODEL_NAME}" in k for k in before), name
    prompt = " ".join(f"metric{i}" for i in range(30))
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
    after = scrape(server)
    moved = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    n_prompt = len(server.state.tokenizer.encode(prompt))
    assert moved("vllm:prompt_tokens_total") == 2 * n_prompt
    assert moved("vllm:generation_tokens_total") == 10
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:prefix_cache_queries_total") == 2 * n_prompt
    assert moved("vllm:prefix_cache_hits_total") == ((n_prompt - 1) // 16) * 16
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:request_queue_time_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 8  # 4 gaps in each of 5 tokens
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0


def test_servers_in_one_process_keep_separate_registries():
    a = EngineMetrics("a", EngineSnapshot)
    b = EngineMetrics("b", EngineSnapshot)
    a.generation_tokens.inc(3)
    assert b.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "b"}) == 0
    assert a.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "a"}) == 3


def test_status_line_only_when_busy():
    snap = [EngineSnapshot()]
    metrics = EngineMetrics("m", lambda: snap[0])
    reporter = StatusReporter(lambda: snap[0], metrics, interval_s=10)
    assert reporter.tick() is None  # idle: nothing to say
    snap[0] = EngineSnapshot(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                             prefix_cache_hits=40, num_generated_tokens=500)
    line = reporter.tick()
    assert line["running"] == 3 and line["waiting"] == 2 and line["kv_cache_usage_pct"] == 25.0
    assert line["prefix_cache_hit_rate_pct"] == 40.0 and line["generation_tokens_per_s"] > 0


def test_gauges_show_a_running_request(server):
    body = {"model": MODEL_NAME, "prompt": "g " * 80, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        during = scrape(server)
    assert value(during, "vllm:num_requests_running") >= 1
    assert 0 < value(during, "vllm:kv_cache_usage_perc") < 1


def test_cache_config_info_describes_the_kv_cache(server):
    samples = scrape(server)
    info = [k for k in samples if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and samples[info[0]] == 1
    assert f"num_gpu_blocks={server.core.info.num_kv_blocks}" in info[0] and "block_size=16" in info[0]
    assert "enable_prefix_caching=True" in info[0] and "cache_dtype=float32" in info[0]
