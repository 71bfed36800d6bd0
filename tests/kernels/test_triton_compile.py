"""The Triton kernels compile for real GPUs, checked without one.

The interpreter runs kernels as Python and so misses what only the compiler rejects (loop
variables that change type, unsupported dot shapes, shared memory). Triton can compile ahead
of time for a named target with its bundled ptxas, so each case here builds a cubin for a
Hopper or Ampere GPU in a child process (the test process has TRITON_INTERPRET set).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this Triton build bundles no ptxas", allow_module_level=True)

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import portcullis.kernels.triton_attention as T

INT_POINTERS = {"cu_seqlens_ptr": "*i32", "context_lens_ptr": "*i32",
                "block_tables_ptr": "*i32", "slot_ptr": "*i64"}


def build(fn, dtype, constexprs, arch):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = INT_POINTERS.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name in ("scale_log2", "softcap_log2") else "i32"
    src = ASTSource(fn, signature, constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    assert kernel.asm["cubin"], "no cubin"
    return kernel


def attention(dtype, group, head_dim, max_query_len, window, arch, softcap=False):
    group_pad, dim_pad = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    size = {"fp32": 4}.get(dtype, 2)
    block_q, tile_n = T._tile_sizes(max_query_len, group_pad, dim_pad, size)
    kernel = build(T._paged_attention_kernel, dtype, dict(
        GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, DIM_PAD=dim_pad,
        BLOCK_Q=block_q, TILE_N=tile_n, USE_WINDOW=window,
        PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_FP32=False,
        USE_SOFTCAP=softcap), arch)
    limit = {90: 227 * 1024, 80: 163 * 1024}[arch]
    assert kernel.metadata.shared <= limit, ("shared memory", kernel.metadata.shared)


attention("bf16", 4, 128, 1, False, 90)       # decode, Llama-3-8B-like heads
attention("bf16", 4, 128, 2048, True, 90)     # prefill tiles with a sliding window
attention("fp16", 7, 64, 1, False, 80)        # Qwen2.5-0.5B-like group on Ampere
attention("fp32", 2, 80, 512, False, 80)      # float32 and a padded head dim
attention("bf16", 2, 256, 2048, True, 90, softcap=True)  # Gemma-2-like: soft-capped, wide heads
build(T._write_kv_cache_kernel, "bf16", dict(NUM_HEADS=8, HEAD_DIM=128, HEADS_PAD=8,
                                             DIM_PAD=128), 90)
print("compiled")
"""


def test_kernels_compile_for_hopper_and_ampere(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile afresh each run
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                          cwd=repo, env=env, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr
