"""The quantized-weight matmul kernel (kernels/cpu_quant.py) against the exact reference, for
each instruction set this CPU runs (AVX-512 in the native build where the CPU has it, AVX2 in
the x86-64-v3 build): exact where every partial sum is an integer, within float32 summation
error of x @ dequantized W otherwise, odd shapes and 1 to 300 rows (both the in-register and the
panel paths)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from portcullis.kernels import cpu_quant
from portcullis.kernels.reference import (
    dequantize_reference,
    int8_activation_matmul_reference,
    int8_rounded_rows,
    quant_matmul_reference,
)

KINDS = [kind for kind in cpu_quant.KINDS if kind not in cpu_quant.INT8_KINDS]


@pytest.fixture(params=["native", "x86-64-v3"])
def lib(request):
    """The kernel built for each instruction set; one this CPU cannot run skips, and a machine
    without a compiler skips, except in CI."""
    from portcullis.kernels import native_build

    if not native_build.cpu_supports(request.param):
        pytest.skip(f"this CPU cannot run {request.param} code")
    built = cpu_quant.native_library(request.param)
    if built is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI has a C++ compiler: the {request.param} quantized kernel should have built")
        pytest.skip("no C++ compiler here: the quantized kernel cannot be built")
    return built


# Where each kind keeps its fp16 scale (and minimum): offsets in a block (super-block for K-quants).
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
SIMPLE = ["Q8_0", "Q4_0", "Q4_1"]  # the kinds with integer values times one scale


def width(kind: str, k: int) -> int:
    """`k` rounded up to whole blocks of `kind` (256 weights for K-quants)."""
    per = cpu_quant.BLOCK_WEIGHTS[kind]
    return -(-k // per) * per


def random_blocks(kind: str, n: int, k: int, seed: int, scale: tuple[float, float] = (0.002, 0.05)) -> torch.Tensor:
    """N rows of random GGUF blocks: every bit pattern of values and sub-block scales, the fp16
    scales (and minimums) finite, drawn from ``scale``."""
    g = torch.Generator().manual_seed(seed)
    size, per = cpu_quant.BLOCK_BYTES[kind], cpu_quant.BLOCK_WEIGHTS[kind]
    b = torch.randint(0, 256, (n, k // per, size), dtype=torch.uint8, generator=g)
    low, high = scale
    for i, at in enumerate(HALVES[kind]):
        values = torch.empty(n, k // per).uniform_(low, high, generator=g)
        if i == 1 and kind == "Q4_1":
            values *= -8  # a minimum about -8 scales, as a Q4_1 quantizer writes
        b[..., at:at + 2] = values.half().view(torch.uint8).reshape(n, k // per, 2)
    return b.reshape(n, -1)


def unit_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks of a SIMPLE kind with scale 1 (and minimum 3): every product and sum an
    exact integer."""
    b = random_blocks(kind, n, k, seed).reshape(n, k // 32, cpu_quant.BLOCK_BYTES[kind])
    b[..., :2] = torch.tensor([1.0]).half().view(torch.uint8)
    if kind == "Q4_1":
        b[..., 2:4] = torch.tensor([3.0]).half().view(torch.uint8)
    return b.reshape(n, -1)


def integer_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-127, 127]: with unit blocks every product and partial sum is an integer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (m, k), generator=g).float()


def test_the_builds_run_the_instruction_sets_they_name(lib) -> None:
    name = cpu_quant.isa_name(lib)
    assert name in ("AVX-512", "AVX2")
    if lib is cpu_quant.native_library("x86-64-v3"):
        assert name == "AVX2"


@pytest.mark.parametrize("kind", SIMPLE + ["Q5_0"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 7, 64), (2, 33, 96), (5, 64, 576), (8, 130, 320), (300, 9, 64)])
def test_integer_products_are_exact(lib, kind, m, n, k) -> None:
    x = integer_activations(m, k, seed=m + n + k)
    w = unit_blocks(kind, n, k, seed=n)
    got = cpu_quant.quant_matmul(lib, x, w, kind)
    want = quant_matmul_reference(x, w, kind)
    assert torch.equal(got.double(), want)  # every partial sum is an integer below 2**24


def summation_bound(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 summation error allowed: 1e-5 of the sum of the products' magnitudes."""
    return 1e-5 * (x.abs().double() @ dequantize_reference(w, kind).abs().double().T) + 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8, 9, 16, 64, 300])
def test_float_products_match_the_reference(lib, kind, m) -> None:
    n, k = (67, 576) if m < 64 else (29, 192)
    k = width(kind, k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    w = random_blocks(kind, n, k, seed=m)
    got = cpu_quant.quant_matmul(lib, x, w, kind)
    err = (got.double() - quant_matmul_reference(x, w, kind)).abs()
    assert (err <= summation_bound(x, w, kind)).all(), err.max()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_rows_are_ggufs_own(lib, kind) -> None:
    import gguf

    w = random_blocks(kind, 40, width(kind, 160), seed=3)
    theirs = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    assert theirs.shape == (40, width(kind, 160)) and np.isfinite(theirs).all()
    assert torch.equal(dequantize_reference(w, kind), torch.from_numpy(np.asarray(theirs, dtype=np.float32)))
    assert torch.equal(cpu_quant.dequantize_rows(lib, w, kind), dequantize_reference(w, kind))
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(cpu_quant.dequantize_rows(lib, w, kind, ids=ids), dequantize_reference(w, kind)[ids])


def test_a_shape_the_blocks_cannot_hold_is_refused(lib) -> None:
    x = torch.randn(1, 40)
    with pytest.raises(ValueError, match="refused"):
        cpu_quant.quant_matmul(lib, x, torch.zeros(4, 34, dtype=torch.uint8), "Q8_0")


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_a_residual_product_is_the_sum_pytorch_makes(lib, kind, m) -> None:
    """matmul_add rounds as ``residual + (x @ W^T)`` does: bit for bit, at decode and GEMM sizes."""
    n, k = 70, width(kind, 320)
    g = torch.Generator().manual_seed(m)
    x, residual = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g) * 4
    w = random_blocks(kind, n, k, seed=m)
    want = residual + cpu_quant.quant_matmul(lib, x, w, kind)
    assert torch.equal(cpu_quant.matmul_add(lib, x, w, kind, residual), want)
    with pytest.raises(ValueError, match="residual"):  # never read past a residual of the wrong shape
        cpu_quant.matmul_add(lib, x, w, kind, residual[:, :-1])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 8, 33])
def test_a_normed_product_is_the_product_of_the_norm(lib, kind, m) -> None:
    """norm_matmul is Hugging Face's float32 RMSNorm then the product, up to the order of the sum
    of squares: within a few float32 roundings of the two steps apart."""
    from portcullis.engine.model.layers import RMSNorm

    n, k = 96, 576
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 30, k)  # rows of very different scales
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    w = random_blocks(kind, n, k, seed=m)
    got = cpu_quant.norm_matmul(lib, x, norm.weight, norm.eps, w, kind)
    want = quant_matmul_reference(norm(x), w, kind)
    bound = 4e-6 * (norm(x).abs().double() @ dequantize_reference(w, kind).abs().double().T) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


# ---- int8 activations (--gguf-activations int8) ----

def int8_bound(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 error allowed on top of the exact int8 product: one rounding per block's scale
    product and sum, 1e-5 of the products' magnitudes."""
    return 1e-5 * (int8_rounded_rows(x).abs() @ dequantize_reference(w, kind).abs().double().T) + 1e-6


@pytest.mark.parametrize("kind", SIMPLE)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 48, 64), (4, 32, 96), (5, 80, 576), (16, 576, 576), (33, 16, 160)])
def test_int8_activations_give_the_rounded_rows_product(lib, kind, m, n, k) -> None:
    """The int8 kernel's product equals the int8-rounded activations times the float32 weights,
    up to float32 rounding of each block's scaled sum: the integer sums are exact."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.01, 20, k)  # blocks of very different scales
    x[0, :32] = 0  # an all-zero block: scale 0
    w = random_blocks(kind, n, k, seed=n + k)
    packed, packed_kind = cpu_quant.repack_int8(lib, w, kind)
    assert packed_kind == kind + "_I8" and packed.shape == w.shape
    got = cpu_quant.quant_matmul(lib, x, packed, packed_kind)
    want = int8_activation_matmul_reference(x, w, kind)
    assert ((got.double() - want).abs() <= int8_bound(x, w, kind)).all()
    residual = torch.randn(m, n, generator=g)
    assert torch.equal(cpu_quant.matmul_add(lib, x, packed, packed_kind, residual), residual + got)


@pytest.mark.parametrize("kind", SIMPLE)
def test_repacked_blocks_dequantize_to_the_same_weights(lib, kind) -> None:
    """A table the embedding shares with a tied head is repacked once: its rows still dequantize
    to gguf's exact floats."""
    w = random_blocks(kind, 48, 96, seed=3)
    packed, packed_kind = cpu_quant.repack_int8(lib, w, kind)
    assert torch.equal(cpu_quant.dequantize_rows(lib, packed, packed_kind), dequantize_reference(w, kind))
    ids = torch.tensor([47, 0, 17, 17, 30])
    assert torch.equal(cpu_quant.dequantize_rows(lib, packed, packed_kind, ids=ids), dequantize_reference(w, kind)[ids])


def test_int8_normed_product_rounds_the_normed_rows(lib) -> None:
    from portcullis.engine.model.layers import RMSNorm

    m, n, k = 6, 64, 576
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 30, k)
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    w = random_blocks("Q4_1", n, k, seed=1)
    packed, packed_kind = cpu_quant.repack_int8(lib, w, "Q4_1")
    got = cpu_quant.norm_matmul(lib, x, norm.weight, norm.eps, packed, packed_kind)
    # The kernel's norm sums its squares in another order, so a value can round to the next int8:
    # within half a step of its block's scale of the normed rows' exact product.
    normed = norm(x)
    half_step = (normed.abs().reshape(m, -1, 32).amax(-1, keepdim=True) / 127 / 2).expand(-1, -1, 32).reshape(m, k)
    w_abs = dequantize_reference(w, "Q4_1").abs().double().T
    bound = half_step.double() @ w_abs + int8_bound(normed, w, "Q4_1")
    assert ((got.double() - quant_matmul_reference(normed, w, "Q4_1")).abs() <= bound).all()


def test_what_int8_cannot_run_is_left_or_refused(lib) -> None:
    """Rows not a multiple of 16, and kinds other than Q8_0/Q4_0/Q4_1, are not repacked (they stay
    on the float kernel); a repacked kind over a shape it cannot hold is refused."""
    assert cpu_quant.repack_int8(lib, random_blocks("Q4_1", 40, 64, seed=0), "Q4_1") is None
    assert cpu_quant.repack_int8(lib, random_blocks("Q4_K", 16, 256, seed=0), "Q4_K") is None
    with pytest.raises(ValueError, match="refused"):
        cpu_quant.quant_matmul(lib, torch.randn(2, 64), random_blocks("Q4_1", 40, 64, seed=0), "Q4_1_I8")
