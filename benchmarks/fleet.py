"""Fleet routing (issue 17): the cost of the gateway's routing decision per request.

Times what the gateway adds per request when the policy lists upstreams: reading the leading
text of the body (`leading_text`), hashing it in salted chunks (`affinity_chain`) and choosing
a replica (`Fleet.pick`: group filter, load scores, affinity lookup, remembering the chain),
for chat bodies with a long shared system prompt, over 2 and 8 replicas, many tenants.
Target: <= 0.2 ms per request. Prints one JSON object.

    python benchmarks/fleet.py routing [--requests 20000]

The shared-prefix workload over real engines (round-robin vs least-load vs prefix-aware:
prefix-cache hit rate, TTFT p50/p99, throughput) is not written yet (see issue 17).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.upstream.fleet import Fleet, ReplicaConfig, affinity_chain, leading_text  # noqa: E402


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
    fleet, bodies = _fleet(replicas), _bodies(requests)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for i, body in enumerate(bodies):
            replica = fleet.pick("demo", affinity_chain(leading_text(body), f"salt-{i % 50}"))
            replica.in_flight = (replica.in_flight + 1) % 4  # some churn in the loads
        rounds.append((time.perf_counter() - started) / requests * 1e6)
    return {"replicas": replicas, "requests": requests, "us_per_decision_median": round(statistics.median(rounds), 2),
            "us_per_decision_max": round(max(rounds), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["routing"])
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    results = [measure(n, args.requests) for n in (2, 8)]
    print(json.dumps({"routing": results, "target_us": 200}, indent=2))


if __name__ == "__main__":
    main()
