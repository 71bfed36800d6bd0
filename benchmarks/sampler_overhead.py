"""Cost of the full sampler and of structured output (issue: full sampler and structured output).

1. The sampler alone on a batch of 256 rows of Qwen2.5-0.5B-sized logits (vocab 151,936) with
   mixed parameters (greedy, temperature + top-p, top-k, min-p, penalties, logit bias, seeds,
   logprobs), against the time of one engine decode step of a random-weight model with
   Qwen2.5-0.5B's shapes at the same batch. Target: sampler <= 10% of the step.
2. Structured output: throughput of a batch where half the requests follow a JSON Schema,
   against the same batch unconstrained, and against it held to the same output lengths (five
   alternated rounds each, medians; see structured_throughput). Target: <= 10% lower.

    .venv/bin/python benchmarks/sampler_overhead.py [--skip-step] [--structured-05b] [--out benchmarks/results/sampler_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # one dtype on every CPU, as the HF baseline
sys.path.insert(0, str(ROOT / "benchmarks"))

from offline_throughput import QWEN_05B_SHAPES, qwen_checkpoint  # noqa: E402

from portcullis.engine import LLM, EngineCore, SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402
from portcullis.engine.config import EngineConfig  # noqa: E402
from portcullis.engine.sampling_params import StructuredOutputsParams  # noqa: E402
from portcullis.engine.worker.sampler import BatchSamplingArgs, sample  # noqa: E402

BATCH = 256


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=40, seed=i),
        dict(temperature=0.7, min_p=0.05),
        dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
        dict(temperature=0, logprobs=5),
        dict(temperature=1.0, logit_bias={11: 5.0, 12: -5.0}),
    ]
    return SamplingParams(max_tokens=64, ignore_eos=True, **kinds[i % len(kinds)])


def lm_like_logits(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Next-token logits shaped like a trained model's: Zipf-distributed probabilities
    (exponent 1.5, so the top 1,024 tokens hold about 97% of the mass), in a random order per row.
    Random-weight models give near-uniform logits, which no real workload sees."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.5 * ranks.log()
    return torch.stack([base[torch.randperm(vocab, generator=g)] for _ in range(rows)])


def time_sampler(vocab: int, repeats: int = 7) -> float:
    g = torch.Generator().manual_seed(0)
    params = [mixed_params(i) for i in range(BATCH)]
    prompts = [torch.randint(3, vocab, (200,), generator=g).tolist() for _ in range(BATCH)]
    outputs = [torch.randint(3, vocab, (50,), generator=g).tolist() for _ in range(BATCH)]
    logits = lm_like_logits(BATCH, vocab, g)
    times = []
    for _ in range(repeats):
        fresh = logits.clone()  # sample() overwrites its input, as it may the engine's logits
        start = time.perf_counter()
        # Built inside the timing, as the runner builds it every step (prompt ids are kept per request).
        args = BatchSamplingArgs(
            params=params, num_outputs=[len(o) for o in outputs], eos_token_ids=[()] * BATCH,
            output_token_ids=[o if p.uses_penalties else None for o, p in zip(outputs, params)],
            prompt_ids=[BatchSamplingArgs.distinct_ids(t, vocab) if p.uses_penalties else None
                        for t, p in zip(prompts, params)],
        )
        sample(fresh, args, torch.Generator().manual_seed(1))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_decode_step(path: Path, steps: int = 3) -> float:
    config = EngineConfig(model=str(path), max_model_len=512, max_num_seqs=BATCH, max_num_batched_tokens=8192,
                          kv_cache_memory=4 << 30)
    core = EngineCore(config)
    for i in range(BATCH):
        core.add_request(f"d{i}", [(i * 7 + j) % 1000 + 3 for j in range(32)], mixed_params(i))
    while core.num_waiting or core.stats.num_generated_tokens < BATCH:  # until every prompt is prefilled
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "count": {"type": "integer"},
    },
    "required": ["name", "tags", "count"],
}


def structured_throughput(path: Path, requests: int = 64, rounds: int = 5) -> dict:
    """Half the batch under a JSON Schema against the same batch unconstrained, five alternated
    rounds each (medians). Constrained replies stop when their JSON closes, so they are shorter,
    and a batch that thins out earlier makes fewer tokens per step whatever the grammar costs:
    a third variant, unconstrained but held to the very lengths the constrained run produced
    (ignore_eos), isolates the grammar's own cost at equal work."""
    llm = LLM(str(path), max_model_len=512, kv_cache_memory=1 << 30)
    prompts = [f"# example {i}\nconfig = " for i in range(requests)]
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=64)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    half = [constrained if i % 2 else plain for i in range(requests)]
    llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm up, compile the grammar
    outs = llm.generate(prompts, half, use_tqdm=False)
    valid = sum(1 for o, p in zip(outs, half) if p.structured_outputs is None or _valid_json(o.outputs[0].text))
    same_lengths = [SamplingParams(temperature=1.0, seed=0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
                    for o in outs]
    variants = {"unconstrained": [plain] * requests, "half_json_schema": half,
                "unconstrained_same_lengths": same_lengths}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):  # alternated, so all see the same minutes of a shared machine
        for name, params in variants.items():
            start = time.perf_counter()
            done = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            runs[name].append({"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed})
    result: dict = {name: {**sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2], "rounds": len(r)}
                    for name, r in runs.items()}  # the median round of each
    result["outputs_valid"] = f"{valid}/{requests}"
    per_s = {name: result[name]["tokens_per_s"] for name in variants}
    result["throughput_cost"] = 1 - per_s["half_json_schema"] / per_s["unconstrained"]
    result["throughput_cost_same_work"] = 1 - per_s["half_json_schema"] / per_s["unconstrained_same_lengths"]
    return result


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-step", action="store_true", help="skip the 0.5B decode step (slow on CPUs)")
    ap.add_argument("--structured-05b", action="store_true",
                    help="also measure structured output on the 0.5B-shaped model (about 10 minutes on 2 cores)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sampler_overhead.json"))
    args = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "batch": BATCH}
    res["sampler_seconds"] = time_sampler(QWEN_05B_SHAPES["vocab_size"])
    if not args.skip_step:
        with tempfile.TemporaryDirectory() as tmp:
            res["decode_step_seconds"] = time_decode_step(qwen_checkpoint(Path(tmp)))
        res["sampler_share_of_step"] = res["sampler_seconds"] / res["decode_step_seconds"]
    res["structured_output"] = structured_throughput(DEMO_MODEL_DIR)
    if args.structured_05b:  # a serving-size step, where the grammar's fixed cost per step weighs less
        with tempfile.TemporaryDirectory() as tmp:
            path = qwen_checkpoint(Path(tmp))
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(DEMO_MODEL_DIR / name, path / name)  # a real tokenizer for the grammar
            res["structured_output_05b"] = structured_throughput(path, rounds=3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
