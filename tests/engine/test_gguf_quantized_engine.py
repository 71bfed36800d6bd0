"""SmolLM2-135M-Instruct's Q4_1 GGUF through the engine with its weights as stored (the CPU
quantized kernel) against the same file dequantized to float32 (the reference path).

Both paths multiply float32 activations by the same float32 weights (the kernel dequantizes
each block in registers, bit for bit as the loader does); only the order of the sums differs.
Measured the way llama.cpp's `perplexity --kl-divergence` does: the float32 path's greedy
continuation of each prompt is fed to both (teacher forcing), and at every position of prompt
and continuation the next-token logits are compared. Bounds, stated before the first run of this
kernel: logits within 2e-3 of the reference's, mean KL(float32 || quantized) <= 1e-6, the same
top token wherever the reference's top two are more than 1e-2 apart, and the free-running greedy
sequences identical (the chat and default-serve tests rely on that too).
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
MAX_LOGIT_DIFF = 2e-3
MAX_MEAN_KL = 1e-6
TIE = 1e-2  # a reference top-2 gap below this may flip on summation order


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

    ref, got = torch.cat(ref_logits), torch.cat(q_logits)
    assert ref.shape == got.shape and ref.shape[0] == sum(len(s) for s in sequences)
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > TIE
    agree = ref.argmax(-1) == got.argmax(-1)
    diff = (ref - got).abs().max().item()
    same = sum(list(a) == list(b) for a, b in zip(q_outs, ref_outs, strict=True))
    print(f"\nSmolLM2 Q4_1, quantized kernel ({cpu_quant.isa_name(cpu_quant.native_library(isa))}) vs "
          f"dequantized float32 over {ref.shape[0]} positions: max logit difference {diff:.2e}, top-1 "
          f"agreement {agree.float().mean().item():.4f}, mean KL {kl.mean().item():.2e}; free-running "
          f"greedy: {same}/{len(prompts)} sequences identical")
    assert diff <= MAX_LOGIT_DIFF
    assert kl.mean().item() <= MAX_MEAN_KL
    assert agree[decided].all()
    assert same == len(prompts)
