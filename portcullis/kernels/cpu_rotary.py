"""Rotary position embedding on CPUs: the compiled kernel ``cpu_ext/rotary.cpp`` and its
loader. Bit for bit PyTorch's ``x * cos + roll(x, half) * signed_sin``; one call for a layer's
queries and keys. :func:`native_library` is None without a compiler (callers keep PyTorch's ops)."""

from __future__ import annotations

import ctypes

import torch

from portcullis.kernels.native_build import NativeKernel


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.portcullis_rotary.restype = ctypes.c_int
    lib.portcullis_rotary.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, p, p]


# Products and sums round apart, as PyTorch's ops do: no fused multiply-add.
_KERNEL = NativeKernel("rotary.cpp", "CPU rotary embedding", _declare, ("-ffp-contract=off",))
native_library = _KERNEL.library
reset = _KERNEL.reset


def _heads_view(t: torch.Tensor) -> bool:
    """float32 ``[rows, heads, D]`` with each row's heads packed (rows may sit apart)."""
    return t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rotate(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``q`` and ``k`` rotated at ``positions`` (int64, each a row of ``cos``: the caller checks),
    as new contiguous tensors; None (nothing done) where the tensors do not suit."""
    fits = (_heads_view(q) and _heads_view(k) and q.shape[2] == k.shape[2] == cos.shape[1]
            and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous() and len(positions) == len(q) == len(k))
    if not fits:
        return None
    q_out, k_out = torch.empty(q.shape), torch.empty(k.shape)
    status = lib.portcullis_rotary(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                                   len(q), q.shape[2], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                   q_out.data_ptr(), k_out.data_ptr())
    return None if status else (q_out, k_out)
