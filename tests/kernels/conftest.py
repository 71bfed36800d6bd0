"""Fixtures of the kernel tests: random paged-attention cases and error measures.

The helpers reach test modules through the session fixture ``paged`` (pytest runs with
``--import-mode=importlib``, so a test module cannot import a sibling helper module).

Every case draws fresh random data from its own seed (never zeros), spreads each sequence's
blocks over a shuffled pool so block tables are non-contiguous, and fills table entries past
a sequence's blocks with arbitrary valid ids, as the engine may.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from portcullis.kernels import PagedBatch


@dataclass
class PagedCase:
    """Inputs of one paged_attention call plus the caches they read."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    query_lens: list[int]

    def batch(self, device: str = "cpu", **bounds) -> PagedBatch:
        """This case's layout on ``device``, with a fresh plan; ``bounds`` may give
        ``max_query_len`` and ``max_context_len``."""
        return PagedBatch(self.cu_seqlens_q.to(device), self.context_lens.to(device),
                          self.block_tables.to(device), **bounds)

    def kwargs(self) -> dict:
        """Keyword arguments of ``paged_attention`` for this case (a fresh batch each call)."""
        return {"batch": self.batch(), "scale": self.scale}


def make_paged_case(
    seqs: list[tuple[int, int]],
    *,
    seed: int,
    block_size: int = 16,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 5,
) -> PagedCase:
    """A case with one sequence per (query_len, context_len) pair."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen)
    # Past each sequence's own blocks the table holds arbitrary valid ids.
    block_tables = torch.randint(0, num_blocks, (len(seqs), max_blocks), generator=gen)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = pool[used:used + count]
        used += count
    query_lens = [q for q, _ in seqs]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        cu_seqlens_q=cu,
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32),
        block_tables=block_tables.to(torch.int32),
        scale=head_dim**-0.5,
        query_lens=query_lens,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound the issue sets per dtype."""
    return 1e-3 if dtype == torch.float32 else 1e-2


def make_write_case(num_tokens: int, block_size: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, kv_heads, head_dim = 9, 2, 64
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens
    return key, value, caches, slots


@pytest.fixture(scope="session")
def paged() -> SimpleNamespace:
    """The case builders and error measures above, for test modules."""
    return SimpleNamespace(
        case=make_paged_case, write_case=make_write_case,
        relative_error=relative_error, tolerance=tolerance,
    )


@pytest.fixture
def no_attention_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with the default dispatch, whatever the developer's shell exports."""
    monkeypatch.delenv("PORTCULLIS_ATTENTION", raising=False)
