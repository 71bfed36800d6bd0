"""The gateway's own Prometheus metrics, in a registry per app (tests build many apps).

Labels use the *listed* route and the tenant name, never raw client paths, so a scanner
cannot blow up the series count.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from portcullis import envs

# Set by `portcullis gateway --workers N` (gateway.cli) to a private folder before the workers
# start: prometheus_client then keeps every worker's values in files there, and a scrape,
# whichever worker answers it, adds them up.
MULTIPROC_ENV = envs.PROMETHEUS_MULTIPROC_DIR.name

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
        # Per upstream (a replica's name from the policy: a bounded, admin-chosen set).
        self.upstream_requests = Counter(
            "portcullis_gateway_upstream_requests", "Attempts sent to each upstream replica, by why it was chosen: "
            "prefix_affinity, least_load, spill, round_robin, single, only_healthy or retry", ["upstream", "reason"],
            registry=r)
        self.upstream_errors = Counter(
            "portcullis_gateway_upstream_errors", "Attempts that failed at the connection or mid-response",
            ["upstream"], registry=r)
        self.upstream_retries = Counter(
            "portcullis_gateway_upstream_retries", "Requests retried on another replica after this one failed "
            "before any byte reached the client", ["upstream"], registry=r)
        self.in_flight = Gauge("portcullis_gateway_in_flight", "Requests being forwarded", registry=r,
                               multiprocess_mode="livesum")  # with several workers: their sum
        self.audit_syslog_dropped = Counter(
            "portcullis_gateway_audit_syslog_dropped", "Audit lines not delivered to --audit-syslog (unresolved "
            "host, full buffer, nobody listening); the audit file has them", registry=r)
        self.audit_refusals = Counter(
            "portcullis_gateway_audit_refusals",
            "Requests refused 503 audit_unavailable, by cause: failure (lines cannot be written) or "
            "backlog (more lines queued than the audit log's bound)", ["cause"], registry=r,
        )

    def watch_policy(self, store: Any) -> None:
        """Report the policy store's state at each scrape (a `PolicyStore`; duck-typed so this
        module needs nothing of the policy package)."""
        self.registry.register(PolicyCollector(store))

    def watch_fleet(self, fleet: Any) -> None:
        """Report each upstream replica's health and in-flight count at each scrape (a
        `gateway.upstream.fleet.Fleet`, duck-typed like the store)."""
        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        folder = os.environ.get(MULTIPROC_ENV)
        if not folder:
            return generate_latest(self.registry)
        return generate_latest(WorkerTotals(folder, self.registry))  # type: ignore[arg-type]


@contextmanager
def metrics_shared_by_workers() -> Iterator[str]:
    """A private folder (0700) for the workers' metric files while they run, removed after.

    Set in the environment before uvicorn starts the workers: each reads it when it first
    imports prometheus_client. One left by an earlier run is never reused (its counts would add).
    """
    folder = tempfile.mkdtemp(prefix="portcullis-metrics-")
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield folder
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


class WorkerTotals:
    """A scrape with several workers: counters, histograms and the in-flight gauge summed over
    every worker's files; the collectors read at scrape time (policy, upstreams) from this one."""

    def __init__(self, folder: str, local: CollectorRegistry) -> None:
        self.folder, self.local = folder, local

    def collect(self) -> Iterator[Any]:
        drop_dead_workers(self.folder)
        merged = list(MultiProcessCollector(None, self.folder).collect())
        names = {family.name for family in merged}
        yield from merged
        yield from (family for family in self.local.collect() if family.name not in names)


def drop_dead_workers(folder: str) -> None:
    """Forget the live gauges (in flight) of workers that are gone: uvicorn's supervisor restarts
    a worker that died, and the dead one's last count would otherwise be summed forever. Its
    counters stay: the requests it served happened."""
    for path in glob.glob(os.path.join(folder, "gauge_live*_*.db")):
        pid = int(path.rsplit("_", 1)[1].removesuffix(".db"))
        if not _alive(pid):
            mark_process_dead(pid, folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, under another user
    return True


class PolicyCollector(Collector):
    """Which policy serves and whether the files on disk were refused: a refused reload keeps the
    old policy (and any key or tenant it still lists) in force, so an operator must see it."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        status = self.store.status()
        yield GaugeMetricFamily("portcullis_gateway_policy_generation",
                                "Policy reloads applied since start (0 = the policy read at start)",
                                value=status["generation"])
        yield GaugeMetricFamily("portcullis_gateway_policy_reload_refused",
                                "1 while the policy files on disk are refused and the last good policy serves",
                                value=int(status["reload_refused"]))
        yield CounterMetricFamily("portcullis_gateway_policy_reload_refusals",
                                  "Reload attempts refused (invalid, unreadable or missing files)",
                                  value=status["refusals"])
        yield GaugeMetricFamily("portcullis_gateway_policy_loaded_timestamp_seconds",
                                "When the policy in force was applied (Unix time)", value=status["loaded_at"])
        error = self.store.last_error
        if error is not None:
            info = InfoMetricFamily("portcullis_gateway_policy_reload_error", "Why the files on disk were refused")
            info.add_metric([], {"file": error.path, "line": str(error.line or ""), "reason": error.reason[:200]})
            yield info


class FleetCollector(Collector):
    """The replicas now in force, read when scraped: health flips in the background checker,
    so a gauge set there would need the checker to know about metrics."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Any]:
        healthy = GaugeMetricFamily("portcullis_gateway_upstream_healthy",
                                    "1 while the replica is used (health check passed, not ejected)", labels=["upstream"])
        in_flight = GaugeMetricFamily("portcullis_gateway_upstream_in_flight",
                                      "Requests this gateway process has on the replica now", labels=["upstream"])
        for replica in list(self.fleet.replicas.values()):
            healthy.add_metric([replica.name], int(replica.healthy))
            in_flight.add_metric([replica.name], replica.in_flight)
        yield healthy
        yield in_flight
