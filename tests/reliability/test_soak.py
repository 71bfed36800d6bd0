"""Soak: many mixed requests through `portcullis serve` (demo model): streamed and not,
structured JSON, n>1, refused, and streams the client abandons midway.

Judged on what an operator watches: the gateway's and the engine's RSS stay within 10% of
their size after warm-up, neither leaks file descriptors, the audit log has exactly one line
per request, and every request is accounted for. CI runs a short version (300 requests);
`make soak` (PORTCULLIS_SOAK=1) runs 10,000, PORTCULLIS_SOAK_REQUESTS=N any other number.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .conftest import DEMO, Served, report, start_serve, wait_for

REQUESTS = int(os.environ.get("PORTCULLIS_SOAK_REQUESTS") or (10_000 if os.environ.get("PORTCULLIS_SOAK") else 300))
WARM_UP = max(100, REQUESTS // 10)
CONCURRENCY = 8
RSS_DRIFT = 0.10
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
CHAT = [{"role": "user", "content": "def fibonacci(n):"}]

# Each kind: (path, body, how the client reads it). One cycle mixes all of them.
KINDS: list[tuple[str, str, dict[str, Any], str]] = [
    ("completion", "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8}, "whole"),
    ("chat-stream", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "stream": True}, "stream"),
    ("structured", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}, "whole"),
    ("n=3", "/v1/completions", {"prompt": "import os", "max_tokens": 6, "n": 3, "temperature": 0.8}, "whole"),
    ("stream-usage", "/v1/completions", {"prompt": "class A:", "max_tokens": 8, "stream": True,
                                         "stream_options": {"include_usage": True}}, "stream"),
    ("aborted", "/v1/completions", {"prompt": "for i in", "max_tokens": 200, "ignore_eos": True, "stream": True}, "abort"),
    ("refused", "/v1/completions", {"prompt": "x", "max_tokens": 2}, "bad-key"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    running = start_serve(tmp_path_factory.mktemp("serve-soak"))
    raise_starter_limits(running.home / "policy.yaml")
    yield running
    running.stop()


def raise_starter_limits(path: Path) -> None:
    """The starter policy's per-minute limits are for people, not a load test: lift them, as an
    admin would, and wait for the hot reload to land."""
    policy = yaml.safe_load(path.read_text())
    policy["tenants"]["default"]["limits"] = {"requests_per_minute": 1_000_000, "tokens_per_minute": 100_000_000,
                                              "concurrent_requests": 64}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    time.sleep(3)  # the starter policy promises edits apply within 2 s


async def one(client: httpx.AsyncClient, served: Served, kind: tuple[str, str, dict[str, Any], str]) -> str:
    """Send one request of `kind`; return how it ended ("200", "401", "aborted", ...)."""
    _, path, body, read = kind
    headers = {"authorization": "Bearer ptc_nope.nope"} if read == "bad-key" else served.headers
    if read in ("whole", "bad-key"):
        response = await client.post(path, json={"model": DEMO, **body}, headers=headers)
        return str(response.status_code)
    async with client.stream("POST", path, json={"model": DEMO, **body}, headers=headers) as response:
        events, tail = 0, ""
        async for chunk in response.aiter_text():
            events += chunk.count("\n\n")
            tail = (tail + chunk)[-64:]
            if read == "abort" and events >= 3:
                return "aborted"  # leaving the block closes the connection mid-stream
        return str(response.status_code) if "data: [DONE]" in tail else f"{response.status_code}-truncated"


async def run_load(served: Served, count: int, start: int) -> Counter:
    outcomes: Counter = Counter()
    kinds = itertools.islice(itertools.cycle(KINDS), start, start + count)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=served.base, timeout=120, limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for kind in kinds:
            queue.put_nowait(kind)

        async def worker() -> None:
            while not queue.empty():
                kind = queue.get_nowait()
                outcomes[(kind[0], await one(client, served, kind))] += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


def footprint(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of one process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def test_soak_flat_memory_no_fd_growth_every_request_audited(served: Served, request: pytest.FixtureRequest):
    (engine,), (gateway,) = served.children("-m portcullis.engine"), served.children("portcullis.cli gateway")
    audit_before = len(served.audit())
    began = time.monotonic()
    warm = await run_load(served, WARM_UP, 0)
    await asyncio.sleep(1)  # let the last responses settle (audit lines, pooled connections)
    base = {name: footprint(pid) for name, pid in (("gateway", gateway), ("engine", engine))}
    main = await run_load(served, REQUESTS - WARM_UP, WARM_UP)
    await asyncio.sleep(1)
    end = {name: footprint(pid) for name, pid in (("gateway", gateway), ("engine", engine))}
    elapsed = time.monotonic() - began

    outcomes = warm + main
    wait_for(lambda: len(served.audit()) - audit_before >= REQUESTS, 30, "one audit line per request")
    audited = served.audit()[audit_before:]
    drift = {name: end[name][0] / base[name][0] - 1 for name in base}
    report(request, f"soak: {REQUESTS} requests in {elapsed:.0f} s ({REQUESTS / elapsed:.1f}/s), "
                    f"{len(audited)} audit lines; RSS drift after warm-up: "
                    + ", ".join(f"{n} {base[n][0] // 1024}->{end[n][0] // 1024} MiB ({drift[n]:+.1%})" for n in base)
                    + "; fds: " + ", ".join(f"{n} {base[n][1]}->{end[n][1]}" for n in base)
                    + f"; outcomes: {dict(sorted(Counter({f'{k}:{v}': c for (k, v), c in outcomes.items()}).items()))}")

    assert sum(outcomes.values()) == REQUESTS
    expected = {"aborted": {"aborted"}, "refused": {"401", "429"}}  # 429: repeated bad keys are throttled
    for (kind, outcome), count in outcomes.items():
        assert outcome in expected.get(kind, {"200"}), f"{count} x {kind} ended {outcome}"
    assert len(audited) == REQUESTS, f"{len(audited)} audit lines for {REQUESTS} requests"
    # The audit tells the same story as the clients. An abandoned stream is a 499, or a 200 when
    # the whole stream had already left the gateway when the client hung up.
    told: Counter = Counter()
    for (_, outcome), count in outcomes.items():
        told[outcome] += count
    audit = Counter(str(r["status"]) for r in audited)
    late = audit["200"] - told["200"]  # abandoned streams that had already gone out in full
    assert late >= 0 and audit["499"] + late == told["aborted"], (audit, told)
    rest = ("200", "499", "aborted")
    assert {k: v for k, v in audit.items() if k not in rest} == {k: v for k, v in told.items() if k not in rest}
    for name in base:
        assert drift[name] <= RSS_DRIFT, f"{name} RSS grew {drift[name]:.1%} after warm-up"
        assert end[name][1] <= base[name][1] + 2, f"{name} file descriptors grew {base[name][1]} -> {end[name][1]}"
