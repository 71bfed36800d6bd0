"""Embeddings: a pooling runner turns each prompt's hidden states into one vector.

What a checkpoint wants is read from its sentence-transformers files when it has them
(`modules.json` naming a Pooling module, whose `config.json` says mean, last-token or CLS
pooling, and a Normalize module); without them, last-token pooling of the final hidden state,
L2-normalised, as decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) are used.
A pooling request is a prefill that ends in a vector: it runs through the same scheduler and
paged KV cache as generation, computes its whole prompt (no prefix-cache skipping, since mean and
CLS pooling need every position) and finishes when its last chunk is computed.

This module holds what crosses the engine's rooms (the checkpoint's `PoolingConfig`, a request's
`PoolingParams`); the vector itself is made in the runner (`worker.pooler`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from portcullis.engine.errors import RequestError

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingConfig:
    """How the model's final hidden states become one embedding."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None  # Matryoshka sizes the model was trained for, if any

    @staticmethod
    def from_checkpoint(path: Path, hf_config) -> PoolingConfig:
        return PoolingConfig(*_sentence_transformers(path), dimensions=_matryoshka(hf_config))


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options, as vLLM's `PoolingParams`."""

    dimensions: int | None = None  # keep the first N features (Matryoshka models), renormalised

    def check(self, config: PoolingConfig, hidden_size: int) -> None:
        if self.dimensions is None:
            return
        if config.dimensions is None:
            raise RequestError("this model does not support `dimensions` (it was not trained for Matryoshka "
                               "truncation); leave it out", "dimensions")
        if not 1 <= self.dimensions <= hidden_size:
            raise RequestError(f"dimensions must be between 1 and {hidden_size}, got {self.dimensions}", "dimensions")


def _sentence_transformers(path: Path) -> tuple[str, bool]:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "last", True
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    normalize = "Normalize" in kinds
    pooling_type = "last"
    if "Pooling" in kinds:
        cfg = json.loads((path / kinds["Pooling"] / "config.json").read_text())
        if cfg.get("pooling_mode_mean_tokens"):
            pooling_type = "mean"
        elif cfg.get("pooling_mode_cls_token"):
            pooling_type = "cls"
        elif not cfg.get("pooling_mode_lasttoken"):
            modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{path}: sentence-transformers pooling {modes} is not supported; "
                             f"supported: {', '.join(POOLING_TYPES)}")
    return pooling_type, normalize


def _matryoshka(hf_config) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return (hf_config.hidden_size,) if getattr(hf_config, "is_matryoshka", False) else None
