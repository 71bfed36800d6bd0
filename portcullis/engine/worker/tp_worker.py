"""Parallel workers: ranks 1..N-1 of the pipeline-stages × tensor-parallel grid
(`engine.distributed`) each hold their stage's layers, their shard of them and of the KV cache,
and replay rank 0's steps. Rank 0 schedules, broadcasts each step's flattened inputs (a
`StepBatch`) to every rank, and samples; its `EngineCore` owns the `WorkerGroup`, and its
`ModelRunner` only hands each step's batch to `WorkerGroup.send_step`. Hidden states go from stage
to stage, and the last stage's logits to rank 0, inside `ModelRunner.forward`.

Workers are started with `spawn`, die with their parent (PR_SET_PDEATHSIG, so even a SIGKILL of
the engine leaves no orphan holding memory or a collective), and leave on a stop message.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

from portcullis.engine.distributed import init_parallel
from portcullis.engine.model.attention import AttentionMetadata
from portcullis.engine.worker.model_runner import ModelRunner
from portcullis.engine.worker.step_batch import StepBatch
from portcullis.kernels import PagedBatch

_STOP, _STEP = 0, 1
_HEADER = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class WorkerGroup:
    """Rank 0's handle on the other ranks. Constructing it sets this process's TP rank (0), so
    build it before the model: layers read their rank when they shard."""

    def __init__(self, config):
        world = config.world_size
        self.device = config.torch_device
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_worker_main, args=(rank, self.init_method, config, os.getpid()), daemon=True)
            for rank in range(1, world)
        ]
        for p in self.procs:
            p.start()
        dist.init_process_group(_backend(self.device), init_method=self.init_method, rank=0, world_size=world)
        init_parallel(0, config.tensor_parallel_size, config.pipeline_parallel_size)
        self._stopped = False
        atexit.register(self.shutdown)

    def send_step(self, batch: StepBatch) -> None:
        m = batch.meta.batch
        others = batch.meta.other_groups  # KV-cache groups past the first: their slots and tables follow
        header = [_STEP, len(batch.input_ids), len(m.cu_seqlens_q) - 1, m.block_tables.shape[1],
                  len(batch.logit_rows), m.max_query_len, m.max_context_len, len(others)]
        _broadcast_ints(header, self.device)
        payload = torch.cat([
            batch.input_ids, batch.positions, batch.meta.slot_mapping, m.cu_seqlens_q.long(), m.context_lens.long(),
            m.block_tables.long().flatten(), batch.logit_rows,
            *(t for g in others for t in (g.slot_mapping, g.batch.block_tables.long().flatten())),
        ])
        dist.broadcast(payload, src=0)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            _broadcast_ints([_STOP] + [0] * (_HEADER - 1), self.device)
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            init_parallel(0, 1)


def _broadcast_ints(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return t


def _worker_main(rank: int, init_method: str, config, parent: int) -> None:
    _die_with_parent(parent)
    world = config.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(_backend(config.torch_device), init_method=init_method, rank=rank, world_size=world)
    # Before the model: layers read their rank when they shard, models their stage when they build.
    init_parallel(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    runner = ModelRunner(config)
    with torch.inference_mode():
        while (batch := _receive_step(runner.device)) is not None:
            runner.forward(batch)
    dist.destroy_process_group()


def _receive_step(device: torch.device) -> StepBatch | None:
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    cmd, tokens, seqs, cols, rows, max_q, max_ctx, num_other_groups = header.tolist()
    if cmd == _STOP:
        return None
    sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * cols, rows] + [tokens, seqs * cols] * num_other_groups
    payload = torch.empty(sum(sizes), dtype=torch.long, device=device)
    dist.broadcast(payload, src=0)
    ids, pos, slots, cu, ctx, tables, logit_rows, *others = payload.split(sizes)
    cu, ctx = cu.int(), ctx.int()
    metas = [AttentionMetadata(s, PagedBatch(cu, ctx, t.view(seqs, cols).int(), max_q, max_ctx))
             for s, t in zip([slots, *others[0::2]], [tables, *others[1::2]])]
    metas[0].other_groups = metas[1:]
    return StepBatch(ids, pos, metas[0], logit_rows)
