"""The random-weight fixtures load in transformers and have the architecture flags they claim."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

EXPECTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_fixture_loads_in_transformers(checkpoint_factory, kind):
    path = checkpoint_factory(kind)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [EXPECTED[kind]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


def test_fixture_flags(checkpoint_factory):
    qwen2 = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen2"))
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None  # QKV bias
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()  # tied
    qwen3 = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3"))
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")  # Q/K norm
    assert qwen3.config.head_dim != qwen3.config.hidden_size // qwen3.config.num_attention_heads
