"""Building and loading the C++ kernels of ``cpu_ext/``: one build per source, instruction set,
compiler and CPU, made on first use and kept in the user's cache folder.

The kernels have no PyTorch headers, so each compiles in seconds with the system's C++
compiler, into ``$XDG_CACHE_HOME/portcullis/kernels`` (else ``~/.cache/...``;
``PORTCULLIS_CACHE_DIR`` overrides), under a name that carries the kernel, the instruction set
it was built for and a hash of the source, the flags, the compiler and the CPU's features
(``-march=native``: a cache folder shared by different CPUs keeps one build each).

The instruction set is ``native`` (the default: AVX-512 where the CPU has it) or
``x86-64-v3`` (AVX2 and FMA, as on an AMD Zen 3); ``PORTCULLIS_CPU_ISA`` or the argument of
:meth:`NativeKernel.library` picks one. The tests load both on every x86 machine, so that the
AVX2 code is checked where AVX-512 would otherwise hide it.

Without a compiler, when the build fails, or with ``PORTCULLIS_NATIVE_KERNELS=0``, a kernel's
:meth:`NativeKernel.library` is None and its callers keep their PyTorch path; which one runs is
logged once per process and kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from portcullis import envs
from portcullis.host import cpu_flags

log = logging.getLogger("kernels")

SOURCES = Path(__file__).with_name("cpu_ext")
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
ISA_FLAGS = {"native": "-march=native", "x86-64-v3": "-march=x86-64-v3"}
# What a build for another CPU needs of this one (its flags, as Linux names them): without it, SIGILL.
ISA_NEEDS = {"x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")}
ISA_ENV = envs.CPU_ISA.name
# Wall time: a build takes about 9 s of CPU, but on a loaded machine (load 5.5 on 2 cores) one
# took 150 s, and a timeout leaves the process on the slow path.
BUILD_TIMEOUT_S = 600


def cache_dir() -> Path:
    """Where compiled kernels are kept between processes."""
    return envs.cache_root() / "kernels"


def _cpu_features() -> str:
    """The CPU's feature flags: a build for one CPU must not load on another."""
    flags = cpu_flags()
    return " ".join(flags) if flags is not None else platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cpu_supports(isa: str) -> bool:
    """Whether this CPU runs code built for ``isa``."""
    have = set(_cpu_features().split())
    return all(flag in have for flag in ISA_NEEDS.get(isa, ()))


def compile_flags(isa: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (*FLAGS, *extra, ISA_FLAGS[isa])


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _why_not(isa: str) -> str | None:
    """Why the PyTorch path runs instead of a kernel built for ``isa``; None: build or load it."""
    if not envs.NATIVE_KERNELS.flag(True):
        return f"{envs.NATIVE_KERNELS.name}=0"
    if not cpu_supports(isa):
        return f"this CPU cannot run {isa} code; {ISA_ENV}=native builds for it"
    if _compiler() is None:
        return "no C++ compiler found; set CXX to use one"
    return None


class NativeKernel:
    """One C++ source of ``cpu_ext/``, built per instruction set on first use and loaded with
    ctypes; ``declare`` sets the argument types of its entry points once it is loaded."""

    def __init__(self, source: str, label: str, declare: Callable[[ctypes.CDLL], None],
                 flags: tuple[str, ...] = ()):
        self.source = SOURCES / source
        self.flags = flags  # this source's own, before the instruction set's
        self.label = label  # what the log calls it
        self._declare = declare
        self._lock = threading.Lock()
        self._loaded: dict[str, ctypes.CDLL | None] = {}  # per instruction set, once decided

    def library_path(self, compiler: str, isa: str = "native") -> Path:
        """The cached build for this source, instruction set, compiler and CPU."""
        digest = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(compile_flags(isa, self.flags)).encode(),
                     compiler.encode(), _cpu_features().encode()):
            digest.update(part)
        return cache_dir() / f"{self.source.stem}-{isa}-{digest.hexdigest()[:16]}.so"

    def library(self, isa: str | None = None) -> ctypes.CDLL | None:
        """The kernel compiled for ``isa`` (default: ``$PORTCULLIS_CPU_ISA``, else native), built
        on first use; None means: use the PyTorch path."""
        isa = isa or envs.CPU_ISA.get() or "native"
        if isa in self._loaded:  # the common case, once per layer and step: no lock
            return self._loaded[isa]
        if isa not in ISA_FLAGS:  # a typo must not quietly run another kernel than was asked for
            raise ValueError(f"CPU instruction set {isa!r} (argument or {ISA_ENV}): expected one of "
                             f"{', '.join(ISA_FLAGS)}")
        with self._lock:
            if isa not in self._loaded:
                self._loaded[isa] = self._load(isa)
            return self._loaded[isa]

    def reset(self) -> None:
        """Forget what was loaded (tests switch compilers and environment variables)."""
        with self._lock:
            self._loaded.clear()

    def _load(self, isa: str) -> ctypes.CDLL | None:
        reason = _why_not(isa)
        if reason:
            log.info("%s: PyTorch path (%s)", self.label, reason)
            return None
        compiler = _compiler()
        try:
            target = self.library_path(compiler, isa)  # reads the source: an install may lack it
            if not target.exists():
                log.info("%s: compiling %s for %s once into %s", self.label, self.source.name, isa,
                         target.parent)
                _build(compiler, compile_flags(isa, self.flags), self.source, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("%s: PyTorch path (building the native kernel failed: %s)", self.label,
                        detail.strip()[-500:])
            return None
        self._declare(lib)
        log.info("%s: native kernel (%s)", self.label, target.name)
        return lib
