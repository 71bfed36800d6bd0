"""Engine server under load: streamed completions from many concurrent clients, against
`EngineCore` driven directly with the same requests in the same run (the server's ceiling).

The server runs as its own process (`python -m portcullis.engine`, on a Unix socket), the load generator
here (httpx, raw SSE). Reported: output tokens/s of both and their ratio (what the HTTP side,
streaming and the engine-thread hand-off cost), requests/s, TTFT, ITL and end-to-end latency
percentiles. Both sides keep `concurrency` requests in flight and get the same warm-up.

Workload (seeded, ignore_eos, greedy): N requests with random token-id prompts and output
lengths in the given ranges. Model: the demo model when its weights exist, else a
random-weight model of the demo model's shapes (same speed).

    .venv/bin/python benchmarks/server_throughput.py [--requests 128] [--concurrency 64] \
        [--model DIR] [--out benchmarks/results/server_throughput.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # one dtype on every CPU, as the HF baseline

from portcullis.engine import SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402

ENGINE_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "1GiB"]


def demo_shaped_model(out: Path) -> Path:
    """Random weights with the demo model's shapes, next to its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return out


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 4096) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]


def warmup(work: list[tuple[list[int], int]], concurrency: int) -> list[tuple[list[int], int]]:
    """A full batch of other prompts with the workload's shapes."""
    return [([3 + (t - 2) % 4093 for t in p], n) for p, n in work[:concurrency]]


def start_server(model: Path, sock: Path, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "portcullis.engine", str(model), "--uds", str(sock), "--no-token",
           "--served-model-name", "bench", "--log-format", "json", "--max-num-seqs", str(max_num_seqs), *ENGINE_ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited: {proc.stderr.read()}")
        try:
            if client.get("/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the engine did not become healthy in time")


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
            elif chunk.get("usage"):
                usage = chunk["usage"]
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - start, "e2e": time.perf_counter() - start, "itl": itl,
            "tokens": usage["completion_tokens"]}


async def drive(sock: Path, work: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    transport = httpx.AsyncHTTPTransport(uds=str(sock), limits=limits)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=600) as client:
        async def gated(prompt, n):
            async with gate:
                return await one_request(client, prompt, n)

        # Warm-up with the same shapes of work: the first steps of a fresh engine are slow
        # (allocator and kernel caches), and both sides of the comparison get the same warm-up.
        await asyncio.gather(*(gated(p, n) for p, n in warmup(work, concurrency)))
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p, n) for p, n in work))
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def engine_alone(model: Path, work: list[tuple[list[int], int]], concurrency: int) -> float:
    """The same requests through `EngineCore` directly, `concurrency` in flight at a time
    (a new one as soon as one finishes, as the HTTP clients do): the server's ceiling."""
    from portcullis.engine.config import EngineConfig
    from portcullis.engine.core.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=str(model), max_model_len=1024, kv_cache_memory=1 << 30,
                                   max_num_seqs=concurrency))

    def run(batch: list[tuple[list[int], int]], tag: str) -> int:
        pending, tokens, in_flight = list(enumerate(batch)), 0, 0
        while pending or core.has_unfinished_requests():
            while pending and in_flight < concurrency:
                i, (prompt, n) = pending.pop(0)
                core.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                in_flight += 1
            for out in core.step():
                tokens += len(out.new_token_ids)
                in_flight -= out.finished
        return tokens

    run(warmup(work, concurrency), "warm")
    start = time.perf_counter()
    tokens = run(work, "run")
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/server_throughput.json")
    args = ap.parse_args()
    work = workload(args.requests, tuple(args.prompt_len), tuple(args.output_len))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "model.safetensors").is_file() else demo_shaped_model(Path(tmp) / "m")
        sock = Path(tmp) / "engine.sock"
        proc = start_server(model, sock, args.concurrency)
        try:
            results, elapsed = asyncio.run(drive(sock, work, args.concurrency))
        finally:
            proc.terminate()
            proc.wait(30)
        offline_tps = engine_alone(model, work, args.concurrency)
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    report = {
        "model": "demo" if model == DEMO_MODEL_DIR else "demo-shaped random weights",
        "requests": args.requests, "concurrency": args.concurrency, "cpus": os.cpu_count(),
        "server_output_tokens_per_s": round(tokens / elapsed, 1),
        "engine_alone_output_tokens_per_s": round(offline_tps, 1),
        "server_over_engine_alone": round(tokens / elapsed / offline_tps, 3),
        "requests_per_s": round(len(results) / elapsed, 2),
        "ttft_s": {"p50": pct([r["ttft"] for r in results], 0.5), "p99": pct([r["ttft"] for r in results], 0.99)},
        "itl_s": {"p50": pct(itl, 0.5), "p99": pct(itl, 0.99), "mean": statistics.fmean(itl) if itl else None},
        "e2e_s": {"p50": pct([r["e2e"] for r in results], 0.5), "p99": pct([r["e2e"] for r in results], 0.99)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
