"""`portcullis bench serve` against `portcullis serve` on the demo model, as a user runs both,
and the serving block of benchmarks/README.md (table and plots) regenerated from the saved results.

A request-rate sweep (Poisson arrivals, then all at once) of random prompts through the
gateway with an API key: request and output-token throughput, TTFT/TPOT/ITL/E2EL and goodput per
rate. The JSON results and PNGs go to benchmarks/results/bench-serve/; the block between the two
markers in benchmarks/README.md is rewritten from those files, so `--readme-only` redoes it alone.

    .venv/bin/python benchmarks/bench_serve_readme.py [--num-prompts 48] [--rates 1,2,4,inf]
    .venv/bin/python benchmarks/bench_serve_readme.py --readme-only
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

from portcullis.host import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench-serve"
STEM = "serve-demo"  # bench serve writes STEM-<rate>qps.json and STEM-*.png
BEGIN, END = "<!-- bench-serve:begin -->", "<!-- bench-serve:end -->"
GOODPUT = ("ttft:1000", "tpot:100")  # an interactive user's bounds, in ms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(home: Path, port: int, key: str) -> subprocess.Popen:
    """`portcullis serve` (demo model, default flags) with a static key, ready to answer."""
    env = {**os.environ, "VLLM_API_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "portcullis.cli", "serve", "--port", str(port), "--home", str(home)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"portcullis serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit("portcullis serve was not ready within 300 s")


def run_bench(port: int, key: str, args: argparse.Namespace) -> None:
    for old in RESULTS.glob(f"{STEM}-*"):
        old.unlink()
    cmd = [sys.executable, "-m", "portcullis.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--api-key", key, "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--request-rate", args.rates, "--seed", "0",
           "--max-concurrency", str(args.max_concurrency), "--goodput", *GOODPUT, "--save-result", "--plot",
           "--result-dir", str(RESULTS), "--result-filename", f"{STEM}.json", "--disable-tqdm"]
    subprocess.run(cmd, cwd=ROOT, check=True)


def readme_block(results: list[dict], cpu: str) -> str:
    first = results[0]
    rows = ["| request rate | req/s | output tok/s | TTFT median / p99 (ms) | TPOT median / p99 (ms) "
            "| ITL median (ms) | E2EL median (ms) | goodput (req/s) | failed |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['request_rate']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
                    f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / "
                    f"{r['p99_tpot_ms']:.1f} | {r['median_itl_ms']:.1f} | {r['median_e2el_ms']:.0f} "
                    f"| {r['request_goodput'] or 0:.2f} | {r['failed']} |")
    plots = sorted(p.name for p in RESULTS.glob(f"{STEM}-*.png"))
    images = "\n".join(f"![{name}](results/bench-serve/{name})" for name in plots)  # from benchmarks/
    return "\n".join([
        BEGIN,
        f"`portcullis bench serve` through the gateway of `portcullis serve` (demo model, default flags), "
        f"{first['date'][:4]}-{first['date'][4:6]}-{first['date'][6:8]}, {cpu}, 2 cores: {first['num_prompts']} random prompts per rate, "
        f"{first['total_input_tokens'] // max(first['completed'], 1)} tokens in, up to "
        f"{first['total_output_tokens'] // max(first['completed'], 1)} out, max concurrency "
        f"{first['max_concurrency']}; goodput counts requests with TTFT <= 1 s and TPOT <= 100 ms. "
        f"Regenerate with `python benchmarks/bench_serve_readme.py`.",
        "", *rows, "", images, END])


def load_results() -> list[dict]:
    found = [json.loads(p.read_text()) for p in RESULTS.glob(f"{STEM}-*qps.json")]
    if not found:
        raise SystemExit(f"no saved results in {RESULTS.relative_to(ROOT)}: run without --readme-only first")
    return sorted(found, key=lambda r: float(r["request_rate"]))


def rewrite_readme(block: str) -> None:
    readme = ROOT / "benchmarks" / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"benchmarks/README.md has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + block + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rates", default="1,2,4,inf")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--readme-only", action="store_true", help="rewrite benchmarks/README.md's block from the saved results")
    args = p.parse_args(argv)
    if not args.readme_only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        key, port = "bench-" + secrets.token_urlsafe(24), free_port()
        with tempfile.TemporaryDirectory() as home:
            proc = start_serve(Path(home), port, key)
            try:
                run_bench(port, key, args)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    rewrite_readme(readme_block(load_results(), cpu_model()))
    print(f"benchmarks/README.md rewritten from {RESULTS.relative_to(ROOT)} ({date.today()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
