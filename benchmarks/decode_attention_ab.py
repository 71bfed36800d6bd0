"""The native decode attention (kernels/cpu_ext/decode_attention.cpp) of a git revision against
the working tree's, built for one instruction set, on SmolLM2-135M's decode shapes (9 query heads,
3 KV heads, head size 64, 30 layers, 320 keys per sequence): a step's 30 layers of attention at 16
and 64 sequences, float32 and bf16 caches. Each layer has its own caches, so K/V come from
memory as in a step; the builds alternate `--rounds` times and the medians are reported.

    python benchmarks/decode_attention_ab.py --before REV [--isa x86-64-v3] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import median_ms  # noqa: E402 (benchmarks/, this script's folder)

from portcullis.host import cpu_model  # noqa: E402
from portcullis.kernels import cpu_decode, native_build  # noqa: E402

SOURCE = "portcullis/kernels/cpu_ext/decode_attention.cpp"
LAYERS, KEYS, BLOCK = 30, 320, 16


def build(source: str, isa: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".cpp")
    src.write_text(source)
    subprocess.run(["g++", *native_build.compile_flags(isa), str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    cpu_decode._declare(lib)
    return lib


def step_ms(lib: ctypes.CDLL, seqs: int, dtype: torch.dtype, repeats: int = 9) -> float:
    per_seq = (KEYS + BLOCK - 1) // BLOCK
    g = torch.Generator().manual_seed(0)
    tables = torch.stack([torch.randperm(per_seq, generator=g) + i * per_seq for i in range(seqs)]).int()
    lens = torch.full((seqs,), KEYS, dtype=torch.int32)
    index = torch.arange(seqs)
    q, out = torch.randn(seqs, 9, 64, generator=g), torch.empty(seqs, 9, 64)
    caches = [tuple(torch.randn(seqs * per_seq, BLOCK, 3, 64, generator=g).to(dtype) for _ in range(2))
              for _ in range(LAYERS)]

    def step() -> None:
        for k, v in caches:
            cpu_decode.decode_attention(lib, q, k, v, (tables, lens), (index, index), 0.125, None, out)

    step()
    return median_ms(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--isa", default="x86-64-v3", choices=list(native_build.ISA_FLAGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    before = subprocess.run(["git", "show", f"{args.before}:{SOURCE}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": build(before, args.isa, Path(tmp) / "before.so"),
                "after": build((ROOT / SOURCE).read_text(), args.isa, Path(tmp) / "after.so")}
        runs: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for seqs in (16, 64):
                for dtype in (torch.float32, torch.bfloat16):
                    for name, lib in libs.items():
                        key = f"{name} {seqs} seqs {str(dtype).removeprefix('torch.')}"
                        runs.setdefault(key, []).append(step_ms(lib, seqs, dtype))
    med = {key: round(statistics.median(v), 2) for key, v in runs.items()}
    for key in med:
        if key.startswith("before"):
            after = key.replace("before", "after", 1)
            print(f"{key.removeprefix('before ')}: {med[key]:.2f} -> {med[after]:.2f} ms a step "
                  f"({med[key] / med[after]:.2f}x)")
    report = {"cpu": cpu_model(), "isa": args.isa, "before": args.before, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "ms_per_step_30_layers": med, "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
