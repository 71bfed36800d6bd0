"""Time the PyTorch (CPU) path of the kernels on the shapes the engine runs.

Each scenario is one engine step: the per-step plan is built once and shared by every layer
(as the engine does), so a step costs ``plan + layers x attention``; layers cycle through
distinct caches, so K/V come from memory rather than the last-level cache. The naive reference
(one sequence at a time, K/V repeated for GQA) is timed on one layer for comparison.
Medians of repeats, as wall time and as process CPU time: on a shared machine run with
``--threads 1`` and read the CPU figures, which do not count time spent descheduled.

A second table is decode attention alone over 128 sequences x 512 tokens, against this
machine's copy bandwidth measured in the same run (a torch copy of a buffer as large as the K/V
that attention reads; copy bandwidth counts bytes read + written, as STREAM does), for the
old path (gather + SDPA / embedding_bag) and the new one (the compiled kernel of
kernels.cpu_decode, which reads K/V in place), taking turns.

    python benchmarks/attention_cpu.py [--repeats 7] [--threads N] [--json out.json] [--quick]
                                       [--bandwidth-only] [--processes N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from portcullis.host import cpu_model  # noqa: E402
from portcullis.kernels import (  # noqa: E402
    PagedBatch,
    allocate_kv_cache,
    cpu_decode,
    paged_attention,
    torch_attention,
    write_kv_cache,
)
from portcullis.kernels.reference import paged_attention_reference  # noqa: E402


@dataclass
class Model:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int = 64
    block_size: int = 16


DEMO = Model("demo", layers=4, q_heads=4, kv_heads=2)
QWEN = Model("qwen2.5-0.5b", layers=24, q_heads=14, kv_heads=2)


@dataclass
class Scenario:
    name: str
    model: Model
    decodes: int  # sequences with one query token, contexts uniform in 32..800
    prefills: list[tuple[int, int]]  # (query_len, context_len) chunks
    context: int | None = None  # every decode's context length, instead of 32..800
    dtype: torch.dtype = torch.float32  # the caches'


SCENARIOS = [
    Scenario("decode x1", DEMO, 1, []),
    Scenario("decode x64", DEMO, 64, []),
    Scenario("decode x256", DEMO, 256, []),
    Scenario("prefill 2048", DEMO, 0, [(2048, 2048)]),
    Scenario("prefill 512 after 1536", DEMO, 0, [(512, 2048)]),
    Scenario("mixed 250 + 2 chunks", DEMO, 250, [(1024, 1024), (512, 1536)]),
    Scenario("decode x256", QWEN, 256, []),
    Scenario("mixed 250 + 1 chunk", QWEN, 250, [(1024, 1024)]),
]


def time_once(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, process CPU) milliseconds of one call.

    On a shared machine wall time also counts time spent descheduled; with one thread, CPU
    time is what the call would take on an idle machine.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - start) * 1e3, (time.process_time() - start_cpu) * 1e3


def timings_ms(fn: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU times of ``repeats`` calls, after one warm-up call."""
    (runs,) = interleaved_ms([fn], repeats)
    return runs


def interleaved_ms(fns: list[Callable[[], object]], repeats: int) -> list[tuple[list, list]]:
    """Wall and CPU times of several functions taking turns, so that noise hits all alike."""
    for fn in fns:
        fn()  # warm-up
    runs: list[tuple[list, list]] = [([], []) for _ in fns]
    for _ in range(repeats):
        for fn, (wall, cpu) in zip(fns, runs):
            one_wall, one_cpu = time_once(fn)
            wall.append(one_wall)
            cpu.append(one_cpu)
    return runs


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time."""
    return statistics.median(timings_ms(fn, repeats)[0])


def build_inputs(sc: Scenario, seed: int = 0) -> dict:
    """Random caches, queries and step batch for one scenario (``paged_attention``'s
    arguments by name)."""
    gen = torch.Generator().manual_seed(seed)
    m = sc.model
    ctx = torch.randint(32, 801, (sc.decodes,), generator=gen).tolist()
    if sc.context is not None:
        ctx = [sc.context] * sc.decodes
    seqs = [(1, c) for c in ctx] + sc.prefills
    per_seq = [-(-c // m.block_size) for _, c in seqs]
    num_blocks = sum(per_seq) + 16
    table = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
    pool, used = torch.randperm(num_blocks, generator=gen), 0
    for s, n in enumerate(per_seq):
        table[s, :n] = pool[used:used + n]
        used += n
    shape = (num_blocks, m.block_size, m.kv_heads, m.head_dim)
    q_lens = [q for q, _ in seqs]
    return {
        "query": torch.randn(sum(q_lens), m.q_heads, m.head_dim, generator=gen),
        "key_cache": random_cache(shape, sc.dtype, gen),
        "value_cache": random_cache(shape, sc.dtype, gen),
        "batch": PagedBatch(
            cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                      dtype=torch.int32),
            context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32),
            block_tables=table,
        ),
        "scale": m.head_dim**-0.5,
    }


def random_cache(shape: tuple[int, ...], dtype: torch.dtype,
                 gen: torch.Generator | None = None) -> torch.Tensor:
    """A cache allocated as the engine allocates it (on 2 MiB pages where the OS allows)."""
    return allocate_kv_cache(shape, dtype).copy_(torch.randn(shape, generator=gen))


# Distinct caches cycled through the layers, so that (as in the engine) a layer does not find
# the previous layer's K/V still in the last-level cache.
DISTINCT_CACHES = 4


def layer_caches(inputs: dict, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (key, value) cache pairs shaped like the scenario's, with other data."""
    pairs = [(inputs["key_cache"], inputs["value_cache"])]
    for _ in range(count - 1):
        shape, dtype = inputs["key_cache"].shape, inputs["key_cache"].dtype
        pairs.append((random_cache(shape, dtype), random_cache(shape, dtype)))
    return pairs


def time_scenario(sc: Scenario, repeats: int) -> dict:
    """Step time of the fast path, its per-layer part, and the naive reference per layer."""
    inputs = build_inputs(sc)
    query, warm_batch, scale = inputs["query"], inputs["batch"], inputs["scale"]
    caches = layer_caches(inputs, min(DISTINCT_CACHES, sc.model.layers))
    out = torch.empty_like(query)

    def layers(batch: PagedBatch, count: int) -> None:
        for i in range(count):
            key_cache, value_cache = caches[i % len(caches)]
            paged_attention(query, key_cache, value_cache, batch, scale=scale, out=out)

    layers(warm_batch, 1)
    # A step with the plan already built (so: layers only) and one that builds it (a new
    # batch, as each engine step makes), interleaved so that both see the same machine; their
    # difference is the plan's cost.
    warm, fresh = interleaved_ms([lambda: layers(warm_batch, sc.model.layers),
                                  lambda: layers(replace(warm_batch, plan={}), sc.model.layers)],
                                 repeats)
    ref_wall, ref_cpu = timings_ms(lambda: paged_attention_reference(**inputs),
                                   max(3, repeats // 3))
    layer_ms = statistics.median(warm[0]) / sc.model.layers
    layer_cpu_ms = statistics.median(warm[1]) / sc.model.layers
    num_tokens = inputs["query"].shape[0]
    slots = torch.randperm(inputs["key_cache"].shape[0] * sc.model.block_size)[:num_tokens]
    new_kv = inputs["key_cache"].new_empty(num_tokens, sc.model.kv_heads, sc.model.head_dim)
    write_ms = median_ms(lambda: write_kv_cache(new_kv, new_kv, inputs["key_cache"],
                                                inputs["value_cache"], slots), repeats)
    return {
        "scenario": sc.name, "model": sc.model.name, "layers": sc.model.layers,
        "tokens": num_tokens, "layer_ms": layer_ms, "layer_cpu_ms": layer_cpu_ms,
        "step_ms": statistics.median(fresh[0]), "step_cpu_ms": statistics.median(fresh[1]),
        "plan_cpu_ms": statistics.median(fresh[1]) - statistics.median(warm[1]),
        "reference_layer_ms": statistics.median(ref_wall),
        "reference_layer_cpu_ms": statistics.median(ref_cpu),
        # From CPU times: robust to the machine's other tenants.
        "speedup": statistics.median(ref_cpu) / layer_cpu_ms,
        "write_ms": write_ms,
    }


BANDWIDTH_SCENARIOS = [
    Scenario("decode 128 x 512", DEMO, 128, [], context=512),
    Scenario("decode 128 x 512", DEMO, 128, [], context=512, dtype=torch.bfloat16),
    Scenario("decode 128 x 512", QWEN, 128, [], context=512),
]


def time_decode_bandwidth(sc: Scenario, repeats: int) -> dict:
    """One layer's decode attention, old path vs new, against a copy of as many bytes."""
    inputs = build_inputs(sc)
    query, batch, scale = inputs["query"], inputs["batch"], inputs["scale"]
    caches = layer_caches(inputs, 2)  # each pair is larger than a last-level cache
    m = sc.model
    read_bytes = 2 * sc.decodes * sc.context * m.kv_heads * m.head_dim * inputs["key_cache"].element_size()
    # The copy's buffers live on the same kind of pages as the caches.
    source = allocate_kv_cache((read_bytes // 4,), torch.float32).fill_(1.0)
    target = allocate_kv_cache((read_bytes // 4,), torch.float32)
    out = torch.empty_like(query)
    turn = [0]

    def attend(native: bool) -> None:
        torch_attention.NATIVE_DECODE = native
        key_cache, value_cache = caches[turn[0] % len(caches)]
        turn[0] += 1
        paged_attention(query, key_cache, value_cache, batch, scale=scale, out=out)

    try:
        old, new, copy = interleaved_ms([lambda: attend(False), lambda: attend(True),
                                         lambda: target.copy_(source)], repeats)
    finally:
        torch_attention.NATIVE_DECODE = True
    old_ms, new_ms, copy_ms = (statistics.median(cpu) for _, cpu in (old, new, copy))
    copy_gbs = 2 * read_bytes / copy_ms / 1e6  # read + write
    new_gbs = read_bytes / new_ms / 1e6
    # With several threads, process CPU time also counts threads waiting at the end of a
    # parallel region (torch's copy_ and the kernel each have their own pool): wall time is the
    # figure there, on a machine with the threads' cores free.
    new_wall, copy_wall = statistics.median(new[0]), statistics.median(copy[0])
    return {
        "scenario": sc.name, "model": m.name, "cache_dtype": str(sc.dtype).removeprefix("torch."),
        "kv_read_mb": read_bytes / 1e6, "old_cpu_ms": old_ms, "new_cpu_ms": new_ms,
        "copy_cpu_ms": copy_ms, "speedup": old_ms / new_ms, "new_read_gbs": new_gbs,
        "old_read_gbs": read_bytes / old_ms / 1e6, "copy_gbs": copy_gbs,
        "fraction_of_copy": new_gbs / copy_gbs, "new_wall_ms": new_wall, "copy_wall_ms": copy_wall,
        "fraction_of_copy_wall": copy_wall / (2 * new_wall),
    }


def print_bandwidth(rows: list[dict]) -> None:
    print("decode attention alone, one layer; medians of process CPU ms, old/new/copy taking turns;"
          " last two columns from wall time")
    print(f"{'model':<13} {'cache':<9} {'K/V MB':>7} {'old ms':>7} {'new ms':>7} {'old/new':>8} "
          f"{'copy ms':>8} {'new GB/s':>9} {'copy GB/s':>10} {'of copy':>8} {'new/copy wall ms':>17} "
          f"{'of copy':>8}")
    for r in rows:
        print(f"{r['model']:<13} {r['cache_dtype']:<9} {r['kv_read_mb']:>7.1f} "
              f"{r['old_cpu_ms']:>7.2f} {r['new_cpu_ms']:>7.2f} {r['speedup']:>7.2f}x "
              f"{r['copy_cpu_ms']:>8.2f} {r['new_read_gbs']:>9.1f} {r['copy_gbs']:>10.1f} "
              f"{r['fraction_of_copy']:>7.0%} {r['new_wall_ms']:>8.2f}/{r['copy_wall_ms']:<8.2f} "
              f"{r['fraction_of_copy_wall']:>7.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="demo-model scenarios only")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--bandwidth-only", action="store_true",
                        help="only the decode attention vs copy bandwidth table")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the bandwidth table in this many fresh processes, one after the other, and "
                             "report each and their medians (on a shared VM the copy baseline moves from one "
                             "process to the next by more than within one)")
    args = parser.parse_args()
    if args.processes > 1:
        return bandwidth_across_processes(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_decode.native_library() is not None
    scenarios = [s for s in SCENARIOS if not (args.quick and s.model is QWEN)]
    rows = [] if args.bandwidth_only else [time_scenario(sc, args.repeats) for sc in scenarios]
    bandwidth = [time_decode_bandwidth(sc, 3 * args.repeats) for sc in BANDWIDTH_SCENARIOS
                 if not (args.quick and sc.model is QWEN)]
    if args.json:
        args.json.write_text(json.dumps({
            "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_model(),
            "native_decode": native, "models": [asdict(DEMO), asdict(QWEN)], "results": rows,
            "decode_bandwidth": bandwidth,
        }, indent=2))
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} cpu={cpu_model()} "
          f"decode={'native kernel' if native else 'PyTorch path (no native kernel)'}")
    if rows:
        print_steps(rows)
    print_bandwidth(bandwidth)


def bandwidth_across_processes(args: argparse.Namespace) -> None:
    """The bandwidth table of `args.processes` runs of this script, each in a fresh process."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, __file__, "--bandwidth-only", "--repeats", str(args.repeats), "--json", str(out),
                   *(["--threads", str(args.threads)] if args.threads else []), *(["--quick"] if args.quick else [])]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
    rows = [r for run in runs for r in run["decode_bandwidth"]]
    keys = list(dict.fromkeys((r["model"], r["cache_dtype"]) for r in rows))
    print(f"threads={runs[0]['threads']} cpu={runs[0]['cpu']} processes={args.processes} repeats={3 * args.repeats}")
    print("decode attention's K/V read rate as a share of copy (read + write), per process and median")
    print(f"{'model':<13} {'cache':<9} {'CPU time: each process':<40} {'median':>7}   {'wall: each process':<40} {'median':>7}")
    summary = []
    for model, dtype in keys:
        mine = [r for r in rows if (r["model"], r["cache_dtype"]) == (model, dtype)]
        cpu, wall = [r["fraction_of_copy"] for r in mine], [r["fraction_of_copy_wall"] for r in mine]
        cpu_median, wall_median = statistics.median(cpu), statistics.median(wall)
        summary.append({"model": model, "cache_dtype": dtype, "fraction_of_copy": cpu, "fraction_of_copy_wall": wall,
                        "median_fraction_of_copy": cpu_median, "median_fraction_of_copy_wall": wall_median})
        print(f"{model:<13} {dtype:<9} {' '.join(f'{x:.0%}' for x in cpu):<40} {cpu_median:>7.0%}   "
              f"{' '.join(f'{x:.0%}' for x in wall):<40} {wall_median:>7.0%}")
    if args.json:
        args.json.write_text(json.dumps({"processes": runs, "summary": summary}, indent=2))


def print_steps(rows: list[dict]) -> None:
    print("medians; wall ms, and process CPU ms in brackets")
    print(f"{'model':<13} {'scenario':<24} {'tok':>5} {'layer':>16} {'step':>16} {'plan':>6} "
          f"{'reference/layer':>18} {'speedup':>8} {'write':>7}")
    for r in rows:
        print(f"{r['model']:<13} {r['scenario']:<24} {r['tokens']:>5} "
              f"{r['layer_ms']:>7.2f} [{r['layer_cpu_ms']:>6.2f}] "
              f"{r['step_ms']:>7.1f} [{r['step_cpu_ms']:>6.1f}] [{r['plan_cpu_ms']:>4.1f}] "
              f"{r['reference_layer_ms']:>8.1f} [{r['reference_layer_cpu_ms']:>7.1f}] "
              f"{r['speedup']:>7.1f}x {r['write_ms']:>7.3f}")
    print()


if __name__ == "__main__":
    main()
