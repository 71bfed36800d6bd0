"""The model's layers on a CPU: linear weights packed once for oneDNN give F.linear's results
(the parity tests check the tokens end to end), the unpacked copy is dropped except where a tied
embedding still reads it, and the rotary rows gathered once per forward are those of its positions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from portcullis.engine.model.layers import (
    ParallelLMHead,
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _onednn_agrees,
    pack_linear_weights,
)
from portcullis.engine.model.loader import load_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _linear(cls, dtype: torch.dtype, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    layer = cls(48, 40, bias=bias)
    layer.weight.data = torch.randn(40, 48).to(dtype)
    if bias:
        layer.bias.data = torch.randn(40).to(dtype)
    return layer


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,bias", [(ReplicatedLinear, True), (ReplicatedLinear, False), (RowParallelLinear, True)])
def test_a_packed_linear_gives_f_linear_s_results_for_any_number_of_rows(dtype, cls, bias):
    if not _onednn_agrees(dtype):  # e.g. bf16 on a CPU without AVX-512: the probe leaves it unpacked
        pytest.skip(f"oneDNN on this CPU does not run {dtype} linears")
    layer = _linear(cls, dtype, bias)
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach()
    assert pack_linear_weights(nn.Sequential(layer)) == 1
    assert layer.weight is None  # not kept twice
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for rows in (0, 1, 6, 17, 130):
        x = torch.randn(rows, 48).to(dtype)
        torch.testing.assert_close(layer(x), F.linear(x, weight, b), **tol)
    wide = torch.randn(3, 96).to(dtype)[:, ::2]  # a strided view, as a slice of a fused output is
    torch.testing.assert_close(layer(wide), F.linear(wide, weight, b), **tol)
    batched = torch.randn(2, 5, 48).to(dtype)
    torch.testing.assert_close(layer(batched), F.linear(batched, weight, b), **tol)


@needs_onednn
def test_a_head_tied_to_the_embedding_is_packed_and_the_embedding_keeps_its_table():
    model = nn.Module()
    model.embed = VocabParallelEmbedding(64, 16)
    model.head = ParallelLMHead(64, 16)
    model.embed.weight.data = torch.randn(64, 16)
    model.head.weight = model.embed.weight
    table = model.embed.weight.detach().clone()
    assert pack_linear_weights(model) == 1
    assert model.head.weight is model.embed.weight
    ids = torch.tensor([3, 9, 63])
    torch.testing.assert_close(model.embed(ids), table[ids])
    hidden = torch.randn(4, 16)
    torch.testing.assert_close(model.head(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2's test checkpoint ties its head
def test_the_loader_packs_every_linear_layer_on_a_cpu(checkpoint_factory, kind):
    path = checkpoint_factory(kind)
    config = AutoConfig.from_pretrained(path)
    model = load_model(path, config, torch.float32, torch.device("cpu"), 64)
    linears = [m for m in model.modules() if hasattr(m, "packed")]
    assert linears and all(m.packed is not None for m in linears)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert all(m.weight is None for m in linears if m is not model.lm_head)


def test_rotary_rows_follow_each_forward_s_positions():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    shared, fresh = RotaryEmbedding(inv_freq, 1.0, 64), lambda: RotaryEmbedding(inv_freq, 1.0, 64)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    for positions in (torch.tensor([0, 1, 2]), torch.tensor([5, 9, 63]), torch.tensor([5, 9, 63])):
        for _layer in range(2):  # every layer of a forward calls the shared module with the same tensor
            got = shared(positions, q, k)
            want = fresh()(positions.clone(), q, k)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("isa", ["native", "x86-64-v3"])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 256])
def test_native_rotary_is_pytorch_s_bit_for_bit(head_dim, isa, monkeypatch):
    """The compiled rotary (float32 on CPUs; each instruction set's build) equals `rotate`'s PyTorch
    ops exactly, for Q and K read as views of a fused QKV row, at positions up to the tables' end."""
    import os

    from portcullis.engine.model.layers import rotate
    from portcullis.kernels import cpu_rotary
    from tests.support.isa import use_build

    use_build(isa, monkeypatch)
    if cpu_rotary.native_library() is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI has a C++ compiler: the {isa} rotary kernel should have built")
        pytest.skip("no C++ compiler here: the rotary kernel cannot be built")
    inv_freq = 1.0 / (100000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(inv_freq, 1.0, 4096)
    qkv = torch.randn(5, (9 + 3 + 3) * head_dim) * 3
    q, k, _ = (part.reshape(5, -1, head_dim) for part in qkv.split([9 * head_dim, 3 * head_dim, 3 * head_dim], -1))
    positions = torch.tensor([0, 1, 77, 2048, 4095])
    got_q, got_k = rope(positions, q, k)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    assert torch.equal(got_q, rotate(q, cos, sin)) and torch.equal(got_k, rotate(k, cos, sin))
    with pytest.raises(IndexError):
        rope(torch.tensor([0, 1, 2, 3, 4096]), q, k)
