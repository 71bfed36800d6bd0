"""The decode stack's SiLU * up (kernels/cpu_stack.py), which the layer-by-layer path shares where
its projections are native: PyTorch's F.silu(gate) * up within about an ulp, on each build this
CPU runs (the AVX2 build has its own vector exponential)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from portcullis.kernels import cpu_stack, native_build
from tests.support.isa import use_build


@pytest.mark.parametrize("isa", list(native_build.ISA_FLAGS))
def test_silu_mul_is_pytorchs_within_an_ulp(isa, monkeypatch):
    use_build(isa, monkeypatch)
    inter = 1539  # not a multiple of a vector: the scalar tail too
    gate_up = torch.randn(37, 2 * inter, generator=torch.Generator().manual_seed(0)) * 6
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -1e-30, 0.0, 1e-30, 20.0, 90.0, 200.0])
    act = cpu_stack.silu_mul(gate_up)
    if act is None:
        assert not os.environ.get("CI"), "CI has a C++ compiler: the decode stack should have built"
        pytest.skip("no C++ compiler here")
    gate, up = gate_up.split(inter, dim=-1)
    # e^-x past float32's range: PyTorch's quotient is -0, the kernel's clamped one below 1e-36.
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=3e-7, atol=1e-35)


@pytest.mark.parametrize("bad", [torch.zeros(4, 7), torch.zeros(4, 8, dtype=torch.float64), torch.zeros(8, 4).t(),
                                 torch.zeros(8)], ids=["odd-width", "float64", "strided", "1-d"])
def test_silu_mul_refuses_rows_it_cannot_read(bad):
    with pytest.raises(ValueError, match="SiLU"):
        cpu_stack.silu_mul(bad)
