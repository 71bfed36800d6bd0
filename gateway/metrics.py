"""The gateway's own Prometheus metrics, in a registry per app (tests build many apps).

Labels use the *listed* route and the tenant name, never raw client paths, so a scanner
cannot blow up the series count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "portcullis_gateway_requests", "Requests by route, status, decision and tenant",
            ["route", "status", "decision", "tenant"], registry=r,
        )
        self.rate_limited = Counter(
            "portcullis_gateway_rate_limited", "Requests refused by a rate limit",
            ["reason", "tenant"], registry=r,
        )
        self.auth_failures = Counter(
            "portcullis_gateway_auth_failures", "Failed authentications by reason", ["reason"], registry=r
        )
        self.upstream_latency = Histogram(
            "portcullis_gateway_upstream_latency_seconds", "Engine response time (whole body)",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.policy_reloads = Counter(
            "portcullis_gateway_policy_reloads", "Policy reload attempts", ["result"], registry=r
        )
        self.in_flight = Gauge("portcullis_gateway_in_flight", "Requests being forwarded", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
