"""Hub-quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors) load dequantized, layer by layer.

A small random Llama is quantized by the test-side quantizer (tests/support/quantize.py) into each
format's real on-disk layout; the engine's dequantized weights must be exactly the quantizer's own
dequantization, and its greedy tokens those of transformers on a float32 checkpoint holding those
same weights (the faithful reference: same weights, no quantization left to differ)."""
from __future__ import annotations

import json

import pytest
import torch

from portcullis.engine.config import EngineConfig
from portcullis.engine.model.loader import _iter_weights
from portcullis.engine.model.quantization import dequantized_weights, quant_scheme
from tests.conftest import build_checkpoint
from tests.support.parity import GREEDY, engine_for, hf_greedy, parity_prompts
from tests.support.quantize import FORMATS, quantize_checkpoint

# Relative (Frobenius) error of each format's dequantized weights against the originals.
ERROR_BOUND = {"gptq": 0.15, "awq": 0.12, "fp8": 0.06, "ct-fp8": 0.06, "ct-int4": 0.15, "ct-int8": 0.01}
PARITY_FORMATS = ["gptq", "gptq-act-order", "gptq-asym-v1", "awq", "fp8-block", "fp8-tensor", "ct-fp8-channel", "ct-int4"]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    # Wide enough for 128-column groups and 128x128 FP8 blocks, with several groups per row.
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-256"), hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def quantized(float_llama, tmp_path_factory):
    made = {}

    def make(fmt: str):
        if fmt not in made:
            made[fmt] = quantize_checkpoint(float_llama, tmp_path_factory.mktemp(fmt), fmt)
        return made[fmt]

    return make


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantized_weights_are_the_quantizers_own(quantized, fmt):
    ckpt = quantized(fmt)
    consumed = 0

    def stream():
        nonlocal consumed
        for item in _iter_weights(ckpt.path):
            consumed += 1
            yield item

    names = [n for n, _ in _iter_weights(ckpt.path)]
    last_part = {}  # each quantized layer -> position of its last tensor in the stream
    for i, n in enumerate(names):
        last_part[n.rsplit(".", 1)[0]] = i
    out = {}
    for name, tensor in dequantized_weights(stream(), _config(ckpt.path), torch.float32):
        if name in ckpt.dequantized:  # one layer at a time: yielded as soon as the next layer's first tensor shows
            assert consumed <= last_part[name.removesuffix(".weight")] + 2, name
        out[name] = tensor
    assert out.keys() == ckpt.original.keys()
    for name, want in ckpt.original.items():
        got = out[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if name in ckpt.dequantized:
            assert torch.equal(got, ckpt.dequantized[name]), name
            error = ((got - want).norm() / want.norm()).item()
            assert error < next(b for f, b in ERROR_BOUND.items() if fmt.startswith(f)), (name, error)
        else:
            assert torch.equal(got, want), name  # norms, embeddings, lm_head and skipped layers pass through
    assert {n.removesuffix(".weight") for n in ckpt.dequantized}.isdisjoint(ckpt.skipped)
    assert len(ckpt.dequantized) == 2 * 7 - len(ckpt.skipped)


def test_dequantizes_into_the_run_dtype(quantized):
    ckpt = quantized("ct-int4")
    out = dict(dequantized_weights(_iter_weights(ckpt.path), _config(ckpt.path), torch.bfloat16))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert out[name].dtype == torch.bfloat16
    assert torch.equal(out[name], ckpt.dequantized[name].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", PARITY_FORMATS)
def test_engine_on_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(quantized, fmt):
    ckpt = quantized(fmt)
    prompts = parity_prompts()[:4]
    expected = hf_greedy(ckpt.reference, tuple(map(tuple, prompts)))
    outs = engine_for(ckpt.path, "default").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("fmt, needs, rounded_to", [
    ("fp8-block", "accelerate", torch.float32),
    ("ct-int8", "compressed_tensors", torch.float32),
    # compressed-tensors multiplies in the scale's dtype (bf16 here); ours in float32, then rounds.
    ("ct-fp8-channel", "compressed_tensors", torch.bfloat16),
    ("ct-int4", "compressed_tensors", torch.bfloat16),
])
def test_transformers_dequantizes_our_checkpoints_as_we_do(quantized, fmt, needs, rounded_to):
    """Where transformers can load the format on a CPU (with its extra package, not in the dev
    extra: skipped without it), its own dequantization gives our weights. (transformers reads no
    per-tensor `weight_scale` in "fp8" checkpoints, and compressed-tensors has dropped
    actorder "group": those formats are checked against the quantizer only.)"""
    pytest.importorskip(needs)
    from transformers import AutoModelForCausalLM

    ckpt = quantized(fmt)
    kwargs = {}
    if fmt.startswith("ct-"):  # decompressed into dense weights, not run as compressed layers
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    state = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, **kwargs).state_dict()
    ours = dict(dequantized_weights(_iter_weights(ckpt.path), _config(ckpt.path), rounded_to))
    for name in ckpt.dequantized:
        assert torch.equal(state[name].to(rounded_to), ours[name]), name


def _folder_with(tmp_path, float_llama, quantization_config: dict):
    for f in float_llama.iterdir():
        if not f.name.endswith(".safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((float_llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    return tmp_path


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
    ({"quant_method": "exl2", "bits": 4.0}, "'exl2'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "'nvfp4-pack-quantized'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, "ue8m0"),
])
def test_unsupported_quantization_refused_at_start_up(tmp_path, float_llama, config, named):
    folder = _folder_with(tmp_path, float_llama, config)
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(folder))
    assert named in str(err.value) and "support" in str(err.value)  # what is wrong, and what would do


def test_unknown_method_message_lists_every_supported_method(tmp_path, float_llama):
    with pytest.raises(ValueError, match="'bitsandbytes'") as err:
        EngineConfig(model=str(_folder_with(tmp_path, float_llama, {"quant_method": "bitsandbytes"})))
    assert all(m in str(err.value) for m in ("fp8", "compressed-tensors", "gptq", "awq"))


def test_supported_configs_accepted(quantized):
    for fmt in FORMATS:
        assert quant_scheme(_config(quantized(fmt).path)) is not None


def test_a_layer_missing_a_part_is_named():
    class Cfg:
        quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}

    stream = [("model.layers.0.mlp.up_proj.qweight", torch.zeros(4, 8, dtype=torch.int32)),
              ("model.layers.0.mlp.up_proj.scales", torch.ones(1, 8, dtype=torch.float16))]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj.*qzeros"):
        list(dequantized_weights(stream, Cfg(), torch.float32))


def test_fp8_blocks_at_the_edges_may_be_partial():
    """DeepSeek-style block-wise FP8 on a shape the 128x128 blocks do not divide: the last row and
    column of scales cover what is left."""
    class Cfg:
        quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

    weight = torch.randn(200, 300).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) + 0.5
    want = torch.empty(200, 300)
    for r in range(200):
        for c in range(0, 300, 4):
            want[r, c:c + 4] = weight[r, c:c + 4].float() * scale[r // 128, c // 128]
    out = dict(dequantized_weights([("mlp.up_proj.weight", weight), ("mlp.up_proj.weight_scale_inv", scale)], Cfg(), torch.float32))
    assert torch.equal(out["mlp.up_proj.weight"], want)
