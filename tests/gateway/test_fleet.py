"""One gateway in front of several engines (issue 17): upstreams in the policy, routing by
model, the /v1/models union, prefix affinity, failover and replicas added or removed by a
policy edit. Stub engines on their own sockets (in threads, or as processes where one is
killed with SIGKILL)."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from portcullis.gateway.upstream.fleet import (
    CHUNK_CHARS,
    Fleet,
    ReplicaConfig,
    affinity_chain,
    leading_text,
)

from .conftest import ENGINE_TOKEN, ServerThread, base_policy, stub_module

FAST = {"upstream_health_interval_s": 0.1, "upstream_scrape_interval_s": 0.1}


class Stubs:
    """Stub engines in threads, each on its own socket, serving the models it is given."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ptc-fleet-"))
        self.servers: list[ServerThread] = []
        self.states: dict[str, Any] = {}

    def start(self, name: str, *models: str) -> Any:
        app, state = stub_module.create_stub_app(ENGINE_TOKEN)
        state.models = models
        state.socket = self.folder / f"{name}.sock"
        self.servers.append(ServerThread(app, uds=str(state.socket)).start())
        self.states[name] = state
        return state

    def generated(self, name: str) -> int:
        return sum(1 for r in self.states[name].requests if r["path"].startswith("/v1/c"))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def stubs() -> Iterator[Stubs]:
    running = Stubs()
    yield running
    running.stop()


def upstream(name: str, sock: Path, *models: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": f"unix://{sock}", "models": list(models), **extra}


def fleet_policy(*upstreams: dict[str, Any]) -> dict[str, Any]:
    policy = base_policy()
    policy["upstreams"] = list(upstreams)
    return policy


async def all_up(gw: Any, timeout: float = 20) -> None:
    """Every listed replica admitted: a slow health interval means a check that came too early
    (an engine still starting on a busy machine) is only repeated seconds later."""
    deadline = time.monotonic() + timeout
    while not all(r.healthy for r in gw.gateway.fleet.replicas.values()):
        assert time.monotonic() < deadline, "the replicas were not all up"
        await asyncio.sleep(0.05)


def chat(model: str, system: str = "", user: str = "hi", **extra: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": 3, **extra}


@dataclass(frozen=True)
class Rule:
    """An `upstreams:` entry as the policy model gives it to `Fleet.configure`."""

    name: str
    token_file: str | None = None
    models: tuple[str, ...] = ("m",)
    weight: float = 1.0

    @property
    def url(self) -> str:
        return f"unix:///{self.name}"


async def test_routing_by_model_and_the_models_union(gateways, stubs):
    a, b = stubs.start("a", "demo"), stubs.start("b", "other")
    b.max_model_len = 1234
    (stubs.folder / "b.token").write_text(ENGINE_TOKEN + "\n")
    gw = gateways.start(fleet_policy(upstream("a", a.socket, "demo"),
                                     upstream("b", b.socket, "other", token_file=str(stubs.folder / "b.token"))),
                        **FAST)
    async with gw.client() as client:
        for model, served_by in (("demo", "a"), ("other", "b"), ("demo", "a")):
            response, record = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth("alice"),
                                             json=chat(model))
            assert response.status_code == 200 and response.json()["model"] == model
            assert record["upstream"] == served_by
        assert (stubs.generated("a"), stubs.generated("b")) == (2, 1)
        listing = (await client.get("/v1/models", headers=gw.auth("alice"))).json()["data"]
        assert {m["id"]: m["max_model_len"] for m in listing} == {"demo": 4096, "other": 1234}
        only_demo = (await client.get("/v1/models", headers=gw.auth("bob"))).json()["data"]
        assert [m["id"] for m in only_demo] == ["demo"]
        card = await client.get("/v1/models/other", headers=gw.auth("alice"))
        assert card.status_code == 200 and card.json()["max_model_len"] == 1234
        # globex may use any model: one no upstream serves is the engine's own 404, as before.
        response, record = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth("carol"),
                                         json=chat("secret-model"))
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
        forbidden = await client.post("/v1/chat/completions", headers=gw.auth("bob"), json=chat("other"))
        assert forbidden.status_code == 403  # this policy does not hide models: as before


async def test_a_model_the_engine_does_not_serve_is_not_routed_to_it(gateways, stubs):
    a, b = stubs.start("a", "demo"), stubs.start("b", "other")  # b is listed for demo, but lacks it
    gw = gateways.start(fleet_policy(upstream("a", a.socket, "demo"), upstream("b", b.socket, "demo", "other")),
                        **FAST)
    async with gw.client() as client:
        for _ in range(6):
            response = await client.post("/v1/chat/completions", headers=gw.auth(), json=chat("demo"))
            assert response.status_code == 200
    assert (stubs.generated("a"), stubs.generated("b")) == (6, 0)
    assert gw.gateway.fleet.replicas["b"].served == frozenset({"other"})


async def test_shared_prefixes_stay_on_one_replica_and_spread_across_replicas(gateways, stubs):
    a, b = stubs.start("a", "demo"), stubs.start("b", "demo")
    gw = gateways.start(fleet_policy(upstream("a", a.socket, "demo"), upstream("b", b.socket, "demo")), **FAST)
    systems = [f"system prompt {i}: " + f"rule {i} " * 300 for i in range(6)]
    served: dict[int, set[str]] = {i: set() for i in range(len(systems))}
    async with gw.client() as client:
        for round_ in range(4):
            for i, system in enumerate(systems):
                _, record = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(),
                                          json=chat("demo", system, f"question {round_}"))
                served[i].add(record["upstream"])
    assert all(len(names) == 1 for names in served.values()), served
    assert {name for names in served.values() for name in names} == {"a", "b"}  # new prefixes go to the least loaded


def test_affinity_never_crosses_tenants_and_needs_a_whole_chunk():
    text = "x" * (CHUNK_CHARS * 3)
    assert affinity_chain(text, "salt-acme") != affinity_chain(text, "salt-globex")
    assert len(affinity_chain(text, "s")) == 3 and affinity_chain("short", "s") == ()
    payload = {"messages": [{"role": "system", "content": [{"type": "text", "text": "abc"}]}]}
    assert leading_text(payload) == "system\nabc\n"
    assert leading_text({"prompt": ["first", "second"]}) == "first"


def test_bounded_load_spills_a_hot_prefix_to_the_least_loaded_replica():
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    fleet.configure([Rule("a"), Rule("b")], Path("policy.yaml"))
    for replica in fleet.replicas.values():
        replica.healthy = True
    chain = affinity_chain("p" * CHUNK_CHARS * 2, "t")
    first, reason = fleet.choose("m", chain)
    assert reason == "least_load"  # a new prefix
    assert all(fleet.choose("m", chain) == (first, "prefix_affinity") for _ in range(5))
    first.in_flight = 3  # 3 <= 1.25 x 0 + 2 is false: clearly busier than the other
    other, reason = fleet.choose("m", chain)
    assert other is not first and reason == "spill"
    first.in_flight = 0
    assert fleet.pick("m", chain) is first  # the spill did not move the prefix
    other.waiting = 10.0
    assert fleet.pick("m", chain) is first


def test_strategies_least_load_and_round_robin_ignore_the_prefix():
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    chain = affinity_chain("p" * CHUNK_CHARS * 2, "t")
    fleet.configure([Rule("a"), Rule("b")], Path("policy.yaml"), "round_robin")
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    a.healthy = b.healthy = True
    a.in_flight = 5  # round-robin does not look at load either
    choices = [fleet.choose("m", chain) for _ in range(4)]
    assert {c.replica.name for c in choices} == {"a", "b"} and not fleet.affinity
    assert {c.reason for c in choices} == {"round_robin"}
    fleet.configure([Rule("a"), Rule("b")], Path("policy.yaml"), "least_load")
    assert fleet.replicas["a"] is a  # a strategy change keeps the replicas
    assert all(fleet.pick("m", chain) is b for _ in range(3))
    a.in_flight = 0
    assert {fleet.pick("m", chain).name for _ in range(4)} == {"a", "b"}  # ties in turn, not by prefix
    with pytest.raises(ValueError, match="upstream_strategy"):
        fleet.configure([Rule("a")], Path("policy.yaml"), "random")


def test_routing_decision_is_fast():
    """Well under the 0.2 ms budget (benchmarks/fleet.py measures it properly)."""
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    fleet.configure([Rule(f"r{i}") for i in range(8)], Path("policy.yaml"))
    for replica in fleet.replicas.values():
        replica.healthy = True
    payload = chat("m", "s" * 4000, "question")
    started = time.perf_counter()
    for i in range(2000):
        fleet.pick("m", affinity_chain(leading_text(payload), f"tenant{i % 7}"))
    assert (time.perf_counter() - started) / 2000 < 0.001  # generous: shared CI cores


async def test_all_replicas_down_is_503_with_retry_after(gateways, stubs):
    folder = stubs.folder
    gw = gateways.start(fleet_policy(upstream("a", folder / "none-a.sock", "demo"),
                                     upstream("b", folder / "none-b.sock", "demo")), **FAST)
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(), json=chat("demo"))
    assert response.status_code == 503 and response.headers["retry-after"]
    assert record["reason"] == "engine_unavailable"
    ready = httpx.get(f"{gw.url}/readyz")
    assert ready.status_code == 503


async def test_a_replica_removed_by_a_policy_edit_while_traffic_runs(gateways, stubs):
    a, b = stubs.start("a", "demo"), stubs.start("b", "demo")
    policy = fleet_policy(upstream("a", a.socket, "demo"), upstream("b", b.socket, "demo"))
    gw = gateways.start(policy, **FAST)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def traffic(client: httpx.AsyncClient, worker: int) -> None:
        i = 0
        while not stop.is_set():
            body = chat("demo", f"worker {worker} " * 100, f"q{i}", stream=True, stub_delay_s=0.005)
            response = await client.post("/v1/chat/completions", headers=gw.auth(), json=body)
            statuses.append(response.status_code)
            assert response.text.rstrip().endswith("data: [DONE]")  # finished where it started
            i += 1

    async with gw.client() as client:
        workers = [asyncio.create_task(traffic(client, w)) for w in range(4)]
        await asyncio.sleep(0.5)
        gw.write_policy(fleet_policy(upstream("a", a.socket, "demo")))
        deadline = time.monotonic() + 5
        while "b" in gw.gateway.fleet.replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        served_by_b = stubs.generated("b")
        await asyncio.sleep(0.5)
        assert stubs.generated("b") == served_by_b  # nothing new reaches the removed replica
        gw.write_policy(policy)  # and added back, with no restart
        deadline = time.monotonic() + 5
        while not gw.gateway.fleet.replicas.get("b") or not gw.gateway.fleet.replicas["b"].healthy:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)
    assert statuses and set(statuses) == {200}
    records = await gw.wait_audit(len(statuses))
    assert len(records) == len(statuses)


# ---- failover with engines that die -------------------------------------------------------

def _stub_process(folder: Path, name: str, *models: str) -> tuple[subprocess.Popen, Path]:
    sock = folder / f"{name}.sock"
    (folder / "token").write_text(ENGINE_TOKEN)
    args = [sys.executable, "-m", "portcullis.testing.stub_engine", "--uds", str(sock),
            "--token-file", str(folder / "token")]
    for model in models:
        args += ["--model", model]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the stub engine did not start"
        time.sleep(0.05)
    return proc, sock


@pytest.fixture
def processes(stubs: Stubs) -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


async def test_an_engine_killed_under_load_loses_no_request_that_had_not_started(gateways, stubs, processes):
    pa, sock_a = _stub_process(stubs.folder, "a", "demo")
    pb, sock_b = _stub_process(stubs.folder, "b", "demo")
    processes += [pa, pb]
    # A slow health check, so the dead replica is found by requests (passive) before the checker.
    gw = gateways.start(fleet_policy(upstream("a", sock_a, "demo"), upstream("b", sock_b, "demo")),
                        upstream_health_interval_s=5.0, upstream_scrape_interval_s=0.1)
    await all_up(gw)
    sent = 0
    events = [0] * 6

    async def stream(client: httpx.AsyncClient, i: int) -> str:
        body = chat("demo", f"stream {i} " * 100, max_tokens=200, stream=True, stub_delay_s=0.02)
        async with client.stream("POST", "/v1/chat/completions", headers=gw.auth(), json=body) as response:
            text = ""
            async for chunk in response.aiter_text():
                text += chunk
                events[i] = text.count("\n\n")
        return text

    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        # Streams under way on both replicas (events out: no retry for them), then one engine dies.
        long = [asyncio.create_task(stream(client, i)) for i in range(6)]
        sent += len(long)
        deadline = time.monotonic() + 20
        while min(events) < 2:
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.01)
        os.killpg(pa.pid, signal.SIGKILL)
        pa.wait(timeout=10)
        short = [client.post("/v1/chat/completions", headers=gw.auth(), json=chat("demo", f"after {i} " * 100))
                 for i in range(12)]
        sent += len(short)
        after = await asyncio.gather(*short)
        streams = await asyncio.gather(*long)
    assert [r.status_code for r in after] == [200] * len(after)  # retried on b, none lost
    broken = [text for text in streams if not text.rstrip().endswith("data: [DONE]")]
    assert broken, "no stream was on the killed replica"
    for text in broken:  # ended with an OpenAI error event, never silently cut
        assert '"error"' in text.strip().split("\n\n")[-1]
    records = await gw.wait_audit(sent)
    assert len(records) == sent
    assert sum(r["reason"] == "engine_stream_broken" for r in records) == len(broken)
    assert all(r["upstream"] == "b" for r in records if r.get("retried_from") == "a")
    assert not gw.gateway.fleet.replicas["a"].healthy  # ejected
    metrics = gw.gateway.metrics.render().decode()
    assert 'portcullis_gateway_upstream_errors_total{upstream="a"}' in metrics


def test_a_group_of_one_replica_is_single_and_a_survivor_only_healthy():
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    fleet.configure([Rule("a")], Path("policy.yaml"))
    fleet.replicas["a"].healthy = True
    assert fleet.choose("m").reason == "single"  # every --engine-url gateway: no choice made
    fleet.configure([Rule("a"), Rule("b")], Path("policy.yaml"))
    fleet.replicas["a"].healthy, fleet.replicas["b"].healthy = True, False
    assert fleet.choose("m").reason == "only_healthy"


async def test_the_context_reserved_is_the_longest_a_replica_of_the_model_has():
    """A chat reply without max_tokens may land on any replica of its model (a retry too)."""
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    fleet.configure([Rule("a"), Rule("b"), Rule("c", models=("other",))], Path("policy.yaml"))
    a, b, c = fleet.replicas["a"], fleet.replicas["b"], fleet.replicas["c"]
    a.healthy = b.healthy = c.healthy = True
    a.cards, b.cards = {"m": {"id": "m", "max_model_len": 4096}}, {"m": {"id": "m", "max_model_len": 8192}}
    c.cards = {"other": {"id": "other", "max_model_len": 32768}}
    assert await fleet.context_length("m") == 8192 and await fleet.context_length(None) == 32768
    b.healthy = False  # down, but it may come back before the request is sent
    assert await fleet.context_length("m") == 8192
    b.cards = {}  # down and never read: it serves nothing until its models are read
    assert await fleet.context_length("m") == 4096
    a.cards = {"m": {"id": "m"}}  # an engine that does not say
    assert await fleet.context_length("m") is None


async def test_a_request_no_replica_received_costs_no_budget(gateways, stubs):
    """503s while every replica is down give their request budget back: the day's two requests
    are still there when a replica comes up (they were all spent on 503s before)."""
    policy = fleet_policy(upstream("a", stubs.folder / "a.sock", "demo"))
    policy["tenants"]["acme"]["key_limits"] = {"budgets": {"requests_per_day": 2}}
    gw = gateways.start(policy, **FAST)
    async with gw.client() as client:
        for _ in range(3):
            response = await client.post("/v1/chat/completions", headers=gw.auth(), json=chat("demo"))
            assert response.status_code == 503
        stubs.start("a", "demo")
        await all_up(gw)
        statuses = [(await client.post("/v1/chat/completions", headers=gw.auth(), json=chat("demo"))).status_code
                    for _ in range(3)]
    assert statuses == [200, 200, 429]  # the budget counts what reached an engine, and still holds


# ---- metrics: why each replica was chosen, and each replica's health --------------------------

def _series(text: str, name: str) -> dict[tuple[str, ...], float]:
    """`name`'s samples from Prometheus text, keyed by their label values (labels in name order)."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            pairs = sorted(part.split("=", 1) for part in labels.split(","))
            found[tuple(value.strip('"') for _, value in pairs)] = float(value)
    return found


async def test_the_metrics_endpoint_counts_attempts_by_upstream_and_reason(gateways, stubs):
    a, b = stubs.start("a", "demo"), stubs.start("b", "demo")
    # A slow health check: the stopped replica is found by requests (retry, then ejection).
    gw = gateways.start(fleet_policy(upstream("a", a.socket, "demo"), upstream("b", b.socket, "demo")),
                        upstream_health_interval_s=5.0, upstream_scrape_interval_s=0.1)
    await all_up(gw)
    system = "shared system prompt " * 40
    async with gw.client() as client:
        _, first = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(), json=chat("demo", system))
        _, second = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(),
                                  json=chat("demo", system, "again"))
        holder = first["upstream"]
        assert second["upstream"] == holder
        other = "b" if holder == "a" else "a"
        stubs.servers[0 if holder == "a" else 1].stop()  # the prefix's replica goes away
        response, retried = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(),
                                          json=chat("demo", system, "third"))
        assert response.status_code == 200 and (retried["retried_from"], retried["upstream"]) == (holder, other)
        for i in range(12):  # short prompts: no affinity, so some still try the dead replica
            if not gw.gateway.fleet.replicas[holder].healthy:
                break
            # gw.call waits for each line: an audit line still being written would land in the next call's count
            response, _ = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(),
                                        json=chat("demo", user=f"{i}"))
            assert response.status_code == 200
        assert not gw.gateway.fleet.replicas[holder].healthy  # ejected after eject_after failures
        _, last = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(), json=chat("demo"))
        text = (await client.get("/gateway/metrics", headers=gw.auth("root"))).text
    records = await gw.wait_audit(0)
    requests = _series(text, "portcullis_gateway_upstream_requests_total")  # (reason, upstream)
    # The first request opened the prefix, the second and third (which failed) followed it.
    assert requests[("least_load", holder)] >= 1 and requests[("prefix_affinity", holder)] == 2
    retries = sum(1 for r in records if r.get("retried_from") == holder)
    assert retries >= 3 and requests[("retry", other)] == retries
    assert last["upstream"] == other and requests[("only_healthy", other)] == 1
    forwarded = [r for r in records if r["path"] == "/v1/chat/completions"]
    assert all(r["upstream"] in ("a", "b") and r["status"] == 200 for r in forwarded)
    assert sum(requests.values()) == len(forwarded) + retries  # one count per attempt
    assert _series(text, "portcullis_gateway_upstream_retries_total") == {(holder,): retries}
    assert _series(text, "portcullis_gateway_upstream_errors_total") == {(holder,): retries}
    assert _series(text, "portcullis_gateway_upstream_healthy") == {(holder,): 0, (other,): 1}


def test_the_health_gauge_follows_each_replica():
    from portcullis.gateway.metrics import GatewayMetrics

    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", ENGINE_TOKEN, None))
    fleet.configure([Rule("a"), Rule("b")], Path("policy.yaml"))
    metrics = GatewayMetrics()
    metrics.watch_fleet(fleet)
    fleet.replicas["a"].healthy, fleet.replicas["a"].in_flight = True, 2
    text = metrics.render().decode()
    assert _series(text, "portcullis_gateway_upstream_healthy") == {("a",): 1, ("b",): 0}
    assert _series(text, "portcullis_gateway_upstream_in_flight") == {("a",): 2, ("b",): 0}
    fleet.configure([Rule("b")], Path("policy.yaml"))  # a removed by a policy edit: its series go
    assert _series(metrics.render().decode(), "portcullis_gateway_upstream_healthy") == {("b",): 0}


# ---- a policy edit that keeps a replica reads its models again ---------------------------------

async def test_a_kept_replica_s_models_are_read_again_on_a_policy_edit(gateways, stubs):
    a = stubs.start("a", "demo")
    policy = fleet_policy(upstream("a", a.socket, "demo", "other"))
    gw = gateways.start(policy, **FAST)
    replica = gw.gateway.fleet.replicas["a"]
    async with gw.client() as client:
        listing = (await client.get("/v1/models", headers=gw.auth())).json()["data"]
        assert {m["id"]: m["max_model_len"] for m in listing} == {"demo": 4096}
        missing = await client.post("/v1/chat/completions", headers=gw.auth(), json=chat("other"))
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # The engine is restarted serving both models with a shorter context, and the policy edited.
        a.models, a.max_model_len = ("demo", "other"), 2048
        gw.write_policy(fleet_policy(upstream("a", a.socket, "demo", "other", weight=2.0)))
        deadline = time.monotonic() + 5
        while replica.served != {"demo", "other"}:
            assert time.monotonic() < deadline, "the kept replica's models were not read again"
            await asyncio.sleep(0.05)
        assert gw.gateway.fleet.replicas["a"] is replica and replica.config.weight == 2.0  # kept, not replaced
        listing = (await client.get("/v1/models", headers=gw.auth())).json()["data"]
        assert {m["id"]: m["max_model_len"] for m in listing} == {"demo": 2048, "other": 2048}
        response, record = await gw.call(client, "POST", "/v1/chat/completions", headers=gw.auth(), json=chat("other"))
        assert response.status_code == 200 and record["upstream"] == "a"
