"""Reference greedy generations from Hugging Face transformers, computed once per model per session."""
from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.distributed import stage_layers

PROMPT_LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300)
NEW_TOKENS = 32



def parity_prompts(vocab_size: int = 4096, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@functools.cache
def hf_greedy(model_dir: Path, prompts: tuple[tuple[int, ...], ...], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """`generate(do_sample=False)` prompt by prompt (no padding), never stopping early. `model_dir`
    may be a GGUF file, which transformers reads (and dequantizes) itself."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    gguf = dict(gguf_file=model_dir.name) if model_dir.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir.parent if gguf else model_dir, dtype=torch.float32, **gguf).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )
            outs.append(gen[0, len(prompt):].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

SETTINGS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=64),
    # The eight prompts fit in 41 blocks and all start at once; finishing them needs 57: so requests
    # must be preempted and recomputed.
    "preemption": dict(num_blocks=45),
}
# Random-weight models repeat themselves, so n-gram proposals are found, and some accepted.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _speculative_config(path, spec: str) -> dict | None:
    if spec == "draft":
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    return NGRAM if spec == "spec" else None


def engine_for(path, setting: str, spec: str = "", **overrides) -> LLM:
    kwargs = dict(SETTINGS[setting], speculative_config=_speculative_config(path, spec), **overrides)
    num_blocks = kwargs.pop("num_blocks", None)
    # Exact parity with HF's float32: pinned, since `auto` may pick bfloat16 on a CPU with fast bf16.
    llm_kwargs = dict(max_model_len=512, seed=0, dtype="float32", **kwargs)
    if num_blocks is not None:  # a draft model's layers take their share of each block's bytes
        probe = LLM(str(path), max_model_len=512, kv_cache_memory=1 << 20, dtype="float32",
                    speculative_config=kwargs["speculative_config"])
        per_block = probe.engine.model_runner.kv_bytes_per_block()
        # A rank holds only its stage's layers and its share of the KV heads (each block's bytes).
        cfg, stages, tp = probe.config.hf_config, kwargs.get("pipeline_parallel_size", 1), kwargs.get("tensor_parallel_size", 1)
        layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        per_block = (per_block * max(len(stage_layers(layers, s, stages)) for s in range(stages)) * max(1, kv_heads // tp)
                     // (layers * kv_heads))
        llm_kwargs["kv_cache_memory"] = num_blocks * per_block
        if probe.engine.kv.num_groups > 1:
            # A block then holds a few layers (one group's), and a sliding group holds a whole
            # prefill chunk at once: chunked prefills let the longest prompt fit the 45 blocks.
            llm_kwargs.setdefault("max_num_batched_tokens", 64)
    else:
        llm_kwargs["kv_cache_memory"] = 64 << 20
    return LLM(str(path), **llm_kwargs)


def assert_greedy_parity(path: Path, setting: str, spec: str = "", vocab_size: int = 4096, **overrides) -> LLM:
    """The engine in `setting` (with `overrides` of its arguments) gives transformers' greedy
    tokens for every parity prompt, and leaves its block pool whole; returns the engine for
    further checks."""
    prompts = parity_prompts(vocab_size)
    expected = hf_greedy(path, tuple(map(tuple, prompts)))
    llm = engine_for(path, setting, spec, **overrides)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == want, f"prompt {i} (length {len(prompts[i])}) diverged"
        assert out.outputs[0].finish_reason == "length"
    if setting == "preemption":
        assert llm.engine.stats.num_preemptions > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    return llm
