"""CPU time per step of everything around the forward pass, with 256 running requests.

Measures schedule() + block management + input preparation (block-table update, flattening,
slot mapping, metadata tensors) + update() for steady-state decode steps, with the model's
forward pass and sampling replaced by a stand-in token so only the engine's bookkeeping is timed.
Target (issue 3): median <= 2 ms per step.

    .venv/bin/python benchmarks/scheduler_overhead.py [--requests 256] [--prompt 512] [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # one dtype on every CPU, as the HF baseline

from portcullis.engine import EngineCore, SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402
from portcullis.engine.config import EngineConfig  # noqa: E402
from portcullis.engine.outputs import ModelRunnerOutput  # noqa: E402


def bookkeeping_step(core: EngineCore) -> tuple[int, int]:
    """One engine step without the forward pass; returns (thread CPU ns, requests scheduled)."""
    start = time.thread_time_ns()
    out = core.scheduler.schedule()
    batch = core.model_runner.input_batch
    scheduled = batch.update(out)
    step = batch.prepare(scheduled)
    sampled: list[list[int]] = [[] for _ in scheduled]
    for i in step.sample_idx:
        sampled[i] = [7]
    batch.advance(scheduled, sampled)
    core.scheduler.update(out, ModelRunnerOutput(sampled, [None] * len(sampled)))
    return time.thread_time_ns() - start, len(scheduled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scheduler_overhead.json"))
    ap.add_argument("--model", default=None, help="a model directory (default: the demo model)")
    args = ap.parse_args()
    max_len = args.prompt + args.steps + 64
    config = EngineConfig(model=str(args.model or DEMO_MODEL_DIR), max_model_len=max_len, max_num_seqs=args.requests,
                          max_num_batched_tokens=8192, kv_cache_memory=2 << 30)
    core = EngineCore(config)
    for i in range(args.requests):
        prompt = [(i * 31 + j) % 4000 + 3 for j in range(args.prompt)]
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 32, ignore_eos=True))
    while core.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        bookkeeping_step(core)  # prefill, untimed
    samples = []
    for _ in range(args.steps):
        ns, n = bookkeeping_step(core)
        assert n == args.requests
        samples.append(ns / 1e6)
    samples.sort()
    result = {
        "date": time.strftime("%Y-%m-%d"), "running_requests": args.requests, "prompt_tokens": args.prompt,
        "steps": args.steps, "median_ms": statistics.median(samples),
        "p90_ms": samples[int(0.9 * len(samples))], "max_ms": samples[-1],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
