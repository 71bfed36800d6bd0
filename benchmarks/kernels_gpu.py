"""GPU check of the Triton kernels: correctness at full size, timings, decode bandwidth.

One prepared run for a machine with an NVIDIA GPU (under 5 minutes):

1. measures the device's copy bandwidth (``dst.copy_(src)`` on 2 GiB, read + write bytes);
2. for each scenario (bf16, head_dim 128, 32 query / 8 KV heads, block size 16, contexts up
   to 8k, up to 256 decodes plus prefill chunks) checks ``paged_attention`` against the
   float32 reference (relative error < 1e-2) and times it with ``triton.testing.do_bench``;
3. reports decode attention's achieved bandwidth (K/V bytes read / time) as a fraction of
   the copy bandwidth: the target is >= 70% for 128 sequences x 4k context;
4. checks and times ``write_kv_cache``;
5. writes everything to a JSON file and prints a short table last.

    python benchmarks/kernels_gpu.py [--json kernels_gpu.json] [--sweep]
    python benchmarks/kernels_gpu.py --smoke   # tiny sizes on CPU through the interpreter,
                                               # to check the script itself without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Shape:
    """Model-side sizes shared by all scenarios."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


@dataclass
class Scenario:
    name: str
    decode_contexts: list[int]  # one decode (query length 1) per entry
    prefills: list[tuple[int, int]]  # (query_len, context_len) chunks
    bandwidth_target: float | None = None  # fraction of copy bandwidth expected


def full_scenarios(gen: torch.Generator) -> list[Scenario]:
    """The full-size scenarios of the GPU check."""
    spread = torch.randint(1, 8193, (256,), generator=gen).tolist()
    return [
        Scenario("decode 128 x 4k", [4096] * 128, [], bandwidth_target=0.70),
        Scenario("decode 256 x 1..8k", spread, []),
        Scenario("decode 16 x 8k", [8192] * 16, []),
        Scenario("mixed 192 dec + 4 chunks", spread[:192],
                 [(512, 4096), (512, 1024), (2048, 2048), (300, 7000)]),
        Scenario("prefill 4 x 2k", [], [(2048, 2048)] * 4),
        Scenario("prefill 1 x 8k", [], [(8192, 8192)]),
    ]


def smoke_scenarios(gen: torch.Generator) -> list[Scenario]:
    """Tiny versions that the Triton interpreter can run on a CPU in seconds."""
    spread = torch.randint(1, 100, (6,), generator=gen).tolist()
    return [
        Scenario("decode 4 x 64", [64] * 4, [], bandwidth_target=0.70),
        Scenario("mixed 6 dec + 1 chunk", spread, [(20, 50)]),
    ]


def build_inputs(sc: Scenario, shape: Shape, device: str, gen: torch.Generator) -> dict:
    """Paged caches with shuffled block tables, queries and the step's batch for one scenario
    (``paged_attention``'s arguments by name)."""
    from portcullis.kernels import PagedBatch

    seqs = [(1, c) for c in sc.decode_contexts] + list(sc.prefills)
    bs = shape.block_size
    per_seq = [-(-c // bs) for _, c in seqs]
    num_blocks = sum(per_seq) + 1
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(per_seq):
        table[s, :n] = pool[used:used + n]
        used += n
    cache_shape = (num_blocks, bs, shape.kv_heads, shape.head_dim)
    q_lens = [q for q, _ in seqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)

    # Data is drawn on the device: gigabytes of randn on the host would dominate the run.
    data_gen = torch.Generator(device=device).manual_seed(int(pool[0]))

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=data_gen, device=device, dtype=shape.dtype)

    return {
        "query": rand(int(cu[-1]), shape.q_heads, shape.head_dim),
        "key_cache": rand(*cache_shape),
        "value_cache": rand(*cache_shape),
        "batch": PagedBatch(
            cu_seqlens_q=cu.to(device),
            context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(q_lens),
            max_context_len=max(c for _, c in seqs),
        ),
        "scale": shape.head_dim**-0.5,
    }


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def kv_bytes(inputs: dict) -> int:
    """Bytes of K and V the attention must read (each cached token once), plus Q and out."""
    kc = inputs["key_cache"]
    per_token = 2 * kc.shape[2] * kc.shape[3] * kc.element_size()
    q = inputs["query"]
    return int(inputs["batch"].context_lens.sum()) * per_token + 2 * q.numel() * q.element_size()


def attention_flops(inputs: dict) -> float:
    """Useful multiply-adds x 2 of QK and PV (causal keys only)."""
    cu = inputs["batch"].cu_seqlens_q
    q_lens = (cu[1:] - cu[:-1]).double()
    ctx = inputs["batch"].context_lens.double()
    # Query i of a chunk sees ctx - q_len + i + 1 keys.
    keys = (q_lens * (ctx - q_lens) + q_lens * (q_lens + 1) / 2).sum()
    q = inputs["query"]
    return float(4 * keys * q.shape[1] * q.shape[2])


def make_timer(device: str) -> Callable[[Callable[[], object]], float]:
    """do_bench on a GPU; a plain median of wall times in smoke mode."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=100))

    def wall_ms(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def copy_bandwidth(device: str, timer, nbytes: int) -> float:
    """Device copy bandwidth in bytes/s, counting read and write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def check_and_time_attention(sc: Scenario, shape: Shape, device: str, timer,
                             copy_bw: float, gen: torch.Generator) -> dict:
    """Correctness against the float32 reference, then the kernel's time."""
    inputs = build_inputs(sc, shape, device, gen)
    row = {"scenario": sc.name, "tokens": inputs["query"].shape[0],
           "seqs": inputs["batch"].context_lens.shape[0],
           **measure(inputs, reference(inputs), timer, copy_bw),
           "tflops": 0.0, "bandwidth_target": sc.bandwidth_target}
    row["tflops"] = attention_flops(inputs) / (row["ms"] * 1e-3) / 1e12
    if sc.bandwidth_target is not None:
        row["ok"] = row["ok"] and (device != "cuda" or row["bw_fraction"] >= sc.bandwidth_target)
    return row


def reference(inputs: dict) -> torch.Tensor:
    from portcullis.kernels.reference import paged_attention_reference

    return paged_attention_reference(**inputs)


def measure(inputs: dict, ref: torch.Tensor, timer, copy_bw: float, launch: dict | None = None) -> dict:
    """One launch setting: relative error against `ref`, unwritten outputs, time, bandwidth."""
    from portcullis.kernels.triton_attention import paged_attention_triton

    out = torch.full_like(inputs["query"], float("nan"))
    paged_attention_triton(**inputs, out=out, launch=launch)
    err = relative_error(out, ref)
    unwritten = int(out.isnan().sum())
    ms = timer(lambda: paged_attention_triton(**inputs, out=out, launch=launch))
    bw = kv_bytes(inputs) / (ms * 1e-3)
    return {"ms": ms, "rel_err": err, "unwritten": unwritten, "ok": err < 1e-2 and unwritten == 0,
            "gb_per_s": bw / 1e9, "bw_fraction": bw / copy_bw}


def sweep_launch_settings(sc: Scenario, shape: Shape, device: str, timer, copy_bw: float,
                          gen: torch.Generator, settings: list[dict]) -> list[dict]:
    """Each tile / launch setting on one scenario, checked and timed; fastest first. A setting
    the device cannot launch (too much shared memory, say) is reported, not fatal."""
    inputs = build_inputs(sc, shape, device, gen)
    ref = reference(inputs)
    rows = []
    for launch in settings:
        try:
            rows.append({"scenario": sc.name, "launch": launch, **measure(inputs, ref, timer, copy_bw, launch)})
        except Exception as exc:  # noqa: BLE001 - e.g. triton's OutOfResources
            rows.append({"scenario": sc.name, "launch": launch, "ok": None, "error": str(exc)[:200]})
    return sorted(rows, key=lambda r: -r.get("bw_fraction", 0.0))


def sweep_settings(smoke: bool) -> list[dict]:
    if smoke:
        return [{"tile_n": 16, "num_warps": 2}, {"tile_n": 32, "num_stages": 1}]
    return [{"tile_n": t, "num_warps": w, "num_stages": st}
            for t in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def check_and_time_write(num_tokens: int, shape: Shape, device: str, timer,
                         copy_bw: float, gen: torch.Generator) -> dict:
    """write_kv_cache against the reference (with padding slots), then its time."""
    from portcullis.kernels.reference import write_kv_cache_reference
    from portcullis.kernels.triton_attention import write_kv_cache_triton

    num_blocks = 2 * num_tokens // shape.block_size + 8
    kv = (num_tokens, shape.kv_heads, shape.head_dim)
    cache = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    key, value = (torch.randn(*kv, generator=gen).to(device, shape.dtype) for _ in range(2))
    kc, vc = (torch.randn(*cache, generator=gen).to(device, shape.dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * shape.block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slots = slots.to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    write_kv_cache_triton(key, value, kc, vc, slots)
    ok = torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    ms = timer(lambda: write_kv_cache_triton(key, value, kc, vc, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # read new rows, write cache rows
    return {"scenario": f"write_kv_cache {num_tokens} tok", "tokens": num_tokens, "ms": ms,
            "ok": ok, "gb_per_s": moved / (ms * 1e-3) / 1e9,
            "bw_fraction": moved / (ms * 1e-3) / copy_bw}


def _triton_version() -> str:
    import triton

    return triton.__version__


def print_table(result: dict) -> None:
    """The short summary, printed last (the sweep's five fastest settings first)."""
    for r in result["sweep"][:5]:
        timing = f"{r['ms']:.3f} ms, {r['bw_fraction']:.0%} of copy" if "ms" in r else r.get("error", "")
        print(f"sweep {r['scenario']} {r['launch']}: {timing}")
    print(f"\n{result['device']} | copy bandwidth {result['copy_gb_per_s']:.0f} GB/s")
    print(f"{'scenario':<28} {'ms':>8} {'GB/s':>7} {'of copy':>8} {'TFLOP/s':>8} "
          f"{'rel err':>8} {'ok':>3}")
    for r in result["attention"] + result["write"]:
        print(f"{r['scenario']:<28} {r['ms']:>8.3f} {r['gb_per_s']:>7.0f} "
              f"{r['bw_fraction']:>7.0%} {r.get('tflops', 0.0):>8.1f} "
              f"{r.get('rel_err', 0.0):>8.1e} {'yes' if r['ok'] else 'NO':>3}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("kernels_gpu.json"))
    parser.add_argument("--sweep", action="store_true",
                        help="also time tile_n x num_warps x num_stages settings on the decode target")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU through TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels.triton_attention is imported
        device, shape, copy_bytes = "cpu", Shape(q_heads=4, kv_heads=2, head_dim=64), 1 << 24
    elif torch.cuda.is_available():
        device, shape, copy_bytes = "cuda", Shape(), 1 << 31
    else:
        print("no CUDA device: run with --smoke to check the script on a CPU")
        return 2
    gen = torch.Generator().manual_seed(0)
    timer = make_timer(device)
    started = time.perf_counter()
    copy_bw = copy_bandwidth(device, timer, copy_bytes)
    scenarios = smoke_scenarios(gen) if args.smoke else full_scenarios(gen)
    attention = []
    for sc in scenarios:
        attention.append(check_and_time_attention(sc, shape, device, timer, copy_bw, gen))
        print(json.dumps(attention[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    writes = [check_and_time_write(n, shape, device, timer, copy_bw, gen)
              for n in ((16, 64) if args.smoke else (256, 8192))]
    sweep = []
    if args.sweep:
        target = next(sc for sc in scenarios if sc.bandwidth_target is not None)
        sweep = sweep_launch_settings(target, shape, device, timer, copy_bw, gen, sweep_settings(args.smoke))
        print(json.dumps(sweep[:3]), flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": _triton_version(), "shape": {**asdict(shape), "dtype": str(shape.dtype)},
        "copy_gb_per_s": copy_bw / 1e9, "attention": attention, "write": writes, "sweep": sweep,
        "seconds": time.perf_counter() - started,
    }
    args.json.write_text(json.dumps(result, indent=2))
    print_table(result)
    # A setting that launched must be correct too; one that could not launch is not a failure.
    return 0 if all(r["ok"] for r in attention + writes) and all(r["ok"] is not False for r in sweep) else 1


if __name__ == "__main__":
    sys.exit(main())
