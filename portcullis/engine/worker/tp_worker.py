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
import sys
import threading
import time
from collections.abc import Callable

import structlog
import torch
import torch.distributed as dist

from portcullis.engine.distributed import (
    init_parallel,
    is_first_stage,
    is_last_stage,
    receive_from_previous_stage,
    send_to_next_stage,
    tp_group,
    tp_rank,
    wait_for_sends,
)
from portcullis.engine.worker.model_runner import ModelRunner
from portcullis.engine.worker.rendezvous import (
    STORE_TIMEOUT,
    await_ranks,
    connections_toward,
    distributed_timeout,
    join,
    master_store,
    publish_config,
)
from portcullis.engine.worker.step_batch import HEADER, HEARTBEAT, STEP, STOP, StepBatch

log = structlog.get_logger("engine")


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
        self.device, self.tp = config.torch_device, config.tensor_parallel_size
        store = master_store(config.master_addr, config.master_port, world)
        publish_config(store, config)
        timeout = distributed_timeout()
        # The workers inherit it, Gloo's groups read it now; NCCL reads it at its first collective.
        with connections_toward(config.master_addr, keep_nccl=self.device.type == "cuda"):
            self.procs = start_workers(range(1, world // config.nnodes), store.port, config)
            try:
                await_ranks(store, range(1, world), config, STORE_TIMEOUT.total_seconds(), self.procs)
            except BaseException:
                _end(self.procs)
                raise
            dist.init_process_group(_backend(self.device), store=store, rank=0, world_size=world, timeout=timeout)
            init_parallel(0, config.tensor_parallel_size, config.pipeline_parallel_size, timeout)
        # What is sent to the other ranks (a step, a heartbeat, the stop) is sent under `lock`, so
        # the heartbeat never lands between a step's parts; the engine holds it while it submits.
        self.lock = threading.Lock()
        self._stopped, self._last_sent, self._beat_every = False, time.monotonic(), timeout.total_seconds() / 3
        self._quit = threading.Event()
        self.on_broken: Callable[[BaseException], None] | None = None  # told when a heartbeat fails
        atexit.register(self.shutdown)

    def start_heartbeat(self) -> None:
        """Once the engine is built: building it runs collectives of its own (the KV-cache size
        all ranks agree on), which a heartbeat must not meet."""
        threading.Thread(target=self._heartbeat, name="engine-heartbeat", daemon=True).start()

    def send_step(self, batch: StepBatch) -> None:
        """Give stage 0's other TP ranks the step (later stages get it from the stage before)."""
        self._last_sent = time.monotonic()
        if self.tp > 1:
            header, payload = batch.to_wire()
            dist.broadcast(header, src=0, group=tp_group())
            dist.broadcast(payload, src=0, group=tp_group())

    def _heartbeat(self) -> None:
        """While no step is sent, a heartbeat at a third of the timeout: an idle rank waits for
        its next step within the timeout, which then only ends a rank that truly hangs."""
        while not self._quit.wait(self._beat_every / 4):
            if time.monotonic() - self._last_sent < self._beat_every:
                continue
            with self.lock:
                if self._stopped:
                    return
                try:
                    _pass_on(self._header(HEARTBEAT), self.tp)
                except RuntimeError as exc:  # the group is broken: tell the engine, which ends
                    log.error("heartbeat to the other ranks failed; they are gone", error=str(exc)[:200])
                    if self.on_broken is not None:
                        self.on_broken(exc)
                    return
                self._last_sent = time.monotonic()

    def _header(self, command: int) -> torch.Tensor:
        return torch.tensor([command] + [0] * (HEADER - 1), dtype=torch.long, device=self.device)

    def shutdown(self) -> None:
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
        self._quit.set()
        try:
            with self.lock:
                _pass_on(self._header(STOP), self.tp)
                wait_for_sends()
        except RuntimeError as exc:  # the group is broken (a rank died or hung): end ours regardless
            log.warning("the other ranks could not be told to stop; ending this node's", error=str(exc)[:200])
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            init_parallel(0, 1)  # the group held the store: freed, it frees the rendezvous port
            atexit.unregister(self.shutdown)


def start_workers(ranks: range, port: int, config) -> list:
    """Spawn these ranks; they meet rank 0's store at config.master_addr:port."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(rank, port, config, os.getpid()), daemon=True)
             for rank in ranks]
    for p in procs:
        p.start()
    return procs


def run_headless(config) -> int:
    """A node past the first (`--headless`): start this node's ranks, which meet rank 0 at
    master_addr:master_port, and keep them running. When one ends (the group was stopped, or a
    rank anywhere failed, which ends every rank), end the others and start them again to join the
    group's next start (`portcullis serve` on node 0 restarts it); until SIGTERM or SIGINT."""
    local = config.world_size // config.nnodes
    ranks = range(config.node_rank * local, (config.node_rank + 1) * local)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    while not stopping.is_set():
        log.info("starting this node's ranks", node_rank=config.node_rank, ranks=list(ranks),
                 master=f"{config.master_addr}:{config.master_port}")
        with connections_toward(config.master_addr):
            procs = start_workers(ranks, config.master_port, config)
        while not stopping.is_set() and all(p.is_alive() for p in procs):
            stopping.wait(0.2)
        _end(procs)
        codes = [p.exitcode for p in procs]
        if not stopping.is_set():
            log.warning("a rank of this node ended; joining the group's next start", exitcodes=codes)
            stopping.wait(2.0)
    return 0


def _end(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _pass_on(header: torch.Tensor, tp: int) -> None:
    """Pass a stop or heartbeat on: rank 0 to its stage's TP ranks, every rank of a stage to the
    same TP rank of the next."""
    if tp > 1 and is_first_stage() and tp_rank() == 0:
        dist.broadcast(header, src=0, group=tp_group())
    if not is_last_stage():
        send_to_next_stage(header)


def _worker_main(rank: int, port: int, config, parent: int) -> None:
    _die_with_parent(parent)
    world = config.world_size
    if config.torch_device.type == "cuda":  # one GPU per rank of this host, as rank 0 takes the first
        config.torch_device = torch.device("cuda", rank % (world // config.nnodes))
        torch.cuda.set_device(config.torch_device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore(config.master_addr, port, world, False, STORE_TIMEOUT)
    join(store, rank, config)
    timeout = distributed_timeout()
    dist.init_process_group(_backend(config.torch_device), store=store, rank=rank, world_size=world, timeout=timeout)
    # Before the model: layers read their rank when they shard, models their stage when they build.
    init_parallel(rank, config.tensor_parallel_size, config.pipeline_parallel_size, timeout)
    runner = ModelRunner(config)
    with torch.inference_mode():
        while (batch := _receive_step(runner.device, config.tensor_parallel_size)) is not None:
            runner.forward(batch)
    dist.destroy_process_group()


def _receive_step(device: torch.device, tp: int) -> StepBatch | None:
    """The next step: from rank 0 on the first stage, from the same TP rank of the stage before on
    the others; None on a stop (passed on first)."""
    while True:
        header = torch.empty(HEADER, dtype=torch.long, device=device)
        if is_first_stage():
            dist.broadcast(header, src=0, group=tp_group())
        else:
            header = receive_from_previous_stage((HEADER,), torch.long, device)
        values = header.tolist()
        if values[0] == STEP:
            break
        _pass_on(header, 1)
        if values[0] == STOP:
            wait_for_sends()
            return None
    if is_first_stage():
        payload = torch.empty(StepBatch.payload_size(values), dtype=torch.long, device=device)
        dist.broadcast(payload, src=0, group=tp_group())
    else:
        payload = receive_from_previous_stage((StepBatch.payload_size(values),), torch.long, device)
    return StepBatch.from_wire(values, payload)
