"""This machine's CPU as Linux describes it (`/proc/cpuinfo`), read in one place: by the engine
(whether bf16 may pay), the kernels (which native build fits this CPU) and the benchmarks (the
CPU their figures were measured on). Standard library only, so every part may import it."""
from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def first_cpu(cpuinfo: Path = CPUINFO) -> dict[str, str] | None:
    """The first processor's fields (keys lower-cased); None where there is no such file (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:
            break  # a blank line ends the first processor
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...] | None:
    """The CPU's feature flags (`flags` on x86, `Features` on Arm); None where the file does not say."""
    fields = first_cpu(cpuinfo)
    if fields is None:
        return None
    line = fields.get("flags", fields.get("features"))
    return None if line is None else tuple(line.split())


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's name with its family and model numbers and its widest vector instructions, to
    quote beside measured figures (a VM may name an AMD EPYC without its generation: family 25
    is Zen 3/4, 26 Zen 5; and the same name comes with or without AVX-512)."""
    fields = first_cpu(cpuinfo) or {}
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" not in fields:
        return name
    return f"{name} (family {fields['cpu family']} model {fields.get('model', '?')}, {vector_isa(cpuinfo)})"


def vector_isa(cpuinfo: Path = CPUINFO) -> str:
    """AMX, AVX-512, AVX2 or "no AVX2": what decides which kernels run fastest here."""
    flags = set(cpu_flags(cpuinfo) or ())
    for flag, isa in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return isa
    return "no AVX2"
