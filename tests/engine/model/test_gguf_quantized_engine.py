"""The real GGUF files through the engine with their weights as stored (the CPU quantized kernel)
against the same files dequantized to float32 (the reference path): SmolLM2-135M-Instruct (Q4_1
projections, a Q8_0 tied embedding and head) and Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0
layers; a fused layer whose parts differ in kind is dequantized).

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
from portcullis.engine.assets import GEMMA3, SMOLLM2
from portcullis.engine.model.gguf_checkpoint import sidecar_folder
from portcullis.kernels import cpu_quant, native_build
from tests.support.isa import use_build
from tests.support.real_models import prompts_for, real_file

NEW_TOKENS = 16
# The layers each file runs as stored, by kind: SmolLM2's 30 x (qkv, o, gate_up, down) and its
# embedding + tied head; every kind of Gemma 3's file somewhere.
SMOLLM2_LAYERS = {"Q4_1": 120, "Q8_0": 2}
GEMMA3_KINDS = {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
MAX_LOGIT_DIFF = 2e-3
MAX_MEAN_KL = 1e-6
TIE = 1e-2  # a reference top-2 gap below this may flip on summation order


def needs_kernel() -> None:
    if cpu_quant.native_library() is None:
        if os.environ.get("CI"):
            pytest.fail("CI has a C++ compiler: the quantized kernel should have built")
        pytest.skip("no C++ compiler here: the quantized kernel cannot be built")


@pytest.fixture(scope="module")
def smollm2():
    needs_kernel()
    return real_file(SMOLLM2)


def engine(path, dequantize: bool, kv_cache_dtype: str = "auto") -> LLM:
    return LLM(str(path), dtype="float32", enable_prefix_caching=False, kv_cache_memory=64 << 20,
               gguf_dequantize=dequantize, kv_cache_dtype=kv_cache_dtype)


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


@pytest.mark.parametrize("model,isa", [(SMOLLM2, isa) for isa in native_build.ISA_FLAGS] + [(GEMMA3, "native")],
                         ids=[f"smollm2-{isa}" for isa in native_build.ISA_FLAGS] + ["gemma3-native"])
def test_quantized_weights_agree_with_the_dequantized_reference(model, isa, monkeypatch):
    from transformers import AutoTokenizer

    needs_kernel()
    path = real_file(model)
    use_build(isa, monkeypatch)

    prompts = prompts_for(model, AutoTokenizer.from_pretrained(sidecar_folder(path)))
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    reference = engine(path, dequantize=True)
    assert quantized_layers(reference) == {}
    ref_outs = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    sequences = [p + list(o) for p, o in zip(prompts, ref_outs, strict=True)]
    ref_logits = [all_position_logits(reference, s) for s in sequences]
    del reference

    quantized = engine(path, dequantize=False)
    if model is SMOLLM2:
        assert quantized_layers(quantized) == SMOLLM2_LAYERS
    else:
        assert set(quantized_layers(quantized)) == GEMMA3_KINDS
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
    print(f"\n{model.file}, quantized kernel ({cpu_quant.isa_name(cpu_quant.native_library(isa))}) vs "
          f"dequantized float32 over {ref.shape[0]} positions: max logit difference {diff:.2e}, top-1 "
          f"agreement {agree.float().mean().item():.4f}, mean KL {kl.mean().item():.2e}; free-running "
          f"greedy: {same}/{len(prompts)} sequences identical")
    assert diff <= MAX_LOGIT_DIFF
    assert kl.mean().item() <= MAX_MEAN_KL
    assert agree[decided].all()
    assert same == len(prompts)


def test_dtype_auto_is_float32_where_the_gguf_runs_quantized(smollm2, monkeypatch):
    """The quantized layers compute in float32 whatever the dtype, so `--dtype auto` does not take
    bfloat16 for them even on a CPU whose probe prefers it (bfloat16 around float32 kernels only
    adds conversions: 16.5 against 10.9 ms/token measured); the dequantizing path still probes."""
    from portcullis.engine import config as config_module
    from portcullis.engine.config import EngineConfig
    from portcullis.engine.cpu_dtype import DTYPE_ENV, CpuDtypeChoice

    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(config_module, "choose_cpu_dtype", lambda *_: CpuDtypeChoice(torch.bfloat16, "probe"))
    assert EngineConfig(model=str(smollm2)).torch_dtype == torch.float32
    assert EngineConfig(model=str(smollm2), gguf_dequantize=True).torch_dtype == torch.bfloat16
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")  # an explicit choice still wins
    assert EngineConfig(model=str(smollm2)).torch_dtype == torch.bfloat16


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", list(native_build.ISA_FLAGS))
def test_decode_steps_run_the_native_stack_as_the_layers_would(smollm2, isa, kv_cache_dtype, monkeypatch):
    """A step of decodes only (one new token per sequence) runs all 30 layers in one native call
    (`kernels.cpu_stack`): the kernels the layers call one by one, SiLU * up included (the layers
    call the stack's), so the same tokens with the same logprobs, bit for bit, for one sequence
    and for six at once, with float32 and with bf16 caches."""
    from transformers import AutoTokenizer

    from portcullis.kernels import cpu_stack

    use_build(isa, monkeypatch)
    prompts = prompts_for(SMOLLM2, AutoTokenizer.from_pretrained(sidecar_folder(smollm2)))
    llm = engine(smollm2, dequantize=False, kv_cache_dtype=kv_cache_dtype)
    runs = []
    stack_run = cpu_stack.DecodeStack.run
    monkeypatch.setattr(cpu_stack.DecodeStack, "run", lambda self, h, *a: runs.append(len(h)) or stack_run(self, h, *a))
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    for batch in (prompts[:1], prompts):
        monkeypatch.setattr(cpu_stack, "ENABLED", True)
        runs.clear()
        stacked = [o.outputs[0] for o in llm.generate(batch, params)]
        assert runs and max(runs) == len(batch), runs  # decodes went through it, all sequences at once
        monkeypatch.setattr(cpu_stack, "ENABLED", False)
        runs.clear()
        layered = [o.outputs[0] for o in llm.generate(batch, params)]
        assert not runs
        for a, b in zip(stacked, layered, strict=True):
            assert list(a.token_ids) == list(b.token_ids)
            assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
