"""Fleet routing (issue 17): the cost of the gateway's routing decision per request.

Times what the gateway adds per request when the policy lists upstreams: reading the leading
text of the body (`leading_text`), hashing it in salted chunks (`affinity_chain`) and choosing
a replica (`Fleet.choose`: group filter, load scores, affinity lookup, remembering the chain),
for chat bodies with a long shared system prompt, over 2 and 8 replicas, many tenants.
Target: <= 0.2 ms per request. Prints one JSON object.

    python benchmarks/fleet.py routing [--requests 20000]

The shared-prefix workload (`workload`): two real engines on the demo model behind one gateway,
8 system prompts of ~1,000 tokens, 256 streamed chat requests with Poisson arrivals, once per
strategy (the policy's `upstream_strategy`, switched by editing the policy, so one gateway and
the same engines serve all three). Each phase's prompts carry their own tag, so no phase finds
another's blocks cached. Reported per strategy: the engines' prefix-cache hit rate
(vllm:prefix_cache_hits / vllm:prefix_cache_queries, the phase's delta summed over both
replicas), TTFT p50/p99 (first token, not the role chunk) and throughput. Each engine's KV cache
holds about half the prompts (`--kv-cache-memory`), so where a prompt goes decides whether it
is cached, as on a fleet whose working set exceeds one replica. Target: prefix-aware >= 1.5x
round-robin's hit rate and a lower TTFT p99. Engines run float32 with one thread each. The
report also carries the routing decision's cost (the `routing` measurement above, same
machine, same run, as many replicas), so the hit rate is never quoted without its price.

    python benchmarks/fleet.py workload [--requests 256] [--rate 4] [--prompt-tokens 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from portcullis.gateway.upstream.fleet import Fleet, ReplicaConfig, affinity_chain, leading_text  # noqa: E402
from portcullis.host import cpu_model as _cpu_model  # noqa: E402


def _fleet(replicas: int) -> Fleet:
    fleet = Fleet(ReplicaConfig("engine", "unix:///nowhere", "x" * 32, None))
    rules = [SimpleNamespace(name=f"r{i}", url=f"unix:///r{i}", token_file=None, models=["demo"], weight=1.0)
             for i in range(replicas)]
    fleet.configure(rules, Path("policy.yaml"))
    for i, replica in enumerate(fleet.replicas.values()):
        replica.healthy, replica.running, replica.waiting, replica.kv_usage = True, i % 3, i % 2, 0.1 * i
    return fleet


def _bodies(count: int) -> list[dict]:
    systems = [f"You are assistant {i}. " + f"Rule {i}: be precise. " * 200 for i in range(8)]
    return [{"model": "demo", "messages": [{"role": "system", "content": systems[i % 8]},
                                           {"role": "user", "content": f"question {i}"}]} for i in range(count)]


def measure(replicas: int, requests: int) -> dict:
    """Wall time per decision, and this process's CPU time per decision: on a shared machine the
    wall figure includes the time other processes held the core, the CPU figure does not."""
    fleet, bodies = _fleet(replicas), _bodies(requests)
    rounds, cpu_rounds = [], []
    for _ in range(5):
        started, cpu_started = time.perf_counter(), time.process_time()
        for i, body in enumerate(bodies):
            replica, _ = fleet.choose("demo", affinity_chain(leading_text(body), f"salt-{i % 50}"))
            replica.in_flight = (replica.in_flight + 1) % 4  # some churn in the loads
        rounds.append((time.perf_counter() - started) / requests * 1e6)
        cpu_rounds.append((time.process_time() - cpu_started) / requests * 1e6)
    return {"replicas": replicas, "requests": requests, "us_per_decision_median": round(statistics.median(rounds), 2),
            "us_per_decision_max": round(max(rounds), 2),
            "cpu_us_per_decision_median": round(statistics.median(cpu_rounds), 2)}


# -- the shared-prefix workload over real engines ---------------------------------------------

STRATEGIES = ("round_robin", "least_load", "prefix")
WORDS = ("alpha beta gamma delta kernel cache block token tensor model engine gateway policy audit "
         "request replica prefix stream batch queue latency thread socket memory layer").split()


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait(url: str, proc: subprocess.Popen, transport: httpx.HTTPTransport | None = None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(transport=transport, timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{url} was not up after {timeout:.0f} s")


def _engine_client(sock: Path, token: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=60,
                        headers={"authorization": f"Bearer {token}"})


def _prefix_counters(sock: Path, token: str) -> tuple[float, float]:
    with _engine_client(sock, token) as client:
        text = client.get("/metrics").text
    found = dict(re.findall(r"^(vllm:prefix_cache_(?:hits|queries))_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", text, re.M))
    return float(found.get("vllm:prefix_cache_hits", 0)), float(found.get("vllm:prefix_cache_queries", 0))


def _system_prompts(sock: Path, token: str, count: int, tokens: int, tag: str, rng: random.Random) -> list[str]:
    """`count` prompts of about `tokens` tokens (counted by the engine's /tokenize), distinct from
    their first characters on (the tag), so each starts its own affinity chain."""
    prompts = []
    with _engine_client(sock, token) as client:
        for i in range(count):
            words = [f"[{tag} prompt {i}]"] + [rng.choice(WORDS) for _ in range(tokens)]
            while True:
                text = " ".join(words)
                counted = client.post("/tokenize", json={"model": "demo", "prompt": text}).json()["count"]
                if counted <= tokens:
                    break
                words = words[:max(2, min(len(words) - 1, int(len(words) * tokens / counted)))]
            prompts.append(text)
    return prompts


def _policy(folder: Path, socks: list[Path], strategy: str) -> str:
    big = 10**9
    limits = {"requests_per_minute": big, "tokens_per_minute": big, "concurrent_requests": 10000}
    return json.dumps({
        "routes": [{"method": "POST", "path": "/v1/chat/completions"}, {"method": "GET", "path": "/v1/models"}],
        "tenants": {"bench": {"models": ["demo"], "limits": limits, "key_limits": limits}},
        "keys_file": "keys.yaml", "rate_limits": {"storage": "memory://", "auth_failures_per_minute": 1000},
        "audit": {"path": str(folder / "audit.log"), "max_bytes": 1 << 30},
        "upstreams": [{"name": f"r{i}", "url": f"unix://{sock}", "models": ["demo"]} for i, sock in enumerate(socks)],
        "upstream_strategy": strategy,
    })  # JSON is YAML


async def _one(client: httpx.AsyncClient, system: str, user: str, max_tokens: int) -> dict:
    body = {"model": "demo", "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if ttft is None and choices and "role" not in choices[0].get("delta", {}):
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft": ttft, "tokens": tokens, "latency": time.perf_counter() - started}


async def _phase(url: str, key: str, prompts: list[str], args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)  # the same arrivals and prompt order for every strategy
    choices = [rng.randrange(len(prompts)) for _ in range(args.requests)]
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=600,
                                 limits=limits) as client:
        tasks, started = [], time.perf_counter()
        for i, (choice, gap) in enumerate(zip(choices, gaps)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, prompts[choice], f"question {i}: {rng.random()}",
                                                  args.max_tokens)))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    done = [r for r in results if "error" not in r and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] for r in done)
    return {"requests": len(results), "failed": len(results) - len(done),
            "ttft_p50_ms": round(1000 * _quantile(ttfts, 0.5), 1), "ttft_p99_ms": round(1000 * _quantile(ttfts, 0.99), 1),
            "requests_per_s": round(len(done) / elapsed, 2),
            "output_tokens_per_s": round(sum(r["tokens"] for r in done) / elapsed, 1), "seconds": round(elapsed, 1)}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def workload(args: argparse.Namespace) -> dict:
    from portcullis.gateway.auth.keys import new_key, write_keys_file
    from portcullis.gateway.policy.models import KeysFile

    folder = Path(tempfile.mkdtemp(prefix="ptc-fleet-"))  # short: socket paths max out at 108
    token = secrets.token_urlsafe(32)
    (folder / "token").write_text(token)
    key, record = new_key("bench-user", "bench", [])
    write_keys_file(folder / "keys.yaml", KeysFile(keys=[record]))
    socks = [folder / f"r{i}.sock" for i in range(args.replicas)]
    env = {"PORTCULLIS_CPU_DTYPE": "float32", "OMP_NUM_THREADS": str(args.engine_threads),
           "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        for i, sock in enumerate(socks):
            procs.append(_spawn([sys.executable, "-m", "portcullis.engine", "--uds", str(sock), "--token-file",
                                 str(folder / "token"), "--served-model-name", "demo", "--max-model-len", "2048",
                                 "--kv-cache-memory", args.kv_cache_memory, "--log-format", "json"],
                                folder / f"r{i}.log", env))
        for sock, proc in zip(socks, procs):
            _wait("http://engine/health", proc, httpx.HTTPTransport(uds=str(sock)))
        policy = folder / "policy.yaml"
        policy.write_text(_policy(folder, socks, STRATEGIES[0]))
        port = _free_port()
        gateway = _spawn([sys.executable, "-m", "portcullis.cli", "gateway", "--policy", str(policy), "--port", str(port),
                          "--engine-token-file", str(folder / "token")], folder / "gateway.log", {"PYTHONPATH": str(ROOT)})
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/healthz", gateway, timeout=60)
        time.sleep(1.5)  # the replicas' first health checks
        rng = random.Random(args.seed)
        asyncio.run(_phase(url, key, _system_prompts(socks[0], token, 2, 64, "warm-up", rng),
                           argparse.Namespace(**{**vars(args), "requests": 8}), args.seed))
        phases = {}
        for strategy in STRATEGIES:
            policy.write_text(_policy(folder, socks, strategy))
            time.sleep(2.0)  # the policy reload (0.5 s poll)
            prompts = _system_prompts(socks[0], token, args.prompts, args.prompt_tokens, strategy, rng)
            before = [_prefix_counters(s, token) for s in socks]
            result = asyncio.run(_phase(url, key, prompts, args, args.seed + 1))
            after = [_prefix_counters(s, token) for s in socks]
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            result["prefix_cache_hit_rate"] = round(hits / queries, 3) if queries else None
            phases[strategy] = result
            print(strategy, json.dumps(result), file=sys.stderr, flush=True)
    finally:
        for proc in reversed(procs):
            _stop(proc)
    shutil.rmtree(folder, ignore_errors=True)  # kept when the run failed: its logs say why
    rr, pa = phases["round_robin"], phases["prefix"]
    routing = measure(args.replicas, 20000)
    return {"date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "scale": {"replicas": args.replicas, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                      "requests": args.requests, "rate_per_s": args.rate, "max_tokens": args.max_tokens,
                      "kv_cache_memory": args.kv_cache_memory, "engine_threads": args.engine_threads},
            "phases": phases,
            "hit_rate_ratio_prefix_vs_round_robin": round(pa["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"], 2)
            if rr["prefix_cache_hit_rate"] else None,
            "routing_us_per_decision": routing["us_per_decision_median"],
            "routing_cpu_us_per_decision": routing["cpu_us_per_decision_median"],
            "targets": {"hit_rate_ratio_ge_1_5": bool(rr["prefix_cache_hit_rate"]) and
                        pa["prefix_cache_hit_rate"] >= 1.5 * rr["prefix_cache_hit_rate"],
                        "ttft_p99_lower": pa["ttft_p99_ms"] < rr["ttft_p99_ms"],
                        "routing_le_200_us": routing["us_per_decision_median"] <= 200}}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["routing", "workload"])
    parser.add_argument("--requests", type=int, help="routing: decisions timed (20000); workload: requests "
                        "per strategy (256)")
    parser.add_argument("--rate", type=float, default=4.0, help="workload: Poisson arrivals per second")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="20MiB", help="per engine; the demo model's KV is 4 KiB a "
                        "token, so 20 MiB holds ~5,000 tokens: about half the prompts")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="workload: also write the JSON here")
    args = parser.parse_args()
    if args.what == "routing":
        results = [measure(n, args.requests or 20000) for n in (2, 8)]
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "cores": os.cpu_count(),
                          "load_average_1m": round(os.getloadavg()[0], 2), "routing": results, "target_us": 200},
                         indent=2))
        return
    args.requests = args.requests or 256
    report = workload(args)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
