"""Tensor-parallel state: which rank this process is and how to combine shards.

At world size 1 every collective is a no-op, so single-process code pays nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def init_tensor_parallel(rank: int, world_size: int) -> None:
    """Record this process's place; the process group itself is set up by the worker launcher."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def agree_on_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks), so all ranks size caches alike."""
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
