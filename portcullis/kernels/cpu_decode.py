"""Decode attention on CPUs read in place from the paged cache: the compiled kernel and its loader.

``cpu_ext/decode_attention.cpp`` reads each decoding sequence's K and V blocks once, through
its block table, with no gathered copy (the PyTorch path copies every context each step). It
has no PyTorch headers; ``native_build`` compiles it on first use, once per machine and
instruction set (``native``, with AVX-512 and AVX512-BF16 where the CPU has them, or
``x86-64-v3``), into the user's cache folder. Without a compiler, or with
``PORTCULLIS_NATIVE_KERNELS=0``, :func:`native_library` is None and callers keep the PyTorch path.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

from portcullis.kernels.native_build import (  # noqa: F401  (the loader's names, as before)
    ISA_ENV,
    ISA_FLAGS,
    NativeKernel,
    cache_dir,
    cpu_supports,
)

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # compiled in (the kernel unrolls its loops over the head)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = lib.portcullis_decode_attention
    fn.restype = i32
    fn.argtypes = [p, i64, p, p, i32, p, i64, p, p, p, p, i64, i32, i32, i32, i32,
                   ctypes.c_float, i32, p, i64, i32]
    lib.portcullis_write_kv_cache.restype = i32
    lib.portcullis_write_kv_cache.argtypes = [p, i64, p, i64, i64, i64, p, i64, p, p, i32]


_KERNEL = NativeKernel("decode_attention.cpp", "CPU decode attention", _declare)
native_library = _KERNEL.library
reset = _KERNEL.reset


HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on 2 MiB pages where the OS allows (Linux transparent huge pages).

    For KV caches: decode attention reads each sequence's blocks from wherever they sit, and
    on 4 KiB pages most blocks cost a TLB miss on top of the memory access (on an AMD EPYC,
    decode attention over a 67 MB cache ran about 15% faster with the cache on 2 MiB pages).
    The tensor owns an anonymous mapping, aligned to 2 MiB and advised MADV_HUGEPAGE before
    its first touch; elsewhere, or for tensors under 2 MiB, it is plain ``torch.zeros``.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which huge pages skip.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[start:start + nbytes].view(dtype).view(shape)
    return tensor.zero_()  # commit the pages now, as torch.zeros would


def usable(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether these tensors suit the kernel (float32 or bf16 CPU caches, contiguous)."""
    return (query.device.type == "cpu" and key_cache.dtype in CACHE_DTYPES
            and key_cache.shape[3] in HEAD_DIMS
            and value_cache.dtype == key_cache.dtype and key_cache.is_contiguous()
            and value_cache.is_contiguous() and key_cache.shape == value_cache.shape)


def write_kv_cache(lib: ctypes.CDLL, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """Copy float32 K/V rows ``[tokens, kv_heads, head_dim]`` into float32 or bf16 caches at
    ``slots`` (int64, -1 skipped; bf16 rounded as ``.to(torch.bfloat16)``) and return True, or
    return False where the tensors do not suit (nothing written)."""
    fits = (key.dtype == value.dtype == torch.float32 and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in CACHE_DTYPES
            and key.shape[1:] == value.shape[1:] == key_cache.shape[2:] and len(key) == len(value) == len(slots)
            and slots.dtype == torch.int64 and slots.is_contiguous() and key_cache.is_contiguous()
            and value_cache.is_contiguous() and _rows_view(key) and _rows_view(value))
    if fits and lib.portcullis_write_kv_cache(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), len(slots),
            key_cache.shape[2] * key_cache.shape[3], slots.data_ptr(), key_cache.shape[0] * key_cache.shape[1],
            key_cache.data_ptr(), value_cache.data_ptr(), CACHE_DTYPES[key_cache.dtype]):
        raise IndexError(f"a K/V slot is past the cache's {key_cache.shape[0] * key_cache.shape[1]} slots")
    return fits


def _rows_view(t: torch.Tensor) -> bool:
    """float32 with each row's heads and dims contiguous: the kernel reads it in place."""
    return t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    decodes: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    window: int | None,
    out: torch.Tensor,
    spans: torch.Tensor | None = None,
    written: torch.Tensor | None = None,
) -> None:
    """Write the decode rows of ``out`` (one query row per sequence in ``decodes``, or
    ``spans[i]`` consecutive rows from the i-th: a short query whose row j sees
    context_len - (span - 1 - j) keys, the sequence's context read once for all of them).

    ``tables`` = (block_tables, context_lens), int32 and contiguous; ``decodes`` = (sequence
    index, first query row), int64 and contiguous; ``spans`` int32 and contiguous, and with it
    ``written``, every row the items cover (int64).
    """
    q = query if _rows_view(query) else query.float().contiguous()
    dst = out if _rows_view(out) else torch.empty(out.shape, dtype=torch.float32)
    block_tables, context_lens = tables
    seqs, rows = decodes
    _, block_size, kv_heads, head_dim = key_cache.shape
    status = lib.portcullis_decode_attention(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        CACHE_DTYPES[key_cache.dtype], block_tables.data_ptr(), block_tables.stride(0),
        context_lens.data_ptr(), seqs.data_ptr(), rows.data_ptr(),
        None if spans is None else spans.data_ptr(), len(seqs), query.shape[1],
        kv_heads, head_dim, block_size, scale, window or 0, dst.data_ptr(), dst.stride(0),
        torch.get_num_threads(),
    )
    if status:
        raise ValueError(f"native decode attention refused its arguments (status {status})")
    if dst is not out:
        written = rows if spans is None else written
        out.index_copy_(0, written, dst.index_select(0, written).to(out.dtype))
