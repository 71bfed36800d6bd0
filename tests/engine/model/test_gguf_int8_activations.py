"""`--gguf-activations int8` (llama.cpp's arithmetic, opt-in) on the real GGUF files against the
same files dequantized to float32 (the reference path).

The int8 mode rounds each activation row to int8 per block of 32 before the integer products, so
unlike the default float32 kernel its logits move: how far is measured the way llama.cpp's
`perplexity --kl-divergence` does. The reference's greedy continuation of each prompt is fed to
both (teacher forcing), and at every position of prompt and continuation the next-token
distributions are compared.

Bounds, stated before this mode's first run on these files: mean KL(float32 || int8) <= 0.02 and
the same top token at >= 95% of positions. That is less than what choosing a Q4_K_M file costs an
8B model against its float16 weights in llama.cpp's published KL figures (mean KL about 0.03-0.05,
the same top token at about 93-94%): the activations' rounding must cost less than the weights'
quantization the user already chose. The free-running greedy sequences' exact-match rate is
reported, not bounded. The prompts are held out: written for this test, used nowhere else.

The same bounds, stated before its first run, hold int8 activations together with a bf16 KV cache
(`--kv-cache-dtype bfloat16`, llama.cpp's default of 16-bit K and V): the configuration the AVX2
comparison with llama.cpp runs.
"""
from __future__ import annotations

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.assets import GEMMA3, SMOLLM2
from portcullis.engine.model.gguf_checkpoint import sidecar_folder
from portcullis.kernels import cpu_quant, native_build
from tests.engine.model.test_gguf_quantized_engine import (
    all_position_logits,
    needs_kernel,
    quantized_layers,
)
from tests.support.isa import use_build
from tests.support.real_models import real_file

NEW_TOKENS = 24
MAX_MEAN_KL = 0.02
MIN_TOP1_AGREEMENT = 0.95
HELD_OUT_CHATS = [
    "How many legs does a spider have?",
    "Give me a synonym for 'happy'.",
    "What is 12 times 7?",
    "Name the largest planet in the solar system.",
    "Write one sentence about autumn leaves.",
    "Which language is spoken in Brazil?",
    "Suggest a name for a pet goldfish.",
    "Write a Python function that returns the square of a number.",
]
HELD_OUT_PLAIN = [
    "The tallest mountain on Earth is",
    "for i in range(10):\n",
    "My favourite breakfast is",
    "The chemical symbol for gold is",
    "In 1969, the first humans",
    "class Stack:\n    def __init__(self):\n",
    "The best way to learn a language is",
    "Photosynthesis is the process by which",
]
# Every Q4_1 projection and the Q8_0 embedding + tied head of SmolLM2 run int8; Gemma 3's file
# is mostly K-quants and Q5_0, which stay float32: only its Q8_0 layers switch.
SMOLLM2_INT8_LAYERS = {"Q4_1_I8": 120, "Q8_0_I8": 2}


def engine(path, **mode) -> LLM:
    return LLM(str(path), dtype="float32", enable_prefix_caching=False, kv_cache_memory=64 << 20, **mode)


def held_out_prompts(model, path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sidecar_folder(path))
    if model is SMOLLM2:
        return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for c in HELD_OUT_CHATS]
    return [tokenizer(p).input_ids for p in HELD_OUT_PLAIN]


@pytest.mark.parametrize("model,isa,kv_cache_dtype",
                         [(SMOLLM2, isa, "auto") for isa in native_build.ISA_FLAGS]
                         + [(SMOLLM2, "x86-64-v3", "bfloat16"), (GEMMA3, "native", "auto")],
                         ids=[f"smollm2-{isa}" for isa in native_build.ISA_FLAGS]
                         + ["smollm2-x86-64-v3-bf16-kv", "gemma3-native"])
def test_int8_activations_agree_with_the_float32_reference_within_the_stated_bounds(model, isa, kv_cache_dtype,
                                                                                     monkeypatch):
    needs_kernel()
    path = real_file(model)
    use_build(isa, monkeypatch)

    prompts = held_out_prompts(model, path)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    reference = engine(path, gguf_dequantize=True)
    ref_outs = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    sequences = [p + list(o) for p, o in zip(prompts, ref_outs, strict=True)]
    ref_logits = torch.cat([all_position_logits(reference, s) for s in sequences])
    del reference

    int8 = engine(path, gguf_activations="int8", kv_cache_dtype=kv_cache_dtype)
    layers = quantized_layers(int8)
    if model is SMOLLM2:
        assert layers == SMOLLM2_INT8_LAYERS
    else:
        assert layers.get("Q8_0_I8", 0) > 0 and "Q8_0" not in layers
    outs = [o.outputs[0].token_ids for o in int8.generate(prompts, greedy, use_tqdm=False)]
    got = torch.cat([all_position_logits(int8, s) for s in sequences])

    assert got.shape == ref_logits.shape and got.shape[0] == sum(len(s) for s in sequences)
    p, q = ref_logits.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agreement = (ref_logits.argmax(-1) == got.argmax(-1)).float().mean().item()
    same = sum(list(a) == list(b) for a, b in zip(outs, ref_outs, strict=True))
    print(f"\n{model.file}, int8 activations ({cpu_quant.isa_name(cpu_quant.native_library(isa))}, "
          f"{int8.engine.config.torch_kv_cache_dtype} KV) vs dequantized "
          f"float32 over {got.shape[0]} positions: mean KL {kl:.2e}, top-1 agreement {agreement:.4f}, max logit "
          f"difference {(ref_logits - got).abs().max().item():.2e}; free-running greedy: {same}/{len(prompts)} "
          f"sequences identical")
    assert kl <= MAX_MEAN_KL
    assert agreement >= MIN_TOP1_AGREEMENT


def test_the_mode_is_named_and_refused_when_it_cannot_apply(monkeypatch):
    from portcullis.engine.config import EngineConfig
    from portcullis.engine.server.cli import build_parser

    path = str(real_file(SMOLLM2))
    with pytest.raises(ValueError, match="gguf_activations must be"):
        EngineConfig(model=path, gguf_activations="int4")
    with pytest.raises(ValueError, match="cannot be combined with gguf_dequantize"):
        EngineConfig(model=path, gguf_activations="int8", gguf_dequantize=True)
    monkeypatch.setenv("PORTCULLIS_GGUF_ACTIVATIONS", "int8")
    assert EngineConfig(model=path).gguf_activations == "int8"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([path, "--gguf-activations", "int4"])
    assert exit_.value.code == 2


def test_the_mode_warns_where_it_applies_to_nothing(llama_model):
    """A Hugging Face folder has no GGUF blocks to repack: the engine says the mode did nothing."""
    import structlog

    with structlog.testing.capture_logs() as logs:
        llm = LLM(str(llama_model), dtype="float32", gguf_activations="int8", kv_cache_memory=16 << 20)
    warnings = [e for e in logs if e["log_level"] == "warning" and "int8 activations" in e["event"]]
    assert warnings and warnings[0]["gguf"] is False, logs
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2  # and it still serves, on float32 weights
