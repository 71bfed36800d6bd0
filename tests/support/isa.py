"""Running the native kernels' build for one instruction set, so that an AVX-512 machine tests the
AVX2 (x86-64-v3) code too, where its own wider paths would hide it."""

from __future__ import annotations

import pytest

from portcullis.kernels import native_build


def use_build(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the kernels load their `isa` build; a CPU that cannot run it skips."""
    if not native_build.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa} code")
    monkeypatch.setenv(native_build.ISA_ENV, isa)
