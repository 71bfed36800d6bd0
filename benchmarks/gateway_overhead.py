"""What the gateway costs: direct to the stub engine vs through the gateway vs LiteLLM's proxy.

Load comes from `wrk` (a separate, fast process; a Python load generator tops out near 400
requests/s on 2 cores and would measure itself). Time to first streamed chunk is measured by
a sequential client here, identically for every target, so its own overhead cancels out in
the "added" figures. CPU per request is the target's process-tree CPU seconds over a run
divided by the requests it served.

    python benchmarks/gateway_overhead.py [--duration 10] [--litellm PATH] [--skip-litellm]

Needs: wrk (Debian: `apt-get install wrk`); for `--workers 2` with Redis-backed limits,
redis-server (or --redis-url); for the peer, LiteLLM's proxy installed in a throwaway venv
outside this repository (`python -m venv /tmp/litellm && /tmp/litellm/bin/pip install
'litellm[proxy]'`, then --litellm /tmp/litellm/bin/litellm). What is missing is reported and
that part skipped. Results: benchmarks/results/gateway_overhead-<date>.json, and the table in
benchmarks/GATEWAY.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from portcullis.host import cpu_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKEN = "bench-internal-token-0123456789abcdef"
MASTER_KEY = "sk-bench-master-key-0123456789"
COMPLETION = {"model": "demo", "prompt": "Say hello to the benchmark.", "max_tokens": 16}
STREAM = {"model": "demo", "messages": [{"role": "user", "content": "Say hello."}],
          "max_tokens": 16, "stream": True}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- processes ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, headers: dict[str, str] | None = None, timeout: float = 90.0,
              transport: httpx.HTTPTransport | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with httpx.Client(transport=transport, timeout=2.0) as client:
                if client.get(url, headers=headers).status_code < 500:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout:.0f} s")


@dataclass
class Target:
    name: str
    url: str  # base URL wrk hits
    auth: str
    proc: subprocess.Popen | None = None
    results: dict[str, Any] = field(default_factory=dict)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    handle = open(log, "wb")
    return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its live descendants (gateway workers included)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += (int(stats[current][11]) + int(stats[current][12])) / CLK_TCK
        todo.extend(children.get(current, []))
    return total


# ---- load ----------------------------------------------------------------------------------

LUA = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(auth)s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "non2xx": %%d, ' ..
    '"p50_ms": %%.4f, "p90_ms": %%.4f, "p99_ms": %%.4f, "mean_ms": %%.4f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    latency.mean / 1000))
end
"""


def run_wrk(wrk: str, target: Target, path: str, body: dict[str, Any], connections: int,
            duration: int, workdir: Path) -> dict[str, Any]:
    script = workdir / f"wrk-{target.name}-{connections}-{body.get('stream', False)}.lua"
    script.write_text(LUA % {"body": json.dumps(body), "auth": target.auth})
    threads = 1 if connections == 1 else 2
    cmd = [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--timeout", "10s", "-s", str(script),
           target.url + path]
    cpu_before = tree_cpu_seconds(target.proc.pid) if target.proc else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = (tree_cpu_seconds(target.proc.pid) - cpu_before) if target.proc else None
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    stats = json.loads(line[len("WRKJSON "):])
    stats["rps"] = round(stats["requests"] / (stats["duration_us"] / 1e6), 1)
    if cpu is not None and stats["requests"]:
        stats["cpu_ms_per_request"] = round(cpu * 1000 / stats["requests"], 3)
    return stats


def first_chunk_ms(target: Target, n: int) -> dict[str, float]:
    samples = first_chunk_samples(target, n)
    return {"p50_ms": round(statistics.median(samples), 3), "p99_ms": round(samples[int(len(samples) * 0.99) - 1], 3)}


def first_chunk_samples(target: Target, n: int) -> list[float]:
    """Sequential streamed requests over raw sockets: from the last byte sent to the first
    `data:` received. Raw sockets keep the client's own cost tiny and identical per target."""
    url = httpx.URL(target.url)
    body = json.dumps(STREAM).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
               f"Authorization: Bearer {target.auth}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    samples = []
    for i in range(n + 20):
        with socket.create_connection((url.host, url.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.perf_counter()
            sock.sendall(request)
            seen = b""
            while b"data:" not in seen:
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError(f"{target.name}: stream ended before any data: {seen[:200]!r}")
                seen += chunk
            elapsed = (time.perf_counter() - started) * 1000
            while sock.recv(65536):
                pass
        if i >= 20:  # warm-up excluded
            samples.append(elapsed)
    return sorted(samples)


ROUNDS = 3


def measure(wrk: str, target: Target, duration: int, workdir: Path, direct: Target | None = None) -> None:
    """Every figure for one target. With `direct`, one-client latencies are taken in rounds
    that alternate with direct-to-stub runs, and "added" is the median of the per-round
    differences: on a shared machine the load drifts, and a baseline from minutes earlier
    would be measuring the neighbours."""
    # Other work on a shared machine shows up as scheduling delay in every latency figure.
    target.results["loadavg_1min"] = round(os.getloadavg()[0], 2)
    print(f"  {target.name}: one client, non-streaming", flush=True)
    if direct is None:
        target.results["serial"] = run_wrk(wrk, target, "/v1/completions", COMPLETION, 1, duration, workdir)
        target.results["first_chunk"] = first_chunk_ms(target, 200)
    else:
        target.results.update(paired_serial(wrk, direct, target, duration, workdir))
    print(f"  {target.name}: one client, streaming 16 chunks", flush=True)
    target.results["serial_stream"] = run_wrk(wrk, target, "/v1/chat/completions", STREAM, 1, duration, workdir)
    print(f"  {target.name}: 32 clients", flush=True)
    target.results["c32"] = run_wrk(wrk, target, "/v1/completions", COMPLETION, 32, duration, workdir)


def paired_serial(wrk: str, direct: Target, target: Target, duration: int, workdir: Path) -> dict[str, Any]:
    slice_s = max(3, duration // 2)
    runs, p50s, p99s, firsts = [], [], [], []
    for _ in range(ROUNDS):
        base = run_wrk(wrk, direct, "/v1/completions", COMPLETION, 1, slice_s, workdir)
        run = run_wrk(wrk, target, "/v1/completions", COMPLETION, 1, slice_s, workdir)
        runs.append(run)
        p50s.append(run["p50_ms"] - base["p50_ms"])
        p99s.append(run["p99_ms"] - base["p99_ms"])
        firsts.append(statistics.median(first_chunk_samples(target, 60))
                      - statistics.median(first_chunk_samples(direct, 60)))
    requests = sum(r["requests"] for r in runs)
    cpu_ms = sum(r.get("cpu_ms_per_request", 0) * r["requests"] for r in runs)
    serial = {"requests": requests, "p50_ms": statistics.median(r["p50_ms"] for r in runs),
              "p99_ms": statistics.median(r["p99_ms"] for r in runs),
              "rps": round(statistics.median(r["rps"] for r in runs), 1),
              "cpu_ms_per_request": round(cpu_ms / requests, 3) if requests else None, "rounds": runs}
    added = {"p50_ms": round(statistics.median(p50s), 3), "p99_ms": round(statistics.median(p99s), 3),
             "first_chunk_p50_ms": round(statistics.median(firsts), 3),
             "per_round_p50_ms": [round(x, 3) for x in p50s]}
    return {"serial": serial, "added": added}


# ---- set-up --------------------------------------------------------------------------------

def policy_text(storage: str, audit: Path, keys_file: str) -> str:
    big = 10**9
    # Every limit the gateway has is on, budgets included, and never reached: the cost is counted.
    limits = {"requests_per_minute": big, "tokens_per_minute": big, "concurrent_requests": 1000,
              "budgets": {"tokens_per_day": big, "tokens_per_month": big,
                          "requests_per_day": big, "requests_per_month": big}}
    return json.dumps({
        "routes": [{"method": "POST", "path": "/v1/completions"},
                   {"method": "POST", "path": "/v1/chat/completions"},
                   {"method": "GET", "path": "/v1/models"}],
        "tenants": {"bench": {"models": ["demo"], "limits": limits, "key_limits": limits}},
        "keys_file": keys_file,
        "rate_limits": {"storage": storage, "auth_failures_per_minute": 1000},
        "audit": {"path": str(audit), "max_bytes": 1 << 30},
        "metrics": {"scope": "admin"},
    })  # JSON is YAML


def start_stub(workdir: Path, where: list[str], name: str) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "portcullis.testing.stub_engine", "--token-file", str(workdir / "token"),
                  *where], workdir / f"{name}.log")


def start_gateway(workdir: Path, name: str, storage: str, sock: Path, workers: int, otlp: str) -> Target:
    from portcullis.gateway.auth.keys import new_key, write_keys_file
    from portcullis.gateway.policy.models import KeysFile

    folder = workdir / name
    folder.mkdir()
    token, record = new_key("bench-user", "bench", [])
    write_keys_file(folder / "keys.yaml", KeysFile(keys=[record]))
    (folder / "policy.yaml").write_text(policy_text(storage, folder / "audit.log", "keys.yaml"))
    port = free_port()
    proc = spawn([sys.executable, "-m", "portcullis.cli", "gateway", "--policy", str(folder / "policy.yaml"),
                  "--engine-url", f"unix://{sock}", "--engine-token-file", str(workdir / "token"),
                  "--port", str(port), "--workers", str(workers), "--otlp-traces-endpoint", otlp],
                 folder / "gateway.log", env={"PYTHONPATH": str(ROOT)})
    target = Target(name, f"http://127.0.0.1:{port}", token, proc)
    wait_http(target.url + "/healthz", timeout=30)
    return target


def start_trace_sink() -> str:
    """An OTLP/HTTP endpoint that takes every span batch and drops it: the gateway exports its
    traces as it would to a collector, and the cost of making and sending them is counted."""
    import http.server
    import threading

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def start_litellm(litellm: str, workdir: Path, stub_port: int) -> Target:
    config = workdir / "litellm.yaml"
    config.write_text(json.dumps({
        "model_list": [{"model_name": "demo", "litellm_params": {
            "model": "openai/demo", "api_base": f"http://127.0.0.1:{stub_port}/v1", "api_key": TOKEN}}],
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"callbacks": [], "success_callback": [], "failure_callback": [],
                             "telemetry": False, "drop_params": True},
    }))
    port = free_port()
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "True",
           "LITELLM_TELEMETRY": "False"}
    env.pop("DATABASE_URL", None)
    proc = spawn([litellm, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                 workdir / "litellm.log", env=env)
    target = Target("litellm", f"http://127.0.0.1:{port}", MASTER_KEY, proc)
    wait_http(target.url + "/health/liveliness", timeout=180)
    return target


def start_redis(redis_server: str, workdir: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = spawn([redis_server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
                 workdir / "redis.log")
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}/0", proc


# ---- report --------------------------------------------------------------------------------

def derive(targets: dict[str, Target]) -> dict[str, Any]:
    direct = targets["direct"].results
    out: dict[str, Any] = {}
    for name, target in targets.items():
        if name == "direct" or not target.results:
            continue
        r = target.results
        added = r.get("added") or {
            "p50_ms": r["serial"]["p50_ms"] - direct["serial"]["p50_ms"],
            "p99_ms": r["serial"]["p99_ms"] - direct["serial"]["p99_ms"],
            "first_chunk_p50_ms": r["first_chunk"]["p50_ms"] - direct["first_chunk"]["p50_ms"],
        }
        out[name] = {
            "added_p50_ms": round(added["p50_ms"], 3),
            "added_p99_ms": round(added["p99_ms"], 3),
            "added_first_chunk_p50_ms": round(added["first_chunk_p50_ms"], 3),
            "cpu_ms_per_request": r["serial"].get("cpu_ms_per_request"),
            "cpu_ms_per_stream_request": r["serial_stream"].get("cpu_ms_per_request"),
        }
        if "c32" in r:
            out[name].update(c32_rps=r["c32"]["rps"], c32_p50_ms=r["c32"]["p50_ms"], c32_p99_ms=r["c32"]["p99_ms"])
    return out


def markdown(report: dict[str, Any]) -> str:
    d = report["derived"]
    names = [n for n in ("gateway", "gateway_2w_redis", "litellm") if n in d]
    rows = [("added latency p50, 1 client (ms)", "added_p50_ms"), ("added latency p99, 1 client (ms)", "added_p99_ms"),
            ("added time to first chunk p50 (ms)", "added_first_chunk_p50_ms"),
            ("CPU per request (ms)", "cpu_ms_per_request"), ("CPU per streamed request, 16 chunks (ms)",
                                                            "cpu_ms_per_stream_request"),
            ("requests/s at 32 clients", "c32_rps"), ("p50 at 32 clients (ms)", "c32_p50_ms"),
            ("p99 at 32 clients (ms)", "c32_p99_ms")]
    direct = report["targets"]["direct"]
    lines = [f"| measure | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(str(d[n].get(key, "-")) for n in names) + " |")
    loads = " | ".join(str(report["targets"][n].get("loadavg_1min", "-")) for n in names)
    lines.append(f"| load average (1 min) at start | {loads} |")
    lines.append("")
    if "litellm" in d and "gateway" in d:
        g, lt = d["gateway"], d["litellm"]
        lines.append(f"Against LiteLLM, one worker each: {lt['c32_rps'] and round(g['c32_rps'] / lt['c32_rps'], 1)}x "
                     f"the requests/s at 32 clients, {round(lt['cpu_ms_per_request'] / g['cpu_ms_per_request'], 1)}x "
                     f"less CPU per request, {round(lt['added_p50_ms'] / max(g['added_p50_ms'], 0.001), 1)}x less "
                     "added latency (p50, one client).")
        lines.append("")
    lines += targets_table(d)
    lines.append(f"Direct to the stub: p50 {direct['serial']['p50_ms']} ms at one client, "
                 f"{direct.get('c32', {}).get('rps', '-')} requests/s at 32 clients.")
    for note in report["notes"]:
        lines.append(f"\n_Note: {note}_")
    return "\n".join(lines)


TARGETS = [  # issue 6: (label, key, limit, "max" = at most / "min" = at least)
    ("added latency p50, 1 client <= 1.5 ms", "added_p50_ms", 1.5, "max"),
    ("added latency p99, 1 client <= 5 ms", "added_p99_ms", 5.0, "max"),
    ("added time to first chunk p50 <= 1.5 ms", "added_first_chunk_p50_ms", 1.5, "max"),
    ("CPU per request <= 2 ms", "cpu_ms_per_request", 2.0, "max"),
    ("CPU per streamed request (16 chunks) <= 3 ms", "cpu_ms_per_stream_request", 3.0, "max"),
]


def targets_table(d: dict[str, Any]) -> list[str]:
    """Each target of the issue against the one-worker gateway: met or not, no rounding up."""
    if "gateway" not in d:
        return []
    g = d["gateway"]
    rows = ["| target (one worker) | measured | met |", "|---|---|---|"]
    for label, key, limit, kind in TARGETS:
        value = g.get(key)
        met = value is not None and (value <= limit if kind == "max" else value >= limit)
        rows.append(f"| {label} | {value} | {'yes' if met else 'no'} |")
    if "litellm" in d and d["litellm"].get("c32_rps"):
        lt = d["litellm"]
        ratio = g["c32_rps"] / lt["c32_rps"]
        rows.append(f"| >= 10x LiteLLM's requests/s | {ratio:.1f}x | {'yes' if ratio >= 10 else 'no'} |")
        share = g["added_p50_ms"] / lt["added_p50_ms"] if lt["added_p50_ms"] > 0 else float("inf")
        rows.append(f"| <= 1/10 of LiteLLM's added latency | {share:.2f} | {'yes' if share <= 0.1 else 'no'} |")
    return rows + [""]


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gateway_overhead-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2))
    doc = HERE / "GATEWAY.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n## Gateway\n"
    head, rest = text.split("## Gateway\n", 1)
    # Only this section's table and its preamble: the subsections and sections after it stay.
    tail = min((i for i in (rest.find("\n### "), rest.find("\n## ")) if i >= 0), default=len(rest))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    section = (f"## Gateway\n\nMeasured {report['date']} by `benchmarks/gateway_overhead.py` on "
               f"{report['machine']} ({report['duration_s']} s per run; results in `{shown}`).\n"
               "Through the gateway: API-key auth, rate limits and day/month budgets (memory; Redis for "
               "`--workers 2`), the HMAC-chained audit log, and OpenTelemetry traces exported over OTLP/HTTP "
               "to a local sink, all on. Added = minus direct-to-stub.\n\n" + markdown(report) + "\n")
    doc.write_text(head + section + rest[tail:])
    return path


# ---- main ------------------------------------------------------------------------------------


def find_tools(args: argparse.Namespace) -> dict[str, str | None]:
    litellm = args.litellm or os.environ.get("LITELLM") or shutil.which("litellm")
    return {"wrk": args.wrk or shutil.which("wrk"),
            "redis-server": args.redis_server or shutil.which("redis-server"),
            "litellm": None if args.skip_litellm else litellm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--wrk")
    parser.add_argument("--redis-server")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--litellm", help="path to the litellm executable (in its own venv)")
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    tools = find_tools(args)
    if not tools["wrk"]:
        print("missing: wrk (install it: apt-get install -y wrk, or pass --wrk PATH)", file=sys.stderr)
        return 2
    notes = []
    if not tools["litellm"]:
        notes.append("LiteLLM not measured: pass --litellm PATH (install litellm[proxy] in a separate venv)")
    if not (tools["redis-server"] or args.redis_url):
        notes.append("--workers 2 not measured: no redis-server (apt-get install -y redis-server) or --redis-url")
    for note in notes:
        print(f"missing: {note}", file=sys.stderr)
    sys.path.insert(0, str(ROOT))
    return run(args, tools, notes)


def run(args: argparse.Namespace, tools: dict[str, str | None], notes: list[str]) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ptc-bench-"))
    (workdir / "token").write_text(TOKEN)
    procs: list[subprocess.Popen] = []
    targets: dict[str, Target] = {}
    try:
        otlp = start_trace_sink()
        sock, stub_port = workdir / "engine.sock", free_port()
        procs.append(start_stub(workdir, ["--uds", str(sock)], "stub-uds"))
        procs.append(start_stub(workdir, ["--port", str(stub_port)], "stub-tcp"))
        wait_http(f"http://127.0.0.1:{stub_port}/health")
        wait_http("http://engine/health", transport=httpx.HTTPTransport(uds=str(sock)))
        targets["direct"] = Target("direct", f"http://127.0.0.1:{stub_port}", TOKEN, procs[-1])
        print("direct to the stub engine", flush=True)
        measure(tools["wrk"], targets["direct"], args.duration, workdir)
        targets["gateway"] = start_gateway(workdir, "gateway", "memory://", sock, 1, otlp)
        print("through the gateway, 1 worker", flush=True)
        measure(tools["wrk"], targets["gateway"], args.duration, workdir, targets["direct"])
        stop(targets["gateway"].proc)
        if args.redis_url or tools["redis-server"]:
            redis_url = args.redis_url
            if redis_url is None:
                redis_url, redis_proc = start_redis(tools["redis-server"], workdir)
                procs.append(redis_proc)
            targets["gateway_2w_redis"] = start_gateway(workdir, "gateway_2w_redis", redis_url, sock, 2, otlp)
            print("through the gateway, 2 workers, Redis-backed limits", flush=True)
            measure(tools["wrk"], targets["gateway_2w_redis"], args.duration, workdir, targets["direct"])
            stop(targets["gateway_2w_redis"].proc)
        if tools["litellm"]:
            try:
                targets["litellm"] = start_litellm(tools["litellm"], workdir, stub_port)
                print("through LiteLLM's proxy, 1 worker", flush=True)
                measure(tools["wrk"], targets["litellm"], args.duration, workdir, targets["direct"])
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                notes.append(f"LiteLLM failed: {exc} (log: {workdir / 'litellm.log'})")
            stop(targets.get("litellm", Target("", "", "")).proc)
    finally:
        for target in targets.values():
            stop(target.proc)
        for proc in procs:
            stop(proc)
    report = {
        "date": dt.date.today().isoformat(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {sys.platform}",
        "duration_s": args.duration,
        "targets": {name: t.results for name, t in targets.items()},
        "notes": notes,
    }
    report["derived"] = derive(targets)
    print(json.dumps(report["derived"], indent=2))
    path = write_report(report, args.out)
    print(f"wrote {path} and {HERE / 'GATEWAY.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
