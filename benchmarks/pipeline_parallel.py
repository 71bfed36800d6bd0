"""Pipeline parallelism on the CPU: the engine with its layers in 2 stages against 1 stage, same
workload, alternated rounds in one run; and what a step's hand-offs cost between two processes.

Expected slower on one machine: the stages share its cores (each process gets half the threads),
and every step pays the hand-offs. Pipeline parallelism is for models larger than one device's
memory; this measures its cost, not a speed-up.

Workload: the real SmolLM2-135M-Instruct (Q4_1 GGUF, `make setup` fetches it; the demo model
otherwise), 32 requests, prompts 64..256 tokens, outputs 32..64 (seeded, ignore_eos).

Hand-offs (Gloo over loopback, two processes, median of 50): the hidden states a stage passes on
(float32, tokens × hidden) for a decode step of 16 and 64 sequences and a 2,048-token prefill, and
the logits the last stage sends back for 16 and 64 sampled rows.

    .venv/bin/python benchmarks/pipeline_parallel.py [--rounds 2] [--out benchmarks/results/pipeline_parallel.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from portcullis.engine import LLM, SamplingParams  # noqa: E402
from portcullis.engine.assets import SMOLLM2, cached, default_model  # noqa: E402
from portcullis.host import cpu_model  # noqa: E402

REQUESTS, PROMPT, OUTPUT = 32, (64, 256), (32, 64)


def workload(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT))], rng.randint(*OUTPUT))
            for _ in range(REQUESTS)]


def engine_round(model: str, stages: int) -> dict:
    """Output tokens per second of one `generate` over the workload (load time excluded)."""
    with LLM(model, pipeline_parallel_size=stages, max_model_len=512, kv_cache_memory=256 << 20) as llm:
        jobs = workload(llm.config.hf_config.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in jobs]
        llm.generate([p for p, _ in jobs[:2]], params[:2], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in jobs], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"stages": stages, "seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_s": round(tokens / seconds, 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHAPES = {"hidden, decode of 16": (16, 576), "hidden, decode of 64": (64, 576),
          "hidden, prefill of 2048": (2048, 576), "logits, 16 rows": (16, 49152), "logits, 64 rows": (64, 49152)}


def _handoff_peer(rank: int, port: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, shape in SHAPES.items():
        x = torch.randn(shape)
        times = []
        for _ in range(repeats):  # a round trip, halved: one hand-off
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - start) * 1e3 / 2)
        results[name] = {"shape": list(shape), "mbytes": round(x.numel() * 4 / 1e6, 3),
                         "median_ms": round(statistics.median(times), 3)}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def handoffs(repeats: int = 50) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_handoff_peer, args=(rank, port, repeats, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/pipeline_parallel.json")
    args = parser.parse_args()
    model = str(cached(SMOLLM2) or default_model())
    runs = [engine_round(model, stages) for _ in range(args.rounds) for stages in (1, 2)]
    median = {s: statistics.median(r["output_tok_s"] for r in runs if r["stages"] == s) for s in (1, 2)}
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": os.cpu_count(), "model": Path(model).name,
        "workload": {"requests": REQUESTS, "prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "runs": runs, "median_output_tok_s": median, "pp2_over_pp1": round(median[2] / median[1], 3),
        "handoffs": handoffs(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
