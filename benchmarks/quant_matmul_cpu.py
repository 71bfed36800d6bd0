"""The quantized-weight matmul (kernels/cpu_quant.py) against oneDNN float32 with packed weights
(the engine's `pack_linear_weights` path) on SmolLM2-135M's shapes, and decode ms/token at
batch 1 for SmolLM2's Q4_1 GGUF through the engine, quantized (float32 activations, and int8
activations: `--gguf-activations int8`) against dequantized float32.

Kernel table: each (shape, rows) cell alternates the kernel, the alternative
of dequantizing 256-row tiles of W for a float32 GEMM, and oneDNN float32 on packed weights,
`--repeats` times in the same run, and reports medians; the ratio is float32 over the kernel. Decode: one engine per path, alternated `--rounds` times,
greedy, `--tokens` tokens after a short prompt; ms/token is (time of all tokens - time to the
first) / (tokens - 1). Quote ratios with the CPU model the JSON records.

    python benchmarks/quant_matmul_cpu.py [--repeats 21] [--threads N] [--rounds 3]
                                          [--kernel-only | --decode-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median_ms  # noqa: E402 (benchmarks/, this script's folder)

from portcullis.host import cpu_model  # noqa: E402
from portcullis.kernels import cpu_quant  # noqa: E402

# (in_features, out_features): q/o, k/v, gate/up, down, the tied head (SmolLM2-135M)
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
ROWS = (1, 4, 16, 64, 256)
# The file's types: every projection Q4_1, the tied embedding and head Q8_0.
KIND_OF = {(576, 49152): "Q8_0"}


def random_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    size = cpu_quant.BLOCK_BYTES[kind]
    b = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8)
    halves = 2 if kind == "Q4_1" else 1
    b[..., :2 * halves] = (torch.rand(n, k // 32, halves) * 0.02).half().view(torch.uint8)
    return b.reshape(n, -1)




def kernel_table(repeats: int) -> list[dict]:
    lib = cpu_quant.native_library()
    if lib is None:
        raise SystemExit("the quantized kernel did not build here (see the log)")
    rows_out = []
    for k, n in SHAPES:
        kind = KIND_OF.get((k, n), "Q4_1")
        blocks = random_blocks(kind, n, k)
        weight = cpu_quant.dequantize_rows(lib, blocks, kind)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        int8_blocks, int8_kind = cpu_quant.repack_int8(lib, blocks, kind)
        for m in ROWS:
            x = torch.randn(m, k)

            def quantized(x=x, blocks=blocks, kind=kind):
                return cpu_quant.quant_matmul(lib, x, blocks, kind)

            def int8(x=x, blocks=int8_blocks, kind=int8_kind):
                """--gguf-activations int8: activations rounded to int8 per block, integer sums."""
                return cpu_quant.quant_matmul(lib, x, blocks, kind)

            def tiles(x=x, blocks=blocks, kind=kind, tile=256):
                """The alternative for many rows: dequantize tiles of W, float32 GEMM on each."""
                out = torch.empty(x.shape[0], blocks.shape[0])
                for first in range(0, blocks.shape[0], tile):
                    rows = min(tile, blocks.shape[0] - first)
                    w = cpu_quant.dequantize_rows(lib, blocks, kind, first=first, count=rows)
                    torch.matmul(x, w.t(), out=out[:, first:first + rows])
                return out

            def dense(x=x, packed=packed):
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            paths = (("quantized", quantized), ("int8", int8), ("tiles", tiles), ("float32", dense))
            times: dict[str, list[float]] = {name: [] for name, _ in paths}
            for _, fn in paths:
                fn()  # warm
            for _ in range(repeats):  # alternated: all see the same machine load
                for name, fn in paths:
                    times[name].append(median_ms(fn, 1))
            med = {name: statistics.median(v) for name, v in times.items()}
            used = "quantized"
            rows_out.append({"in": k, "out": n, "kind": kind, "rows": m, "path": used,
                             **{f"{name}_ms": round(v, 4) for name, v in med.items()},
                             "float32_over_quant": round(med["float32"] / med[used], 2),
                             "quant_over_int8": round(med["quantized"] / med["int8"], 2)})
            print(f"{k:>5}x{n:<6} {kind} M={m:<4} quantized {med['quantized']:8.3f} ms  int8 {med['int8']:8.3f} ms  "
                  f"dequantized tiles {med['tiles']:8.3f} ms  float32 {med['float32']:8.3f} ms  float32/{used} "
                  f"{med['float32'] / med[used]:5.2f}x  quantized/int8 {med['quantized'] / med['int8']:5.2f}x",
                  flush=True)
    return rows_out


PROMPT = "Write a short poem about the sea."


def decode_ms_per_token(llm, tokens: int) -> float:
    from portcullis.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    first = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    one = time.perf_counter() - first
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    total = time.perf_counter() - start
    return (total - one) / (tokens - 1) * 1e3


def prefill_ms(llm, prompt_tokens: int = 256) -> float:
    """Time to the first token of a `prompt_tokens`-token prompt (one prefill and the head)."""
    from portcullis.engine.sampling_params import SamplingParams

    ids = [(17 * i) % 20000 + 100 for i in range(prompt_tokens)]
    start = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def decode_table(rounds: int, tokens: int) -> dict:
    from portcullis.engine.assets import SMOLLM2, cached
    from portcullis.engine.frontend.llm import LLM

    path = cached(SMOLLM2)
    engines = {}
    modes = {"quantized": {}, "int8": {"gguf_activations": "int8"}, "float32": {"gguf_dequantize": True}}
    for name, mode in modes.items():
        engines[name] = LLM(str(path), dtype="float32", enable_prefix_caching=False,
                            kv_cache_memory=256 << 20, **mode)
    results: dict[str, list[float]] = {name: [] for name in engines}
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            results[name].append(decode_ms_per_token(llm, tokens))
            prefills[name].append(prefill_ms(llm))
            print(f"decode {name}: {results[name][-1]:.2f} ms/token, 256-token prefill "
                  f"{prefills[name][-1]:.1f} ms", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    pre = {name: statistics.median(v) for name, v in prefills.items()}
    return {"runs_ms_per_token": results, "median_ms_per_token": med,
            "float32_over_quantized": round(med["float32"] / med["quantized"], 2),
            "quantized_over_int8": round(med["quantized"] / med["int8"], 2),
            "runs_prefill_256_ms": prefills, "median_prefill_256_ms": pre,
            "prefill_float32_over_quantized": round(pre["float32"] / pre["quantized"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kernel-only", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": torch.get_num_threads()}
    lib = cpu_quant.native_library()
    report["kernel_isa"] = cpu_quant.isa_name(lib) if lib else None
    if not args.decode_only:
        report["kernel"] = kernel_table(args.repeats)
    if not args.kernel_only:
        report["decode"] = decode_table(args.rounds, args.tokens)
    print(json.dumps({k: v for k, v in report.items() if k != "kernel"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
