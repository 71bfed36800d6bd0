"""Matrix products with GGUF-quantized weights on CPUs (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), as
stored: the compiled kernel ``cpu_ext/quant_matmul.cpp`` and its loader.

Weights stay in GGUF's blocks (uint8 ``[N, row bytes]``, one row per output feature), so a
decode step reads 0.56-1.06 bytes per weight (Q4_0 to Q8_0) instead of float32's 4. Each block
is dequantized in registers, bit for bit as gguf's dequantize does, and multiplied with float32
activations: the result is the dequantized weights' product up to the order of the sums. Under
8 rows each block is decoded inside the product (decode); from 8 rows a panel of weight rows is
dequantized once and an outer-product GEMM runs over it (batched decode, prefill). Measured
against oneDNN float32 on packed float weights (benchmarks/quant_matmul_cpu.py,
benchmarks/README.md): 1.4-2.4x at one row, where reading weights is the cost, about even at 256.

Opt-in, llama.cpp's arithmetic (``--gguf-activations int8``): Q8_0, Q4_0 and Q4_1 weights reordered
at load (:func:`repack_int8`, the ``*_I8`` kinds) and multiplied with activations rounded to int8 per
block of 32, in exact integer sums (AVX-512 VNNI, AVX2, or plain C++): 2-4x the float kernel.

A decoder layer's projections also come fused with what surrounds them (:func:`norm_matmul`,
:func:`matmul_add`): one parallel region and one call instead of a handful of small PyTorch ops,
which at one row cost as much as the product itself.

``native_build`` compiles the kernel on first use per instruction set; :func:`native_library`
is None without a compiler (callers then dequantize at load, as for GPUs).
``kernels.reference`` holds the exact reference the tests compare against.
"""

from __future__ import annotations

import ctypes

import torch

from portcullis.kernels.native_build import NativeKernel

KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
# Q8_0, Q4_0 and Q4_1 repacked for int8 activations (repack_int8): the same bytes, reordered.
INT8_KINDS = {"Q8_0_I8": 6, "Q4_0_I8": 7, "Q4_1_I8": 8}
BLOCK = 32
# Weights and bytes per block: K-quants come in super-blocks of 256.
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
for _name in INT8_KINDS:
    BLOCK_WEIGHTS[_name], BLOCK_BYTES[_name] = BLOCK_WEIGHTS[_name[:4]], BLOCK_BYTES[_name[:4]]
    KINDS[_name] = INT8_KINDS[_name]
ISA_NAMES = {2: "AVX-512", 1: "AVX2", 0: "scalar"}


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.portcullis_quant_isa.restype = i32
    lib.portcullis_quant_isa.argtypes = []
    lib.portcullis_quant_matmul.restype = i32
    lib.portcullis_quant_matmul.argtypes = [p, i64, i64, i64, p, i32, i64, p, i64, i32]
    lib.portcullis_quant_norm_matmul.restype = i32
    lib.portcullis_quant_norm_matmul.argtypes = [p, i64, i64, i64, p, ctypes.c_float, p, p, i32, i64, p, i64, i32]
    lib.portcullis_quant_matmul_add.restype = i32
    lib.portcullis_quant_matmul_add.argtypes = [p, i64, i64, i64, p, i32, i64, p, i64, p, i64, i32]
    lib.portcullis_dequantize_rows.restype = i32
    lib.portcullis_dequantize_rows.argtypes = [p, i32, i64, p, i64, i64, p, i64, i32]
    lib.portcullis_quant_repack_int8.restype = i32
    lib.portcullis_quant_repack_int8.argtypes = [p, i32, i64, i64, p, i32]


# No contraction of a * b + c into one rounding: dequantized weights equal gguf's bit for bit.
_KERNEL = NativeKernel("quant_matmul.cpp", "CPU quantized matmul", _declare, ("-ffp-contract=off",))
native_library = _KERNEL.library
reset = _KERNEL.reset


def isa_name(lib: ctypes.CDLL) -> str:
    """Which integer-dot code a build runs."""
    return ISA_NAMES[lib.portcullis_quant_isa()]


def in_features(blocks: torch.Tensor, kind: str) -> int:
    return blocks.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]


def row_bytes(in_features: int, kind: str) -> int:
    """Bytes of one row of `in_features` weights stored as `kind`."""
    return in_features // BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind]


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"native {what} refused its arguments (status {status})")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def quant_matmul(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """``x @ W^T`` (float32 ``[M, N]``) for float ``x`` ``[M, K]`` and W as GGUF blocks of
    ``kind``, uint8 ``[N, row_bytes(K, kind)]`` and contiguous."""
    x = _rows(x)
    m, k = x.shape
    n = blocks.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    _check(lib.portcullis_quant_matmul(x.data_ptr(), x.stride(0), m, k, blocks.data_ptr(), KINDS[kind], n,
                                       out.data_ptr(), n, torch.get_num_threads()), "quantized matmul")
    return out


def norm_matmul(lib: ctypes.CDLL, x: torch.Tensor, gamma: torch.Tensor, eps: float, blocks: torch.Tensor,
                kind: str) -> torch.Tensor:
    """``rms_norm(x) * gamma @ W^T`` (float32 ``[M, N]``) for float32 rows ``x`` ``[M, K]``: Hugging
    Face's RMSNorm in float32 (its sum of squares in another order), then the product."""
    x = _rows(x)
    m, k = x.shape
    n = blocks.shape[0]
    if gamma.shape != (k,) or gamma.dtype != torch.float32 or not gamma.is_contiguous():
        raise ValueError(f"norm weight {tuple(gamma.shape)} {gamma.dtype}: expected float32 ({k},), contiguous")
    normed, out = torch.empty(m, k, dtype=torch.float32), torch.empty(m, n, dtype=torch.float32)
    _check(lib.portcullis_quant_norm_matmul(x.data_ptr(), x.stride(0), m, k, gamma.data_ptr(), eps,
                                            normed.data_ptr(), blocks.data_ptr(), KINDS[kind], n, out.data_ptr(),
                                            n, torch.get_num_threads()), "normed matmul")
    return out


def matmul_add(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, kind: str,
               residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ W^T`` (a new float32 ``[M, N]``) for float32 ``x`` ``[M, K]`` and
    ``residual`` ``[M, N]``, each rounded as PyTorch's ``residual + (x @ W^T)``."""
    x, residual = _rows(x), _rows(residual)
    m, k = x.shape
    n = blocks.shape[0]
    if residual.shape != (m, n):
        raise ValueError(f"residual {tuple(residual.shape)}: expected ({m}, {n})")
    out = torch.empty(m, n, dtype=torch.float32)
    _check(lib.portcullis_quant_matmul_add(x.data_ptr(), x.stride(0), m, k, blocks.data_ptr(), KINDS[kind], n,
                                           residual.data_ptr(), residual.stride(0), out.data_ptr(), n,
                                           torch.get_num_threads()), "matmul and add")
    return out


def dequantize_rows(lib: ctypes.CDLL, blocks: torch.Tensor, kind: str, ids: torch.Tensor | None = None,
                    first: int = 0, count: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (int64), else ``first .. first + count - 1``, of W as float32 ``[rows, K]``."""
    k = in_features(blocks, kind)
    rows = len(ids) if ids is not None else (blocks.shape[0] - first if count is None else count)
    out = torch.empty(rows, k, dtype=torch.float32) if out is None else out
    ids = None if ids is None else ids.to(torch.int64).contiguous()
    _check(lib.portcullis_dequantize_rows(blocks.data_ptr(), KINDS[kind], k,
                                          None if ids is None else ids.data_ptr(), first, rows,
                                          out.data_ptr(), out.stride(0), torch.get_num_threads()),
           "dequantize")
    return out


def repack_int8(lib: ctypes.CDLL, blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, str] | None:
    """W's blocks reordered for the int8-activation kernel (llama.cpp's arithmetic: each
    activation row rounded to int8 per block of 32, exact integer sums): a new tensor of the same
    shape and its kind (``Q4_1`` -> ``Q4_1_I8``), or None where W cannot be (another kind, or rows
    not a multiple of 16)."""
    if kind + "_I8" not in INT8_KINDS or blocks.shape[0] % 16:
        return None
    out = torch.empty_like(blocks)
    code = lib.portcullis_quant_repack_int8(blocks.data_ptr(), KINDS[kind], blocks.shape[0],
                                            in_features(blocks, kind), out.data_ptr(), torch.get_num_threads())
    return (out, kind + "_I8") if code >= 0 else None
