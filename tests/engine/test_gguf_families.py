"""GGUF files of every family the engine serves from GGUF, written from random-weight checkpoints the
way llama.cpp's converter writes them (tests/support/gguf_writer.py): transformers reads the F32 file
back as the original model, and the engine on each file gives exactly transformers' greedy tokens on
that same file, F32 and Q8_0/Q4_0 (both dequantize the same bytes). Files transformers cannot read,
or the engine does not know, are refused by name with nothing left half-converted.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from portcullis.engine import SamplingParams
from portcullis.engine.gguf_checkpoint import sidecar_folder
from tests.conftest import build_checkpoint
from tests.support.gguf_writer import GGUF_ROUND_TRIP, write_gguf
from tests.support.parity import assert_greedy_parity, engine_for, hf_greedy, parity_prompts

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


def _logits(model_dir: Path, ids: torch.Tensor, gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    kwargs = dict(gguf_file=gguf_file) if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("kind", FAMILIES)
def test_f32_file_is_the_checkpoint_and_the_engine_matches_transformers(kind, family_files):
    folder, f32, _ = family_files(kind)
    ids = torch.tensor([list(range(3, 200, 3))])
    # the same weights; float32 sums may differ in the last bits where transformers lays experts out anew
    torch.testing.assert_close(_logits(f32.parent, ids, f32.name), _logits(folder, ids), rtol=0, atol=1e-5)
    _assert_engine_matches_transformers(f32)


@pytest.mark.parametrize("kind", FAMILIES)
def test_quantized_file_matches_transformers_on_the_same_file(kind, family_files):
    _, _, quantized = family_files(kind)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(quantized)).tensors}
    assert {"Q8_0", "Q4_0"} <= kinds
    _assert_engine_matches_transformers(quantized)


@pytest.mark.parametrize("setting", ["chunked-prefill", "preemption"])
def test_quantized_file_under_chunked_prefill_and_preemption(setting, family_files):
    _, _, quantized = family_files("llama")
    assert_greedy_parity(quantized, setting)


def _assert_engine_matches_transformers(path: Path) -> None:
    """The engine's greedy tokens on the file are transformers' on the same file, exactly."""
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    llm = engine_for(path, "default")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS], greedy, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    llm.engine.kv.pool.check_integrity()


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
