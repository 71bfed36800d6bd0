"""Gemma, Gemma 2 and Gemma 3 (text): greedy tokens match transformers exactly in float32, in
every engine setting and at TP=2, and each Gemma feature the checkpoints exercise really changes the tokens (so a
model that skipped it would fail): attention soft-capping and the sliding window (whose 32
tokens the 150- and 300-token prompts cross), Gemma 3's per-layer-type RoPE; final-logit
soft-capping, which cannot move a greedy argmax, is checked through logprobs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from tests.support.parity import GREEDY, SETTINGS, assert_greedy_parity, hf_greedy, parity_prompts

KINDS = ["gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def gemma_checkpoint(checkpoint_factory, tmp_path_factory):
    """`gemma_checkpoint(kind)`: the conftest checkpoint with random RMSNorm weights, which
    transformers initialises to zero (a scale of exactly 1 would hide a misplaced norm)."""
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            folder = tmp_path_factory.mktemp(f"{kind}-norms")
            shutil.copytree(checkpoint_factory(kind), folder, dirs_exist_ok=True)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            model.save_pretrained(folder)
            built[kind] = folder
        return built[kind]

    return make


def variant(path: Path, out: Path, **changes) -> Path:
    """A copy of the checkpoint with config.json fields changed (a feature switched off)."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def long_prompts() -> tuple[tuple[int, ...], ...]:
    """The 150- and 300-token parity prompts: past the window, and cheap enough for transformers."""
    return tuple(tuple(p) for p in parity_prompts() if len(p) >= 150)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(gemma_checkpoint, kind, setting):
    llm = assert_greedy_parity(gemma_checkpoint(kind), setting)
    layers = llm.engine.model_runner.model.attention_layers()
    windows = [layer.sliding_window for layer in layers]
    if kind == "gemma":
        assert windows == [None, None] and all(layer.softcap is None for layer in layers)
    elif kind == "gemma2":
        assert windows == [32, None, 32, None]
        assert [layer.softcap for layer in layers] == [5.0] * 4
        assert all(layer.scale == 24**-0.5 for layer in layers)
    else:
        assert windows == [32, None, 32, 32]
        assert all(layer.softcap is None and layer.scale == 48**-0.5 for layer in layers)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_tensor_parallel_two_ranks_matches_transformers(gemma_checkpoint, kind):
    """TP=2 on CPU (Gloo): Gemma 3's single KV head is replicated on both ranks; Gemma 2's final
    soft-capping applies to the gathered logits."""
    path = gemma_checkpoint(kind)
    prompts = parity_prompts()[4:]
    expected = hf_greedy(path, tuple(map(tuple, parity_prompts())))[4:]
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, tensor_parallel_size=2, dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(("kind", "changes"), [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"sliding_window": 4096}),
    ("gemma3", {"sliding_window": 4096}),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
], ids=["gemma2-softcap", "gemma2-window", "gemma3-window", "gemma3-rope"])
def test_each_feature_changes_the_tokens(gemma_checkpoint, tmp_path, kind, changes):
    """Without the feature transformers itself gives other tokens: the parity above checks it."""
    path = gemma_checkpoint(kind)
    without = hf_greedy(variant(path, tmp_path / "variant", **changes), long_prompts(), 8)
    assert without != hf_greedy(path, long_prompts(), 8)


def test_final_logit_softcapping_shapes_the_logprobs(gemma_checkpoint):
    """Final soft-capping keeps the argmax, so greedy tokens cannot show it; logprobs do: they
    match transformers' capped logits, and the uncapped ones (beyond the cap) would differ."""
    from transformers import AutoModelForCausalLM

    path = gemma_checkpoint("gemma2")
    prompt = parity_prompts()[4]
    with LLM(str(path), max_model_len=512, kv_cache_memory=16 << 20, dtype="float32", seed=0) as llm:
        (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3),
                              use_tqdm=False)
    tokens = out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        model.config.final_logit_softcapping = None
        raw = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert raw.abs().max() > 3 * 3.0, "the test model's logits should reach well past the cap"
    want = torch.log_softmax(logits, -1)
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert entry.logprob == pytest.approx(want[step, token].item(), abs=1e-4)
    uncapped = torch.log_softmax(raw, -1)
    assert any(abs(entry.logprob - uncapped[i, t].item()) > 0.1
               for i, (t, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)))


def test_gemma3_rope_from_a_legacy_config():
    """Configs written before per-layer-type `rope_parameters` (rope_theta for full layers,
    rope_local_base_freq for sliding ones, rope_scaling on the full ones) give the tables
    transformers 5 derives from them."""
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from portcullis.engine.model.families.gemma import FULL, SLIDING, _inv_freq

    legacy = dict(rope_theta=500000.0, rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    shape = dict(hidden_size=64, num_attention_heads=4, head_dim=32, num_hidden_layers=2,
                 layer_types=[SLIDING, FULL])
    theirs = Gemma3RotaryEmbedding(AutoConfig.for_model("gemma3_text", **shape, **legacy))
    ours = SimpleNamespace(model_type="gemma3_text", **shape, **legacy)
    for layer_type in (SLIDING, FULL):
        inv_freq, scaling = _inv_freq(ours, layer_type)
        assert scaling == getattr(theirs, f"{layer_type}_attention_scaling")
        torch.testing.assert_close(inv_freq, getattr(theirs, f"{layer_type}_inv_freq"), rtol=0, atol=0)


def test_gemma2_through_triton_kernels_matches_transformers(gemma_checkpoint, monkeypatch):
    """The GPU path (here Triton's interpreter): soft-capped, windowed layers in mixed steps."""
    import portcullis.kernels.triton_attention as triton_attention

    monkeypatch.setenv("PORTCULLIS_ATTENTION", "triton")
    calls = []
    kernel = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton",
                        lambda *a, **kw: calls.append(kw.get("softcap")) or kernel(*a, **kw))
    path = gemma_checkpoint("gemma2")
    prompts = tuple(tuple(p) for p in parity_prompts() if len(p) in (7, 150))
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=8 << 20, max_num_batched_tokens=64, seed=0, dtype="float32")
    outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and set(calls) == {5.0}
