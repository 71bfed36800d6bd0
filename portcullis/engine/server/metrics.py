"""What the engine reports about its work: Prometheus metrics under vLLM's names (so existing
dashboards and inference-aware routers work unchanged), one log line per finished request, and
a periodic one-line status while busy.

Every server gets its own `CollectorRegistry`, never the global one, so several servers in one
process (tests) do not collide. Gauges and engine counters are read from the `AsyncEngine`'s
snapshot at scrape time; per-request histograms are observed on the event loop as outputs
arrive.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from portcullis.engine.frontend.async_engine import EngineSnapshot, TrackedRequest
from portcullis.engine.outputs import StepOutput

log = structlog.get_logger("engine")

# Seconds; wide enough for a CPU (slow) and fine enough for a GPU (fast).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _SnapshotCollector(Collector):
    """Gauges and cumulative engine counters, read from the latest snapshot when scraped."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterator:
        s = self._snapshot()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Requests preempted for lack of KV-cache blocks.", s.num_preemptions)
        yield from self._spec_decode(s)

    def _spec_decode(self, s: EngineSnapshot) -> Iterator:
        """Speculative decoding's counters, as vLLM names them (zero when it is off)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Verification steps with proposals.", s.spec_num_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens.", s.spec_num_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Accepted proposed tokens.", s.spec_num_accepted_tokens)
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted proposed tokens by position.", labels=["model_name", "position"])
        for position, count in enumerate(s.spec_accepted_per_position):
            family.add_metric([self._model, str(position)], count)
        yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


class EngineMetrics:
    """Prometheus metrics for one served model, and the per-request log line."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        disable_created_metrics()  # `*_created` series are noise to dashboards; vLLM drops them too
        self.model_name = model_name
        self.prompt_tokens_total = 0  # for the status line, without reading the Counter's internals
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(snapshot, model_name))
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=reg)
        for reason in ("stop", "length", "abort"):  # present at 0 from the start, as in vLLM
            self._success.labels(model_name, reason)
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = self._histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = self._histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode_time = self._histogram("vllm:request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        self.request_prompt = self._histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation = self._histogram("vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)

    def describe_cache(self, **config: object) -> None:
        """`vllm:cache_config_info`: the KV cache's settings as labels on a constant 1, as vLLM
        exports them (routers such as the Inference Extension's endpoint picker read it)."""
        labels = {k: str(v) for k, v in config.items()}
        Gauge("vllm:cache_config_info", "Information of the KV cache's configuration.", list(labels),
              registry=self.registry).labels(**labels).set(1)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def on_output(self, tracked: TrackedRequest, out: StepOutput, now: float) -> None:
        if out.new_token_ids:
            self._on_token(tracked, out, now)
        if out.finished:
            self._on_finish(tracked, out, now)

    def _on_token(self, tracked: TrackedRequest, out: StepOutput, now: float) -> None:
        self.generation_tokens.inc(len(out.new_token_ids))
        if tracked.first_token_time is not None:
            self.itl.observe(now - tracked.last_token_time)
            return
        self.prompt_tokens.inc(out.num_prompt_tokens)  # cached ones included, as vLLM counts them
        self.prompt_tokens_total += out.num_prompt_tokens
        self.ttft.observe(now - tracked.arrival_time)
        if tracked.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, tracked.first_scheduled_time - tracked.arrival_time))
            self.prefill_time.observe(max(0.0, now - tracked.first_scheduled_time))

    def _on_finish(self, tracked: TrackedRequest, out: StepOutput, now: float) -> None:
        reason = tracked.finish_reason_override or out.finish_reason
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(now - tracked.arrival_time)
        self.request_prompt.observe(out.num_prompt_tokens)
        self.request_generation.observe(out.num_output_tokens)
        first = tracked.first_token_time or (now if out.new_token_ids else None)
        if first is not None:
            self.decode_time.observe(now - first)
        log.info(
            "request finished",
            request_id=out.request_id,
            finish_reason=reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            ttft_s=None if first is None else round(first - tracked.arrival_time, 4),
            e2e_s=round(now - tracked.arrival_time, 4),
        )


class StatusReporter:
    """One log line on the engine's state every `interval_s` while there is work."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], metrics: EngineMetrics, interval_s: float = 10.0):
        self._snapshot = snapshot
        self._metrics = metrics
        self.interval_s = interval_s
        self._last = snapshot()
        self._last_time = time.monotonic()
        self._last_prompt_tokens = 0

    def tick(self) -> dict | None:
        """Log (and return) a status line if the engine was busy since the last tick."""
        now, s = time.monotonic(), self._snapshot()
        prompt_tokens_total = self._metrics.prompt_tokens_total
        elapsed = max(now - self._last_time, 1e-9)
        generated = s.num_generated_tokens - self._last.num_generated_tokens
        prompt = prompt_tokens_total - self._last_prompt_tokens
        busy = s.num_running or s.num_waiting or generated or prompt
        queries = s.prefix_cache_queries - self._last.prefix_cache_queries
        hits = s.prefix_cache_hits - self._last.prefix_cache_hits
        self._last, self._last_time, self._last_prompt_tokens = s, now, prompt_tokens_total
        if not busy:
            return None
        line = dict(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_cache_usage_pct=round(100 * s.kv_cache_usage, 1),
            prefix_cache_hit_rate_pct=round(100 * hits / queries, 1) if queries else 0.0,
            prompt_tokens_per_s=round(prompt / elapsed, 1),
            generation_tokens_per_s=round(generated / elapsed, 1),
            preemptions=s.num_preemptions,
        )
        log.info("engine status", **line)
        return line
