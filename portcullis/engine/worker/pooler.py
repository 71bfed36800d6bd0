"""The runner's side of embeddings: one vector from what it kept of a prompt's hidden states, as
the checkpoint's `PoolingConfig` and the request's `PoolingParams` (engine.pooling) say."""
from __future__ import annotations

import torch

from portcullis.engine.pooling import PoolingConfig, PoolingParams


def pool(config: PoolingConfig, params: PoolingParams, first: torch.Tensor, total: torch.Tensor, last: torch.Tensor,
         num_tokens: int) -> torch.Tensor:
    """One embedding from what the runner kept of a prompt's hidden states: the first row, the sum
    of all rows, the last row (each float32)."""
    if config.pooling_type == "mean":
        vector = total / num_tokens
    elif config.pooling_type == "cls":
        vector = first
    else:
        vector = last
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector
