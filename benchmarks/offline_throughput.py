"""Offline throughput: Portcullis `engine.LLM` against Hugging Face `generate`, same workload, same run.

Workloads (seeded, ignore_eos, counting only the tokens each request asked for):
* demo: the embedded demo model, 128 requests, prompts 32..512 tokens, outputs 16..256;
* qwen0.5b: a random-weight model with Qwen2.5-0.5B's shapes, 32 requests, prompts 32..256, outputs 16..128;
* smollm2: the real SmolLM2-135M-Instruct from its Q4_1 GGUF file (`make setup` fetches it), read by
  both sides (dequantized to the run dtype), 64 requests, prompts 32..512, outputs 16..128; plus the
  GGUF load's wall time and peak RSS, in a fresh process, against the size of the weights it holds.

Baselines: HF `generate` in static, left-padded batches of 16 (a batch runs until its longest
request is done), and HF one request at a time on a sample of 16 requests.
Also reported: KV-cache efficiency at peak (tokens held / slots allocated).

    .venv/bin/python benchmarks/offline_throughput.py [--workload demo qwen0.5b] [--out benchmarks/results/offline_throughput.json]
        [--threads N] [--dtype float32|bfloat16] [--engine-only] [--profile]

--dtype runs both sides in that dtype (default float32, where the engine matches HF token for
token; bfloat16 is worth reporting on CPUs that run it fast: see engine/cpu_dtype.py).

--engine-only skips the HF baselines; --profile prints where the engine's step loop spends its
CPU time (cProfile, by own time), for finding per-step overhead.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # one dtype on every CPU, as the HF baseline

from portcullis.engine import LLM, SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR, SMOLLM2, cached  # noqa: E402
from portcullis.host import cpu_model as _cpu_model  # noqa: E402

WORKLOADS = {
    "demo": dict(requests=128, prompt=(32, 512), output=(16, 256)),
    "qwen0.5b": dict(requests=32, prompt=(32, 256), output=(16, 128)),
    "smollm2": dict(requests=64, prompt=(32, 512), output=(16, 128)),
}
QWEN_05B_SHAPES = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
)


def make_workload(spec: dict, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs for a `WORKLOADS`-style spec."""
    rng = random.Random(seed)
    out = []
    for _ in range(spec["requests"]):
        plen, olen = rng.randint(*spec["prompt"]), rng.randint(*spec["output"])
        out.append(([rng.randrange(3, vocab) for _ in range(plen)], olen))
    return out


def qwen_checkpoint(tmp: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **QWEN_05B_SHAPES, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    return tmp


def workload_model(name: str, tmp: Path) -> tuple[Path, int]:
    """The model a workload runs on (the Qwen shapes are written into tmp) and its vocabulary."""
    if name == "demo":
        return DEMO_MODEL_DIR, json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]
    if name == "smollm2":
        path = cached(SMOLLM2)
        if path is None:
            sys.exit(f"{SMOLLM2.file} is not in the cache: run `make setup`")
        return path, 49152
    return qwen_checkpoint(tmp), QWEN_05B_SHAPES["vocab_size"]


# Peak RSS from /proc (VmHWM): getrusage's ru_maxrss keeps the forking parent's peak across exec.
LOAD_PROBE = """
import re, sys, time
started = time.perf_counter()
from portcullis.engine import LLM
llm = LLM(sys.argv[1], max_model_len=1024, kv_cache_memory=16 << 20, skip_tokenizer_init=True)
seconds = time.perf_counter() - started
model = llm.engine.model_runner.model
held = {id(t): t for t in model.parameters()}
held.update((id(m.packed), m.packed) for m in model.modules() if getattr(m, "packed", None) is not None)
weights = sum(t.numel() * t.element_size() for t in held.values())
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
print(seconds, peak, weights)
"""


def load_cost(path: Path) -> dict:
    """A GGUF load in a fresh process (its metadata already converted once): wall seconds, peak
    RSS, and the bytes the loaded weights hold (oneDNN's packed linear weights included)."""
    import subprocess

    subprocess.run([sys.executable, "-c", LOAD_PROBE, str(path)], check=True, capture_output=True)  # converts once
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(path)], check=True, capture_output=True, text=True)
    seconds, rss, weights = out.stdout.split()[-3:]
    return {"load_seconds": float(seconds), "peak_rss_mb": int(rss) / 1e6, "parameter_mb": int(weights) / 1e6,
            "file_mb": path.stat().st_size / 1e6}


def run_engine(path: Path, work, max_model_len: int, profile: bool = False, **llm_kwargs) -> dict:
    llm_kwargs = {"kv_cache_memory": 2 << 30, **llm_kwargs}
    llm = LLM(str(path), max_model_len=max_model_len, seed=0, skip_tokenizer_init=True, **llm_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True) for _, olen in work]
    peak = {"held": 0, "slots": 0}
    core = llm.engine
    for i, ((prompt, _), sp) in enumerate(zip(work, params)):
        core.add_request(f"bench-{i}", prompt, sp)
    profiler = cProfile.Profile() if profile else None
    start, start_cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    while core.has_unfinished_requests():
        core.step()
        _track_kv_efficiency(core, peak)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    tokens = sum(olen for _, olen in work)
    return {
        "output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
        "cpu_seconds": cpu, "tokens_per_cpu_s": tokens / cpu,
        "kv_efficiency_at_peak": peak["held"] / peak["slots"] if peak["slots"] else None,
        "peak_tokens_held": peak["held"], "peak_slots_allocated": peak["slots"],
        "preemptions": core.stats.num_preemptions,
    }


def _track_kv_efficiency(core, peak: dict) -> None:
    pool = core.kv.pool
    used = pool.num_blocks - pool.num_free
    if used * core.config.block_size > peak["slots"]:
        held = sum(r.num_computed_tokens for r in core.scheduler.running)
        peak.update(held=held, slots=used * core.config.block_size)


def run_hf_batched(model, work, batch: int = 16) -> dict:
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):  # left padding, as generate expects for decoder-only models
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(o for _, o in chunk)
        ids, mask = ids.to(model.device), mask.to(model.device)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                       repetition_penalty=1.0)  # the engine side runs no penalty either
    elapsed = time.perf_counter() - start
    tokens = sum(o for _, o in work)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def run_hf_single(model, work, sample: int = 16) -> dict:
    chosen = work[:sample]
    start = time.perf_counter()
    for p, o in chosen:
        ids = torch.tensor([p])
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=o, min_new_tokens=o, pad_token_id=0,
                       repetition_penalty=1.0)
    elapsed = time.perf_counter() - start
    tokens = sum(o for _, o in chosen)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "requests": len(chosen)}


def bench(name: str, path: Path, vocab: int, dtype: torch.dtype, engine_only: bool = False,
          profile: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    work = make_workload(WORKLOADS[name], vocab)
    max_len = max(len(p) + o for p, o in work) + 16
    result = {"workload": name, "requests": len(work),
              "engine": run_engine(path, work, max_len, profile=profile)}
    if engine_only:
        return result
    if path.is_file():  # a GGUF file: transformers dequantizes it too
        result["gguf_load"] = load_cost(path)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        result["hf_batched_16"] = run_hf_batched(model, work)
        result["hf_single"] = run_hf_single(model, work)
    best = max(result["hf_batched_16"]["tokens_per_s"], result["hf_single"]["tokens_per_s"])
    result["speedup_vs_best_hf"] = result["engine"]["tokens_per_s"] / best
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/offline_throughput.json"))
    ap.add_argument("--threads", type=int, help="torch threads for both engine and baseline (default: torch's)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides' dtype")
    ap.add_argument("--engine-only", action="store_true", help="skip the Hugging Face baselines")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the engine's step loop")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["PORTCULLIS_CPU_DTYPE"] = args.dtype  # the engine's dtype on a CPU
    torch.manual_seed(0)
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "dtype": args.dtype,
               "torch_threads": torch.get_num_threads(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workload:
            path, vocab = workload_model(name, Path(tmp))
            results["runs"].append(bench(name, path, vocab, getattr(torch, args.dtype), args.engine_only,
                                         args.profile))
            print(_row(results["runs"][-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    print("| workload | engine tok/s | HF batched-16 tok/s | HF single tok/s | speed-up vs best HF | KV efficiency at peak |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(_row(r))


def _row(r: dict) -> str:
    e, eff = r["engine"], r["engine"]["kv_efficiency_at_peak"]
    if "hf_batched_16" not in r:
        return (f"| {r['workload']} ({r['requests']} req) | {e['tokens_per_s']:.0f} "
                f"({e['tokens_per_cpu_s']:.0f} per CPU-s) | - | - | - | {eff:.1%} |")
    b, s = r["hf_batched_16"], r["hf_single"]
    return (f"| {r['workload']} ({r['requests']} req) | {e['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | "
            f"{s['tokens_per_s']:.0f} | {r['speedup_vs_best_hf']:.1f}x | {eff:.1%} |")


if __name__ == "__main__":
    main()
