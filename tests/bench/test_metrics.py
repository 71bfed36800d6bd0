"""Metrics under vLLM's definitions, arrival times, flag parsing and the stream's token chunks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from portcullis.bench.client import RequestResult, _token_text
from portcullis.bench.errors import BenchError
from portcullis.bench.metrics import parse_goodput, summarize, sweep_table, table
from portcullis.bench.serve import arrival_offsets


def _result(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestResult:
    return RequestResult(prompt, True, tokens, ttft, itl, ttft + sum(itl), start)


def test_summary_follows_vllm_definitions():
    results = [_result(0.0, 0.1, [0.02] * 4, 5), _result(1.0, 0.3, [0.05] * 4, 5),
               RequestResult(10, error="HTTP 503: busy")]
    s = summarize(results, duration=2.0, goodput={"ttft": 200}, percentiles=[50, 99])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 20, 10)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 5.0, 15.0)
    assert s["request_goodput"] == 0.5  # only the first met TTFT <= 200 ms
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(0.5 * (180 + 500))
    assert s["mean_tpot_ms"] == pytest.approx((20 + 50) / 2)  # (e2el - ttft) / (tokens - 1)
    assert s["mean_itl_ms"] == pytest.approx(35) and s["p50_itl_ms"] == pytest.approx(35)
    assert s["max_concurrent_requests"] == 1  # the second starts after the first ended
    assert s["max_output_tokens_per_s"] == 5  # token chunks in the busiest whole second
    text = table(s, 4.0, 8, [50, 99], [("HTTP 503: busy", 1)])
    assert "Request goodput (req/s):" in text and "P99 TPOT (ms):" in text and "1 x HTTP 503: busy" in text
    assert "inf" in sweep_table([(math.inf, s)])


def test_no_goodput_without_bounds_and_all_failed_is_zeros():
    s = summarize([RequestResult(5, error="x")], 1.0, {}, [99])
    assert s["request_goodput"] is None and s["completed"] == 0 and s["mean_ttft_ms"] == 0.0


def test_goodput_bounds_parse_both_spellings():
    assert parse_goodput(["ttft:500,tpot:50"]) == parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500, "tpot": 50}
    for bad in (["ttft=5"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(BenchError):
            parse_goodput(bad)


def test_arrivals_poisson_scaled_to_the_rate_or_all_at_once():
    assert not arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).any()
    times = arrival_offsets(100, 4.0, 1.0, np.random.default_rng(0))
    assert times[-1] == pytest.approx(25.0) and (np.diff(times) >= 0).all()
    gaps = np.diff(times)
    assert 0.5 < gaps.std() / gaps.mean() < 1.5  # exponential gaps: coefficient of variation about 1


def test_token_chunks_skip_the_role_and_the_usage():
    assert _token_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) is None
    assert _token_text({"choices": [], "usage": {"completion_tokens": 3}}) is None
    assert _token_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert _token_text({"choices": [{"delta": {}}]}) == ""  # a token with no text yet still counts
    assert _token_text({"choices": [{"text": "y"}]}) == "y"
