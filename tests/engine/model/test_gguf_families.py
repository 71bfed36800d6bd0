"""GGUF files of every family the engine serves from GGUF, written from random-weight checkpoints the
way llama.cpp's converter writes them (tests/support/gguf_writer.py): the engine reads each file's
config back as the original's (with what transformers' GGUF reader drops: Llama 3's rope_freqs,
Qwen3's head size, the MoE expert widths, Gemma 2's soft-caps, Phi-3's window), its greedy tokens on
the F32 file are transformers' on the original folder, and on the Q8_0/Q4_0 file transformers' on
that file's weights under the engine's config (both dequantize the same bytes). Files transformers cannot read,
or the engine does not know, are refused by name with nothing left half-converted.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from portcullis.engine import SamplingParams
from portcullis.engine.model.gguf_checkpoint import sidecar_folder
from tests.conftest import build_checkpoint
from tests.support.gguf_writer import GGUF_ROUND_TRIP, write_gguf
from tests.support.parity import GREEDY, engine_for, parity_prompts
from tests.support.parity import NEW_TOKENS as PARITY_NEW_TOKENS

# Mixtral is left out: transformers reads a "llama" file with experts as a dense Llama.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2_moe", "qwen3_moe")
# Two of the parity prompts (64 and 150 tokens, both past the Gemma models' 32-token window) and 16
# new tokens keep eighteen files within the suite's time; the full set runs under chunked prefill
# and preemption below.
PROMPTS = tuple(tuple(parity_prompts()[i]) for i in (5, 6))
NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch) -> None:
    """Sidecar folders go to a temporary cache, shared by this module's tests, never the user's."""
    monkeypatch.setenv("PORTCULLIS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-families-cache"))


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """`family_files(kind)` -> (checkpoint folder, F32 file, Q8_0/Q4_0 file), made once. The files sit
    in a folder of their own, so nothing reads the checkpoint's config.json in their place."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def make(kind: str) -> tuple[Path, Path, Path]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"{kind}-gguf")
            folder = build_checkpoint(kind, root / "checkpoint", **GGUF_ROUND_TRIP[kind])
            (root / "gguf").mkdir()
            made[kind] = (folder, write_gguf(folder, root / "gguf" / f"{kind}-f32.gguf"),
                          write_gguf(folder, root / "gguf" / f"{kind}-q8_0-q4_0.gguf", quantized=True))
        return made[kind]

    return make


def _hf_model(path: Path):
    """transformers on a checkpoint folder, or on a GGUF file's weights under the config the engine
    reads from it (transformers' own GGUF config reader drops what `_METADATA` fills in)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(sidecar_folder(path))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                dtype=torch.float32).eval()


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return _hf_model(path)(ids).logits


# Config fields a GGUF file holds only in metadata transformers' reader drops (or, for Llama 3's RoPE
# scaling, in a tensor): the engine's config must have the original's.
FIELDS = ("rope_parameters", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
          "final_logit_softcapping", "sliding_window", "moe_intermediate_size", "shared_expert_intermediate_size")


@pytest.mark.parametrize("kind", FAMILIES)
def test_f32_file_is_the_checkpoint_and_the_engine_matches_transformers(kind, family_files):
    from transformers import AutoConfig

    folder, f32, _ = family_files(kind)
    original, read = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(sidecar_folder(f32))
    fields = [f for f in FIELDS if hasattr(original, f) and not (kind == "mistral" and f == "sliding_window")]
    assert {f: getattr(read, f, None) for f in fields} == {f: getattr(original, f) for f in fields}
    ids = torch.tensor([list(range(3, 200, 3))])
    # the same weights; float32 sums may differ in the last bits where transformers lays experts out anew
    torch.testing.assert_close(_logits(f32, ids), _logits(folder, ids), rtol=0, atol=1e-5)
    _assert_engine_matches_transformers(f32, folder)


@pytest.mark.parametrize("kind", FAMILIES)
def test_quantized_file_matches_transformers_on_the_same_file(kind, family_files):
    _, _, quantized = family_files(kind)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(quantized)).tensors}
    assert {"Q8_0", "Q4_0"} <= kinds
    _assert_engine_matches_transformers(quantized, quantized)


def test_llama3_rope_scaling_is_read_from_the_rope_freqs_tensor(family_files):
    """transformers' GGUF reader ignores the tensor (plain RoPE); the engine's config has the scaling."""
    from transformers import AutoConfig

    folder, f32, _ = family_files("llama")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(f32)).tensors}
    assert AutoConfig.from_pretrained(f32.parent, gguf_file=f32.name).rope_parameters["rope_type"] == "default"
    assert AutoConfig.from_pretrained(sidecar_folder(f32)).rope_parameters == AutoConfig.from_pretrained(folder).rope_parameters


@pytest.mark.parametrize("setting", ["chunked-prefill", "preemption"])
def test_quantized_file_under_chunked_prefill_and_preemption(setting, family_files):
    """Llama 3 RoPE scaling read from the file, prompts of 1 to 300 tokens (transformers' reference on
    the file's weights under the engine's config: its own reader drops the scaling)."""
    _, _, quantized = family_files("llama")
    prompts = parity_prompts()
    expected = _hf_greedy(quantized, prompts, PARITY_NEW_TOKENS)
    llm = engine_for(quantized, setting)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    llm.engine.kv.pool.check_integrity()


def _assert_engine_matches_transformers(path: Path, reference: Path) -> None:
    """The engine's greedy tokens on the file are transformers' on `reference` (`_hf_model`), exactly."""
    expected = _hf_greedy(reference)
    llm = engine_for(path, "default")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS], greedy, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    llm.engine.kv.pool.check_integrity()


def _hf_greedy(path: Path, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """`hf_greedy` (tests/support/parity.py), on `_hf_model`."""
    model, outs = _hf_model(path), []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def _tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], **metadata: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_architecture_is_refused_by_name(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        sidecar_folder(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_mixtral_file_is_refused_by_name(tmp_path):
    experts = np.zeros((4, 32, 32), np.float32)
    path = _tiny_gguf(tmp_path / "m.gguf", "llama", {"blk.0.ffn_gate_exps.weight": experts}, expert_count=4)
    with pytest.raises(ValueError, match=r"'llama' with experts \(Mixtral\) is not supported"):
        sidecar_folder(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_unknown_tensor_type_is_refused_by_name(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.zeros((8, 32), np.int8)})
    with pytest.raises(ValueError, match="GGUF tensor type I8 is not supported"):
        sidecar_folder(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_unknown_tensor_is_refused_by_name_and_nothing_is_left(tmp_path):
    """A tensor the model has no place for stops the conversion, and the folder begun is removed."""
    tensors = {"token_embd.weight": np.zeros((8, 32), np.float32), "blk.0.attn_gate.weight": np.zeros((32, 32), np.float32)}
    path = _tiny_gguf(tmp_path / "m.gguf", "qwen2", tensors)
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.attn_gate.weight' has no place"):
        sidecar_folder(path, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_metadata_transformers_cannot_read_leaves_nothing(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf", "qwen2", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises for a file with no metadata
        sidecar_folder(path, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("cut", [0, 1000], ids=["not-gguf", "truncated"])
def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused_by_name(tmp_path, cut):
    path = tmp_path / "m.gguf"
    tensors = {"token_embd.weight": np.zeros((8, 32), np.float32)}
    path.write_bytes(b"\x00" * 4096 if cut == 0 else _tiny_gguf(tmp_path / "whole.gguf", "llama", tensors).read_bytes()[:cut])
    with pytest.raises(ValueError, match="m.gguf: not a readable GGUF file"):
        sidecar_folder(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
