"""What `--dtype auto` means on a CPU: bfloat16 where this CPU runs the model's matmuls clearly
faster in it, else float32.

CPUs of one kind differ: bf16 matmuls ran 250x slower than float32 on one development machine
and 3-4x faster on the next (AMX). So the choice is measured at start-up, never hard-coded: the
CPU's flags first (no bf16 instructions: float32, no probe), then a short probe of the model's
MLP shapes in both dtypes. `PORTCULLIS_CPU_DTYPE=float32|bfloat16` skips the probe (the test
suite pins float32 so that its results do not depend on the machine).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from portcullis import envs
from portcullis.host import CPUINFO, cpu_flags

DTYPE_ENV = envs.CPU_DTYPE.name
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 flags; "bf16" is in aarch64's Features
MIN_BF16_SPEEDUP = 1.3  # below this, float32's exactness is worth more than bf16's speed
PROBE_ROWS = 32  # tokens per probe matmul: a busy decode step, where a serving engine spends its time
PROBE_MAX_MACS = 1 << 24  # per matmul (about 0.3 ms in float32 here): wider models are probed on a slice
PROBE_ROUNDS = 20  # best of: fewer let the demo model's ratio swing 1.33-1.59 here, 20 keep it 1.51-1.60
_SCREEN_SLOWDOWN = 4.0  # a small screening matmul this much slower in bf16 settles it (no full probe)


@dataclass(frozen=True)
class CpuDtypeChoice:
    dtype: torch.dtype
    reason: str
    bf16_speedup: float | None = None  # float32 time / bfloat16 time on the probe; None: not probed
    cpu_flags: tuple[str, ...] | None = None  # the CPU's bf16 flags; None: the CPU does not say


def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...] | None:
    """The bf16 flags of the first CPU in `cpuinfo`; None where it does not say (not Linux)."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else tuple(f for f in BF16_FLAGS if f in flags)


def _cpu_seconds(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def _ratio(shapes: list[tuple[int, int, int]], rounds: int) -> float:
    """float32 / bfloat16 CPU time of `shapes` (m, k, n), the best of `rounds` alternated runs."""
    gen = torch.Generator().manual_seed(0)
    operands = {dt: [(torch.randn(m, k, generator=gen).to(dt), torch.randn(k, n, generator=gen).to(dt))
                     for m, k, n in shapes] for dt in (torch.float32, torch.bfloat16)}
    for a, b in (pair for pairs in operands.values() for pair in pairs):
        a @ b  # warm-up: first calls pick kernels and touch memory
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(rounds):
        for dt, pairs in operands.items():
            best[dt] = min(best[dt], sum(_cpu_seconds(lambda a=a, b=b: a @ b) for a, b in pairs))
    return best[torch.float32] / best[torch.bfloat16]


def measure_bf16_speedup(hidden: int, intermediate: int) -> float:
    """How many times faster the model's MLP matmuls (`PROBE_ROWS` tokens, up and down) run in
    bfloat16 than in float32 on one core of this CPU.

    One thread, timed in thread CPU time: the ratio is the core's instruction set, and on a busy
    machine wall-clock timings with several threads swing 10x either way (OpenMP barriers wait for
    preempted threads). A small screening pair first, so a CPU with very slow bf16 (hundreds of
    times) is not made to run a full-size one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        screen = _ratio([(PROBE_ROWS, 256, 256)], rounds=2)
        if screen < 1 / _SCREEN_SLOWDOWN:
            return screen
        width = max(64, min(intermediate, PROBE_MAX_MACS // (PROBE_ROWS * hidden)))
        return _ratio([(PROBE_ROWS, hidden, width), (PROBE_ROWS, width, hidden)], PROBE_ROUNDS)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def choose_cpu_dtype(hidden: int, intermediate: int) -> CpuDtypeChoice:
    """The dtype `--dtype auto` runs a model of these MLP shapes in on this CPU (once per process
    and shape: the probe costs tens of milliseconds)."""
    forced = envs.CPU_DTYPE.get().lower()
    if forced in ("float32", "bfloat16"):
        return CpuDtypeChoice(getattr(torch, forced), f"{DTYPE_ENV}={forced}")
    if forced not in ("", "auto"):
        raise ValueError(f"{DTYPE_ENV}={forced!r}: expected float32, bfloat16 or auto")
    flags = cpu_bf16_flags()
    if flags == ():
        return CpuDtypeChoice(torch.float32, "the CPU has no bf16 instructions", None, flags)
    speedup = measure_bf16_speedup(hidden, intermediate)
    if speedup >= MIN_BF16_SPEEDUP:
        return CpuDtypeChoice(torch.bfloat16, f"bf16 matmuls >= {MIN_BF16_SPEEDUP}x faster", speedup, flags)
    return CpuDtypeChoice(torch.float32, f"bf16 matmuls not {MIN_BF16_SPEEDUP}x faster", speedup, flags)
