"""The engine on an NVIDIA GPU: one prepared check of what the CPU test suite cannot show.

Run it on a machine with a GPU (a few minutes, after `benchmarks/kernels_gpu.py`):

1. greedy parity with transformers on the GPU in float32 (Triton attention, the sampler on
   CUDA tensors) for the demo model and a random-weight Qwen3-shaped model, with the default
   settings, chunked prefill mixed with decodes, and a second pass that hits the prefix cache;
2. the sampler on GPU logits: every parameter at once in one batch, logprobs against
   transformers' log-softmax, a seeded request alone and in a crowd, JSON Schema output;
3. KV-cache sizing from `gpu_memory_utilization` after the profiling pass;
4. offline throughput of a random-weight Qwen2.5-0.5B-shaped model in bfloat16 against
   transformers `generate` in static batches of 16, same workload, same run.

It writes its numbers to a JSON file and prints a short table last; exit status 0 when every
check passed.

    python benchmarks/engine_gpu.py [--json engine_gpu.json]
    python benchmarks/engine_gpu.py --smoke   # tiny sizes on the CPU (Triton interpreter),
                                              # to check the script itself without a GPU
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QWEN3_SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                   max_position_embeddings=4096, rms_norm_eps=1e-6, use_sliding_window=False)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "count": {"type": "integer"}}, "required": ["name", "count"]}


def random_checkpoint(model_type: str, out: Path, **shape) -> Path:
    """A random-weight checkpoint built by transformers itself, with the demo model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from portcullis.engine.assets import DEMO_MODEL_DIR

    config = AutoConfig.for_model(model_type, **shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEMO_MODEL_DIR / name).is_file():
            shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return out


def hf_model(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


# ---- 1. greedy parity ------------------------------------------------------------------------
def check_parity(name: str, path: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[dict]:
    from portcullis.engine import LLM, SamplingParams

    expected = hf_greedy(hf_model(path, device, torch.float32), prompts, new_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for setting, kwargs in (("default", {}), ("chunked prefill", dict(max_num_batched_tokens=64))):
        llm = LLM(str(path), dtype="float32", max_model_len=2048, kv_cache_memory=256 << 20, seed=0, **kwargs)
        for attempt in ("", ", prefix cached") if setting == "default" else ("",):
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            cached = sum(o.num_cached_tokens for o in outs)
            matched = sum(g == w for g, w in zip(got, expected))
            rows.append({"check": f"parity {name}: {setting}{attempt}", "ok": matched == len(prompts),
                         "detail": f"{matched}/{len(prompts)} prompts exact, {cached} cached tokens"})
        llm.engine.kv.pool.check_integrity()
        llm.shutdown()
    return rows


# ---- 2. the sampler on GPU logits --------------------------------------------------------------
def check_sampling(path: Path, device: str, requests: int = 48) -> list[dict]:
    from portcullis.engine import LLM, SamplingParams
    from portcullis.engine.sampling_params import StructuredOutputsParams

    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20, seed=0)
    prompts = [f"# example {i}\ndef f(x):" for i in range(requests)]
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40, seed=5), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
             dict(temperature=1.0, logit_bias={11: 5.0}, bad_token_ids=[12]), dict(temperature=1.0, n=2),
             dict(temperature=1.0, allowed_token_ids=list(range(3, 200)), min_tokens=4)]
    # An image without xgrammar still runs the rest; the row says what to bring.
    has_xgrammar = importlib.util.find_spec("xgrammar") is not None
    if has_xgrammar:
        kinds.append(dict(temperature=1.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    params = [SamplingParams(max_tokens=48, **kinds[i % len(kinds)]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    constrained = [o.outputs[0] for o, p in zip(outs, params) if p.structured_outputs is not None]
    parsed = sum(_parses(c.text) for c in constrained if c.finish_reason == "stop")
    finished = sum(c.finish_reason == "stop" for c in constrained)
    detail = f"{parsed}/{finished} finished JSON replies parse" if has_xgrammar else "xgrammar is not installed"
    rows = [{"check": "sampler: every parameter in one batch, JSON Schema replies parse",
             "ok": parsed == finished and finished > 0, "detail": detail}]

    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(prompts[:8], [seeded if i == 1 else params[i] for i in range(8)], use_tqdm=False)
    rows.append({"check": "sampler: a seeded request alone and in a crowd", "ok": crowd[1].outputs[0].token_ids == alone,
                 "detail": "same tokens" if crowd[1].outputs[0].token_ids == alone else "diverged"})

    rows.append(_check_logprobs(llm, path, prompts[0], device))
    llm.shutdown()
    return rows


def _check_logprobs(llm, path: Path, prompt: str, device: str) -> dict:
    from transformers import AutoTokenizer

    from portcullis.engine import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    with torch.inference_mode():
        logits = hf_model(path, device, torch.float32)(torch.tensor([ids], device=device)).logits[0, -1]
    want = torch.log_softmax(logits.float(), -1).topk(5)
    got = dict(out.outputs[0].logprobs[0].top)  # token id -> logprob, as the engine reports it
    ids_want = want.indices.tolist()
    err = max((abs(got[t] - float(v)) for t, v in zip(ids_want, want.values)), default=0.0) \
        if all(t in got for t in ids_want) else float("inf")
    return {"check": "sampler: top-5 logprobs against transformers", "ok": err < 1e-3, "detail": f"max error {err:.1e}"}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ---- 3. KV-cache sizing ------------------------------------------------------------------------
def check_sizing(path: Path) -> dict:
    from portcullis.engine import LLM

    utilization = 0.5
    llm = LLM(str(path), max_model_len=2048, gpu_memory_utilization=utilization, seed=0)
    runner = llm.engine.model_runner
    blocks = llm.engine.info.num_kv_blocks
    kv_gib = blocks * runner.kv_bytes_per_block() / 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    used = torch.cuda.memory_allocated()
    ok = blocks > 0 and used <= utilization * total * 1.02
    detail = f"{blocks} blocks = {kv_gib:.1f} GiB of KV; {used / 2**30:.1f} of {total / 2**30:.0f} GiB allocated"
    llm.shutdown()
    return {"check": f"KV cache sized from gpu_memory_utilization={utilization}", "ok": ok, "detail": detail}


# ---- 4. throughput -------------------------------------------------------------------------------
def throughput(path: Path, device: str, vocab: int, requests: int, prompt: tuple[int, int],
               output: tuple[int, int]) -> dict:
    from offline_throughput import make_workload, run_engine, run_hf_batched

    work = make_workload(dict(requests=requests, prompt=prompt, output=output), vocab)
    max_len = max(len(p) + o for p, o in work) + 16
    on_gpu = device == "cuda"
    engine = run_engine(path, work, max_len, dtype="bfloat16" if on_gpu else "float32",
                        kv_cache_memory=None if on_gpu else 64 << 20)
    if on_gpu:
        torch.cuda.empty_cache()  # the engine's KV cache is gone with it; make room for transformers
    model = hf_model(path, device, torch.bfloat16 if on_gpu else torch.float32)
    with torch.inference_mode():
        hf = run_hf_batched(model, work)
    return {"check": f"throughput {requests} requests, prompts {prompt[0]}-{prompt[1]}, outputs {output[0]}-{output[1]}",
            "ok": True, "engine_tok_s": engine["tokens_per_s"], "hf_batched_16_tok_s": hf["tokens_per_s"],
            "detail": f"engine {engine['tokens_per_s']:.0f} tok/s vs HF batched-16 {hf['tokens_per_s']:.0f} "
                      f"({engine['tokens_per_s'] / hf['tokens_per_s']:.1f}x)"}



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("engine_gpu.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through the Triton interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
        os.environ["PORTCULLIS_ATTENTION"] = "triton"
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("no CUDA device: run with --smoke to check the script on a CPU")
        return 2
    from offline_throughput import QWEN_05B_SHAPES, qwen_checkpoint

    from portcullis.engine.assets import DEMO_MODEL_DIR

    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shape = {**QWEN3_SMALL, "num_hidden_layers": 1} if args.smoke else QWEN3_SMALL
        qwen3 = random_checkpoint("qwen3", tmp / "qwen3", **shape)
        lengths = (1, 17, 40) if args.smoke else (1, 7, 16, 17, 33, 150, 300, 1000)
        prompts = [[(i * 37 + j * 11) % 4000 + 3 for j in range(n)] for i, n in enumerate(lengths)]
        models = [("qwen3 random", qwen3)] if args.smoke else [("demo model", DEMO_MODEL_DIR), ("qwen3 random", qwen3)]
        for name, path in models:
            rows += check_parity(name, path, prompts, 4 if args.smoke else 32, device)
            _print(rows[-1])
        if args.smoke:  # the interpreter is too slow for the sampler's batches; the sampler is what they check
            os.environ["PORTCULLIS_ATTENTION"] = "torch"
        rows += check_sampling(DEMO_MODEL_DIR, device, requests=16 if args.smoke else 48)
        if args.smoke:  # sizing needs CUDA memory; the smoke run times a tiny batch
            rows.append(throughput(qwen3, device, shape["vocab_size"], 4, (8, 24), (2, 4)))
        else:
            rows.append(check_sizing(DEMO_MODEL_DIR))
            _print(rows[-1])
            qwen05 = qwen_checkpoint(tmp / "qwen05")
            rows.append(throughput(qwen05, device, QWEN_05B_SHAPES["vocab_size"], 128, (64, 1024), (64, 256)))
        _print(rows[-1])
    result = {"date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "checks": rows, "seconds": time.perf_counter() - started}
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\n{result['device']} | {result['seconds']:.0f} s")
    for r in rows:
        print(f"{'ok ' if r['ok'] else 'NO '} {r['check']:<72} {r['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


def _print(row: dict) -> None:
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
