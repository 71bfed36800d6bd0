"""Shared test fixtures: small random-weight Hugging Face checkpoints built with transformers itself.

Nothing is downloaded: each fixture builds a config, initialises the model with `from_config`,
saves it with `save_pretrained` next to the demo model's real byte-level BPE tokenizer, once per
test session.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

try:
    import torch
except ModuleNotFoundError:  # the gateway's base install (`make test-gateway`): no engine tests run
    torch = None

# Only the gateway's tests (the command line's among them) run without the engine's stack.
ENGINE_FREE = ("gateway",)
if torch is None:
    collect_ignore = [p.name for p in Path(__file__).parent.iterdir() if p.is_dir() and p.name not in ENGINE_FREE]
    collect_ignore_glob = ["gateway/test_real_engine.py", "gateway/test_otel.py"]  # a real engine behind

# CI runs the gateway's tests once, in the gateway's torch-free install (`make test-gateway`), and
# sets this for `make test`, which then runs only the two gateway files that need the engine.
GATEWAY_SUITE_ELSEWHERE = os.environ.get("PORTCULLIS_GATEWAY_TESTS_IN_OWN_INSTALL") == "1"


def pytest_ignore_collect(collection_path, config):
    if GATEWAY_SUITE_ELSEWHERE and torch is not None and collection_path.parent.name == "gateway" \
            and collection_path.name.startswith("test_") and collection_path.name not in ("test_real_engine.py", "test_otel.py"):
        return True
    return None

if torch is not None and not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only through the interpreter, which must be chosen
    # before any kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `--dtype auto` probes the CPU and may pick bfloat16 on one machine and float32 on the next:
# the suite runs float32 wherever it runs, whatever the shell exports (subprocess engines
# inherit this); tests of the choice itself delete it.
os.environ["PORTCULLIS_CPU_DTYPE"] = "float32"

from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Small but not degenerate: GQA, several layers, head_dim not always hidden/heads.
_COMMON = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-6, initializer_range=0.04, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)
MODEL_SPECS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=4096, head_dim=16)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, head_dim=32, use_sliding_window=False)),
    # Gemma (1): GeGLU, (1 + w) norms, scaled embeddings, tied head.
    "gemma": ("gemma", dict(head_dim=32)),
    # Gemma 2: sliding/full alternation with a window the 150- and 300-token prompts cross,
    # query_pre_attn_scalar apart from head_dim, and soft-capping that bites (tests/engine/model/test_family_gemma.py);
    # untied, because the tied random model repeats one token whatever it attends to.
    "gemma2": ("gemma2", dict(tie_word_embeddings=False, num_hidden_layers=4, head_dim=32, sliding_window=32, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, initializer_range=0.3)),
    # Gemma 3 text: Q/K norms, mixed layer types with their own RoPE (linear scaling on full layers), one KV head.
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=1, sliding_window=32,
                                   query_pre_attn_scalar=48, layer_types=["sliding_attention", "full_attention",
                                                                          "sliding_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                       "factor": 4.0}})),
    # Mixtures of experts: top-2 of 8 (Mixtral renormalises), Qwen2-MoE with its shared expert and
    # without renormalising, Qwen3-MoE renormalising with layer 1 dense.
    "mixtral": ("mixtral", dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    "qwen2_moe": ("qwen2_moe", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # LongRoPE below its original context (the engine's max_model_len 512 <= 1024): short factors;
    # a sliding window the longer prompts cross, as Phi-3-mini has one.
    "phi3": ("phi3", dict(tie_word_embeddings=False, sliding_window=64, original_max_position_embeddings=1024, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 1024})),
}


def build_checkpoint(kind: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a random-weight `kind` checkpoint (float32) with the demo tokenizer into `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = MODEL_SPECS[kind]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (DEMO_MODEL_DIR / name).is_file():
            shutil.copy(DEMO_MODEL_DIR / name, out_dir / name)
    _without_fim_tokens(out_dir)
    return out_dir


def _without_fim_tokens(folder: Path) -> None:
    """Test checkpoints are plain byte-level models: the demo tokenizer's FIM tokens are renamed
    to unused ones (same ids), so a suffix is refused unless a test gives a model FIM tokens."""
    from tests.support.tokenizers import without_fim_tokens

    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            path.write_text(without_fim_tokens(path.read_text()))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`checkpoint_factory(kind)` -> path of that random-weight checkpoint, built once per session."""
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_checkpoint(kind, tmp_path_factory.mktemp(f"{kind}-ckpt"))
        return built[kind]

    return make


@pytest.fixture(scope="session")
def llama_model(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def mistral_model(checkpoint_factory) -> Path:
    return checkpoint_factory("mistral")


@pytest.fixture(scope="session")
def qwen2_model(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_model(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO_MODEL_DIR


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(model)` -> transformers' answers on a real GGUF file and the weights it read as a
    Hugging Face folder (tests/support/real_models.py), made once per session."""
    from tests.support.real_models import transformers_reference

    made = {}

    def of(model):
        if model.file not in made:
            made[model.file] = transformers_reference(model, tmp_path_factory.mktemp(Path(model.file).stem))
        return made[model.file]

    yield of
    for ref in made.values():
        shutil.rmtree(ref.folder, ignore_errors=True)

