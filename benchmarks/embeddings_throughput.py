"""Embedding throughput: Portcullis `LLM.embed` (pooling runner) against Hugging Face batched
forward + the same pooling, same inputs, same run.

Inputs are what an IDE's codebase indexing sends: chunks of 16-512 tokens in arrival order, either
uniform in length or skewed (log-uniform: many short functions, a few long files' chunks). Both
sides do the same useful work; the baseline pays for padding each batch to its longest input,
which is most of what the engine saves (its per-token work is the same matmuls). The model has
Qwen3-Embedding-0.6B's shapes with 8 of its 28 layers (random weights: speed does not depend on
them), saved as a base model, so the engine picks the pooling runner by itself. Inputs per second
are the median of alternated rounds; vectors are checked to agree.

    .venv/bin/python benchmarks/embeddings_throughput.py [--inputs 256] [--rounds 3] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # one dtype on every CPU, as the HF baseline

from portcullis.engine import LLM  # noqa: E402

SHAPES = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
              rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, is_matryoshka=True)


def checkpoint(tmp: Path) -> Path:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("qwen3", **SHAPES, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    return tmp


def inputs(n: int, vocab: int, lengths: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def length() -> int:
        return rng.randint(16, 512) if lengths == "uniform" else int(16 * 32 ** rng.random())

    return [[rng.randrange(3, vocab) for _ in range(length())] for _ in range(n)]


def run_engine(llm: LLM, work: list[list[int]]) -> tuple[float, list[list[float]]]:
    start = time.perf_counter()
    out = llm.embed([{"prompt_token_ids": ids} for ids in work], use_tqdm=False)
    return time.perf_counter() - start, [o.outputs.embedding for o in out]


def run_hf(model, work: list[list[int]], batch: int) -> tuple[float, list[torch.Tensor]]:
    """Right-padded batches with an attention mask; last real token of each row, L2-normalised."""
    start = time.perf_counter()
    vectors = []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(ids) for ids in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(chunk)), mask.sum(1) - 1]
        vectors += list(torch.nn.functional.normalize(last, dim=-1))
    return time.perf_counter() - start, vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--lengths", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/embeddings_throughput.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp))
        llm = LLM(str(path), max_model_len=1024, kv_cache_memory=1 << 30, skip_tokenizer_init=True)
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        for lengths in args.lengths:
            results.append(compare(llm, model, inputs(args.inputs, SHAPES["vocab_size"], lengths), lengths, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def compare(llm: LLM, model, work: list[list[int]], lengths: str, args) -> dict:
    engine_s, hf_s, diff = [], [], 0.0
    with torch.inference_mode():
        for _ in range(args.rounds):  # alternated: both see the same minutes of a shared machine
            seconds, ours = run_engine(llm, work)
            engine_s.append(seconds)
            seconds, theirs = run_hf(model, work, args.hf_batch)
            hf_s.append(seconds)
            diff = max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(ours, theirs))
    engine_rate, hf_rate = len(work) / statistics.median(engine_s), len(work) / statistics.median(hf_s)
    return {
        "date": time.strftime("%Y-%m-%d"), "lengths": lengths, "inputs": len(work), "tokens": sum(map(len, work)),
        "threads": torch.get_num_threads(), "engine_inputs_per_s": engine_rate,
        f"hf_batched_{args.hf_batch}_inputs_per_s": hf_rate, "speedup": engine_rate / hf_rate,
        "max_abs_difference": diff, "engine_seconds": engine_s, "hf_seconds": hf_s,
    }


if __name__ == "__main__":
    main()
