"""Greedy agreement of the engine with Hugging Face transformers on the demo model, in float32 and
in bfloat16 (issue 19: exact parity is the rule in float32; in bfloat16 both sides round, each in
its own order, so a near-tie can go either way: report how often).

Prompts: fifteen Python openings (the demo model's own domain) and eight random-token prompts of
1-300 tokens (the parity tests'); greedy, 48 new tokens, HF one prompt at a time, unpadded.
Also the probe's bf16/float32 ratio of the demo model's MLP shapes on this CPU.

    .venv/bin/python benchmarks/bf16_agreement.py [--new-tokens 48] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from portcullis.engine import LLM, SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402
from portcullis.engine.cpu_dtype import cpu_bf16_flags, measure_bf16_speedup  # noqa: E402
from portcullis.host import cpu_model  # noqa: E402

PYTHON_PROMPTS = (
    "def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:", "for i in range(10):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x", "try:\n    import json\nexcept ImportError:",
    "def count_words(text):\n    counts = {}\n    for word in text.split():", "def is_even(n):\n    if n % 2 == 0:",
    "import re\n\n\ndef parse_version(text):",
    'class Config:\n    """Settings read from a file."""\n\n    def __init__(self, path):',
    "def main(argv=None):\n    parser = argparse.ArgumentParser()",
    "def _check_name(name):\n    if not isinstance(name, str):", "class Error(Exception):", "def join_path(a, *parts):",
)
RANDOM_LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300)


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    rng = random.Random(1234)
    return [tok.encode(p) for p in PYTHON_PROMPTS] + [[rng.randrange(3, 4096) for _ in range(n)] for n in RANDOM_LENGTHS]


def hf_greedy(dtype: torch.dtype, work: list[list[int]], new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for p in work:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                 repetition_penalty=1.0)  # the demo model ships 1.1; the engine side runs none
            outs.append(gen[0, len(p):].tolist())
    return outs


def engine_greedy(dtype: str, work: list[list[int]], new: int) -> list[list[int]]:
    llm = LLM(str(DEMO_MODEL_DIR), dtype=dtype, max_model_len=512, kv_cache_memory=64 << 20, seed=0)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(work, params, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical continuations, and the share of tokens before the first difference."""
    same_prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same_prefix.append(n / len(x))
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "identical_pct": 100 * sum(x == y for x, y in zip(a, b)) / len(a),
            "tokens_before_first_difference_pct": 100 * sum(same_prefix) / len(same_prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()
    work = prompts()
    runs = {
        "hf_float32": hf_greedy(torch.float32, work, args.new_tokens),
        "hf_bfloat16": hf_greedy(torch.bfloat16, work, args.new_tokens),
        "engine_float32": engine_greedy("float32", work, args.new_tokens),
        "engine_bfloat16": engine_greedy("bfloat16", work, args.new_tokens),
    }
    pairs = [("engine_float32", "hf_float32"), ("engine_bfloat16", "hf_bfloat16"),
             ("hf_bfloat16", "hf_float32"), ("engine_bfloat16", "hf_float32")]
    result = {"cpu": cpu_model(), "torch": torch.__version__,
              "cpu_bf16_flags": cpu_bf16_flags(), "probe_bf16_speedup": measure_bf16_speedup(256, 640),
              "prompts": len(work), "new_tokens": args.new_tokens, "agreement": {}}
    for a, b in pairs:
        split = {"python": agreement(runs[a][:len(PYTHON_PROMPTS)], runs[b][:len(PYTHON_PROMPTS)]),
                 "random": agreement(runs[a][len(PYTHON_PROMPTS):], runs[b][len(PYTHON_PROMPTS):]),
                 "all": agreement(runs[a], runs[b])}
        result["agreement"][f"{a} vs {b}"] = split
        print(f"{a} vs {b}: " + "; ".join(
            f"{k} {v['identical']}/{v['of']} identical, {v['tokens_before_first_difference_pct']:.0f}% of tokens "
            "before the first difference" for k, v in split.items()))
    print(f"probe: bf16 {result['probe_bf16_speedup']:.2f}x float32 on the demo model's MLP shapes")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
