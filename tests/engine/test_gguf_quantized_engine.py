"""SmolLM2-135M-Instruct's Q4_1 GGUF through the engine with its weights as stored (the CPU
quantized kernel) against the same file dequantized to float32 (the reference path).

Both paths hold the same quantized weights; what differs is that the kernel quantizes
activations to int8 per 32-block, as llama.cpp does. Measured the way llama.cpp's
`perplexity --kl-divergence` does: the float32 path's greedy continuation of each prompt is fed
to both (teacher forcing), and at every position of prompt and continuation we compare the
next-token distributions: the share of positions whose top token agrees, and the mean
KL(float32 || quantized).
Bounds, stated before the first run: agreement >= 0.90, mean KL <= 0.02.
Free-running greedy sequences are reported, not asserted (one flipped near-tie changes the rest).
"""
from __future__ import annotations

import os

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.assets import SMOLLM2, cached
from portcullis.engine.gguf_checkpoint import sidecar_folder
from portcullis.kernels import cpu_quant, native_build

NEW_TOKENS = 16
CHATS = [  # chosen before any output was seen
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Complete this Python function:\ndef fibonacci(n):",
    "List three primary colors.",
]
MIN_TOP1_AGREEMENT = 0.90
MAX_MEAN_KL = 0.02


@pytest.fixture(scope="module")
def smollm2():
    path = cached(SMOLLM2)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{SMOLLM2.file} is not in the cache: `make setup` fetches it (tools/fetch_models.py)")
        pytest.skip(f"{SMOLLM2.file} not fetched: run `make setup`")
    if cpu_quant.native_library() is None:
        if os.environ.get("CI"):
            pytest.fail("CI has a C++ compiler: the quantized kernel should have built")
        pytest.skip("no C++ compiler here: the quantized kernel cannot be built")
    return path


def engine(path, dequantize: bool) -> LLM:
    return LLM(str(path), dtype="float32", enable_prefix_caching=False, kv_cache_memory=64 << 20,
               gguf_dequantize=dequantize)


def quantized_layers(llm: LLM) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for module in llm.engine.model_runner.model.modules():
        q = getattr(module, "quantized", None)
        if q is not None:
            kinds[q.kind] = kinds.get(q.kind, 0) + 1
    return kinds


def all_position_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's logits at every position of `ids` (one prefill, captured at the head)."""
    captured: list[torch.Tensor] = []
    head = llm.engine.model_runner.model.lm_head
    handle = head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().float().clone()))
    try:
        llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    finally:
        handle.remove()
    rows = torch.cat(captured)
    return rows[-len(ids):] if len(rows) >= len(ids) else rows


@pytest.mark.parametrize("isa", list(native_build.ISA_FLAGS))
def test_quantized_weights_agree_with_the_dequantized_reference(smollm2, isa, monkeypatch):
    from transformers import AutoTokenizer

    if not native_build.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa} code")
    monkeypatch.setenv(native_build.ISA_ENV, isa)  # the AVX2 build too, where AVX-512 would hide it

    tokenizer = AutoTokenizer.from_pretrained(sidecar_folder(smollm2))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for c in CHATS]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    reference = engine(smollm2, dequantize=True)
    assert quantized_layers(reference) == {}
    ref_outs = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    sequences = [p + list(o) for p, o in zip(prompts, ref_outs, strict=True)]
    ref_logits = [all_position_logits(reference, s) for s in sequences]
    del reference

    quantized = engine(smollm2, dequantize=False)
    assert quantized_layers(quantized) == {"Q4_1": 120, "Q8_0": 2}  # 30 x (qkv, o, gate_up, down); embedding + tied head
    q_outs = [o.outputs[0].token_ids for o in quantized.generate(prompts, greedy)]
    q_logits = [all_position_logits(quantized, s) for s in sequences]

    p = torch.cat(ref_logits).log_softmax(-1)
    q = torch.cat(q_logits).log_softmax(-1)
    assert p.shape == q.shape and p.shape[0] == sum(len(s) for s in sequences)
    kl = (p.exp() * (p - q)).sum(-1)
    agreement = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    same = sum(list(a) == list(b) for a, b in zip(q_outs, ref_outs, strict=True))
    print(f"\nSmolLM2 Q4_1, quantized kernel ({cpu_quant.isa_name(cpu_quant.native_library(isa))}) vs "
          f"dequantized float32: top-1 agreement {agreement:.4f} over {p.shape[0]} positions, mean KL "
          f"{kl.mean().item():.5f} (max {kl.max().item():.4f}); free-running greedy: {same}/{len(prompts)} "
          f"sequences identical")
    assert agreement >= MIN_TOP1_AGREEMENT
    assert kl.mean().item() <= MAX_MEAN_KL
