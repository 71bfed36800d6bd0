"""Parallel state: which rank this process is, on the grid of pipeline stages × tensor-parallel
ranks, and how to combine shards and hand hidden states between stages.

Global rank = pp_rank * tp_size + tp_rank (vLLM's layout: each stage's TP ranks are neighbours).
Rank 0 is stage 0's TP rank 0: it schedules, broadcasts each step to every rank, and samples.
At world size 1 every collective is a no-op, so single-process code pays nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK, _TP_SIZE = 0, 1
_PP_RANK, _PP_SIZE = 0, 1
_TP_GROUP = None  # this stage's TP ranks; None: the default group (one stage) or no collectives


def init_parallel(rank: int, tp: int, pp: int = 1, timeout=None) -> None:
    """Record this process's place. The default process group is set up by the worker launcher;
    with several stages every rank builds each stage's TP group here (in the same order, as
    torch.distributed requires), keeping its own; `timeout` bounds their waits as the default
    group's."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP = rank % tp, tp, rank // tp, pp, None
    if pp > 1 and tp > 1:
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == _PP_RANK:
                _TP_GROUP = group


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def pp_rank() -> int:
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def stage_layers(num_layers: int, stage: int | None = None, stages: int | None = None) -> range:
    """The contiguous layers `stage` holds: an even split, the remainder going one each to the
    stages before the last (the first holds the embedding and the last the head, as vLLM splits)."""
    stage, stages = (_PP_RANK if stage is None else stage), (_PP_SIZE if stages is None else stages)
    if num_layers < stages:
        raise ValueError(f"pipeline_parallel_size={stages} is more than the model's {num_layers} layers")
    sizes = [num_layers // stages] * stages
    for i in range(num_layers % stages):
        sizes[-2 - i] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def tp_group():
    """This stage's TP group for collectives (None: the default group, or no group at TP=1)."""
    return _TP_GROUP


# Point-to-point sends between stages do not wait for the receiver, so a stage can take its next
# step while the next stage works on this one: with pipeline_parallel_size steps in flight every
# stage is busy. Their handles are kept until done (the tensors live as long as the send).
_SENDS: list = []


def _send(x: torch.Tensor, dst: int) -> None:
    global _SENDS
    _SENDS = [w for w in _SENDS if not w.is_completed()]
    _SENDS.append(dist.isend(x.contiguous(), dst=dst))


def wait_for_sends() -> None:
    for work in _SENDS:
        work.wait()
    _SENDS.clear()


def send_to_next_stage(*tensors: torch.Tensor) -> None:
    """Hand tensors, in order, to the same TP rank of the next stage."""
    for x in tensors:
        _send(x, (_PP_RANK + 1) * _TP_SIZE + _TP_RANK)


def receive_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=(_PP_RANK - 1) * _TP_SIZE + _TP_RANK)
    return x


def send_logits(logits: torch.Tensor) -> None:
    """The last stage's TP rank 0 hands a step's logits to rank 0, which samples."""
    _send(logits, 0)


def receive_logits(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    logits = torch.empty(rows, vocab, dtype=dtype, device=device)
    dist.recv(logits, src=(_PP_SIZE - 1) * _TP_SIZE)
    return logits


def agree_on_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks), so all ranks size caches alike."""
    if _TP_SIZE * _PP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
