"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) give transformers' greedy tokens in
float32 in every scheduler setting and at TP=2; the routing's renormalisation is load-bearing
with these configs (flipping it changes the tokens), and experts load from per-expert checkpoint
tensors (what transformers 5.x writes) and from fused 3-D ones (what it holds in memory)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from portcullis.engine import LLM
from portcullis.engine.model.families.moe import SparseMoeBlock, StackedExperts, route
from portcullis.engine.model.loader import _iter_weights, load_model
from tests.support.parity import (
    GREEDY,
    SETTINGS,
    assert_greedy_parity,
    engine_for,
    hf_greedy,
    parity_prompts,
)

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(checkpoint_factory, kind, setting):
    assert_greedy_parity(checkpoint_factory(kind), setting)


@pytest.mark.parametrize("kind", KINDS)
def test_the_renormalisation_choice_changes_the_tokens(checkpoint_factory, kind):
    """Guards the parity tests: were top-k renormalisation applied where transformers skips it (or
    the reverse), these configs would give other tokens."""
    path = checkpoint_factory(kind)
    prompts = parity_prompts()
    expected = hf_greedy(path, tuple(map(tuple, prompts)))
    llm = engine_for(path, "default")
    blocks = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        block.renormalize = not block.renormalize
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != expected


def test_sparse_and_dense_layers_follow_the_config(checkpoint_factory):
    """Qwen3-MoE's `mlp_only_layers=[1]` keeps layer 1 dense; Qwen2-MoE's layers carry a shared expert."""
    qwen3 = engine_for(checkpoint_factory("qwen3_moe"), "default").engine.model_runner.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in qwen3.model.layers] == [True, False]
    qwen2 = engine_for(checkpoint_factory("qwen2_moe"), "default").engine.model_runner.model
    assert all(layer.mlp.shared_expert is not None for layer in qwen2.model.layers)


def test_tensor_parallel_two_ranks_matches_transformers(checkpoint_factory):
    """TP=2 on CPU (Gloo): each expert's and the shared expert's features split across ranks."""
    path = checkpoint_factory("qwen2_moe")
    prompts = parity_prompts()[:5]
    expected = hf_greedy(path, tuple(map(tuple, parity_prompts())))[:5]
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, tensor_parallel_size=2, dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_fused_expert_tensors_load_like_per_expert_ones(checkpoint_factory, tmp_path, monkeypatch):
    """The same weights written as transformers 5.x holds them (`mlp.experts.gate_up_proj`
    [experts, 2 * inter, hidden], `mlp.experts.down_proj`, Mixtral's router under `mlp`) load
    into the same parameters."""
    from transformers import AutoConfig

    path = checkpoint_factory("mixtral")
    cfg = AutoConfig.from_pretrained(path)
    fused, experts = {}, {}
    for name, tensor in _iter_weights(path):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." not in name:
            fused[name] = tensor
            continue
        prefix, rest = name.split(".experts.")
        expert, proj = rest.split(".")[:2]
        experts.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = tensor
    for prefix, projs in experts.items():
        stack = {p: torch.stack([t[e] for e in sorted(t)]) for p, t in projs.items()}
        fused[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        fused[f"{prefix}.experts.down_proj"] = stack["w2"]
    save_file({k: v.contiguous() for k, v in fused.items()}, tmp_path / "model.safetensors")
    monkeypatch.setattr("portcullis.engine.model.loader.pack_linear_weights", lambda model: 0)  # compare the parameters
    a = load_model(path, cfg, torch.float32, torch.device("cpu"), 64)
    b = load_model(tmp_path, cfg, torch.float32, torch.device("cpu"), 64)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def test_experts_sum_each_token_s_chosen_experts():
    """The grouped (sorted-by-expert) computation against a token-by-token reference."""
    torch.manual_seed(0)
    experts = StackedExperts(num_experts=6, hidden=16, intermediate=8)
    experts.gate_up_proj.data.normal_()
    experts.down_proj.data.normal_()
    x = torch.randn(11, 16)
    weights, ids = route(torch.randn(11, 6), top_k=3, renormalize=True)
    want = torch.zeros_like(x)
    for t in range(11):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            want[t] += w * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    if torch.backends.mkldnn.is_available():  # the loader packs them on CPUs
        experts.pack_for_onednn()
        assert experts.gate_up_proj is None and len(experts.packed_experts) == 6
        torch.testing.assert_close(experts(x, weights, ids), want, rtol=1e-5, atol=1e-5)
