"""Decode attention on CPUs read in place from the paged cache: the compiled kernel and its loader.

``cpu_ext/decode_attention.cpp`` reads each decoding sequence's K and V blocks once, through
its block table, with no gathered copy (the PyTorch path copies every context each step). It
has no PyTorch headers, so it compiles in a few seconds with the system's C++ compiler; it is
built on first use, once per machine, into the user's cache folder
(``$XDG_CACHE_HOME/portcullis/kernels``, else ``~/.cache/...``; ``PORTCULLIS_CACHE_DIR``
overrides), under a name that carries the instruction set it was built for and hashes the
source, the flags, the compiler and the CPU's features (``-march=native``: a cache folder
shared by different CPUs keeps one build each).

The instruction set is ``native`` (the default: AVX-512 and AVX512-BF16 where the CPU has
them) or ``x86-64-v3`` (AVX2 and FMA, as on an AMD Zen 3); ``PORTCULLIS_CPU_ISA`` or the
argument of :func:`native_library` picks one. The tests load both on every x86 machine, so
that the AVX2 code is checked where AVX-512 would otherwise hide it.

Without a compiler, when the build fails, or with ``PORTCULLIS_NATIVE_KERNELS=0``, callers
get ``None`` from :func:`native_library` and keep the PyTorch path; which one runs is logged
once per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("kernels")

SOURCE = Path(__file__).with_name("cpu_ext") / "decode_attention.cpp"
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
ISA_FLAGS = {"native": "-march=native", "x86-64-v3": "-march=x86-64-v3"}
# What a build for another CPU needs of this one (/proc/cpuinfo names): without it, SIGILL.
ISA_NEEDS = {"x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")}
ISA_ENV = "PORTCULLIS_CPU_ISA"
# Wall time: the build takes about 9 s of CPU, but on a loaded machine (load 5.5 on 2 cores) it
# took 150 s, and a timeout leaves the process on the slow path.
BUILD_TIMEOUT_S = 600
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # compiled in (the kernel unrolls its loops over the head)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # per instruction set, once its first use decides


def cache_dir() -> Path:
    """Where compiled kernels are kept between processes."""
    override = os.environ.get("PORTCULLIS_CACHE_DIR")
    if override:
        return Path(override) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "portcullis" / "kernels"


def _cpu_features() -> str:
    """The CPU's feature flags: a build for one CPU must not load on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cpu_supports(isa: str) -> bool:
    """Whether this CPU runs code built for ``isa``."""
    have = set(_cpu_features().split())
    return all(flag in have for flag in ISA_NEEDS.get(isa, ()))


def compile_flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, ISA_FLAGS[isa])


def library_path(compiler: str, isa: str = "native") -> Path:
    """The cached build for this source, instruction set, compiler and CPU."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(compile_flags(isa)).encode(), compiler.encode(),
                 _cpu_features().encode()):
        digest.update(part)
    return cache_dir() / f"decode_attention-{isa}-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, isa: str, target: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *compile_flags(isa), str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _why_not(isa: str) -> str | None:
    """Why the PyTorch path runs instead of the kernel for ``isa``; None: build or load it."""
    if os.environ.get("PORTCULLIS_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "PORTCULLIS_NATIVE_KERNELS=0"
    if not cpu_supports(isa):
        return f"this CPU cannot run {isa} code; {ISA_ENV}=native builds for it"
    if _compiler() is None:
        return "no C++ compiler found; set CXX to use one"
    return None


def _load(isa: str) -> ctypes.CDLL | None:
    reason = _why_not(isa)
    if reason:
        log.info("CPU decode attention: PyTorch path (%s)", reason)
        return None
    compiler = _compiler()
    try:
        target = library_path(compiler, isa)  # reads the source: an install may lack it
        if not target.exists():
            log.info("CPU decode attention: compiling %s for %s once into %s", SOURCE.name, isa,
                     target.parent)
            _build(compiler, isa, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU decode attention: PyTorch path (building the native kernel failed: %s)",
                    detail.strip()[-500:])
        return None
    _declare(lib.portcullis_decode_attention)
    log.info("CPU decode attention: native kernel (%s)", target.name)
    return lib


def _declare(fn) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.restype = i32
    fn.argtypes = [p, i64, p, p, i32, p, i64, p, p, p, p, i64, i32, i32, i32, i32,
                   ctypes.c_float, i32, p, i64, i32]


def native_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel compiled for ``isa`` (default: ``$PORTCULLIS_CPU_ISA``, else native), built
    on first use; None means: use the PyTorch path."""
    isa = isa or os.environ.get(ISA_ENV, "").strip() or "native"
    if isa in _loaded:  # the common case, once per layer and step: no lock
        return _loaded[isa]
    if isa not in ISA_FLAGS:  # a typo must not quietly run another kernel than was asked for
        raise ValueError(f"CPU instruction set {isa!r} (argument or {ISA_ENV}): expected one of "
                         f"{', '.join(ISA_FLAGS)}")
    with _lock:
        if isa not in _loaded:
            _loaded[isa] = _load(isa)
        return _loaded[isa]


def reset() -> None:
    """Forget what was loaded (tests switch compilers and environment variables)."""
    with _lock:
        _loaded.clear()


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
