"""The Triton kernels against the reference: on a GPU, or on the CPU via TRITON_INTERPRET=1.

The interpreter runs each program in Python, so cases are small; each draws its shapes and
data from its own seed.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from portcullis.kernels import PagedBatch
from portcullis.kernels.reference import paged_attention_reference, write_kv_cache_reference

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before import",
                allow_module_level=True)

from portcullis.kernels.triton_attention import (  # noqa: E402
    paged_attention_triton,
    write_kv_cache_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case_seed(*params: object) -> int:
    """A distinct, reproducible seed per test case."""
    return zlib.crc32(repr(params).encode())


def draw_seqs(seed: int, kind: str, count: int) -> list[tuple[int, int]]:
    """(query_len, context_len) pairs: query lengths 1..70, contexts 1..300, unaligned."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(count):
        q_len = 1 if kind == "decode" else rng.randint(2, 70)
        if kind == "mixed" and rng.random() < 0.5:
            q_len = 1
        context = q_len if kind == "prefill" else rng.randint(q_len, 300)
        seqs.append((q_len, context))
    return seqs


def check_against_reference(paged, case, window=None, dtype=torch.float32, softcap=None) -> None:
    """Run the kernel on a poisoned output and compare every element with the reference."""
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    sliding_window=window, softcap=softcap, **case.kwargs())
    batch = case.batch(DEVICE, max_query_len=max(case.query_lens),
                       max_context_len=int(case.context_lens.max()))
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device=DEVICE)
    result = paged_attention_triton(
        case.query.to(DEVICE), case.key_cache.to(DEVICE), case.value_cache.to(DEVICE), batch,
        scale=case.scale, sliding_window=window, softcap=softcap, out=out,
    )
    assert result is out
    assert not out.isnan().any(), "some output elements were never written"
    assert paged.relative_error(out.cpu(), ref) < paged.tolerance(dtype)


# (kind, sequences, group, block size, window): together they cover decode-only,
# prefill-only and mixed batches, GQA 1/2/4, block sizes 16/32 and sliding windows.
CASES = [
    ("decode", 12, 4, 16, None),
    ("decode", 10, 1, 32, 40),
    ("decode", 10, 2, 16, 17),
    ("prefill", 4, 1, 32, None),
    ("prefill", 3, 2, 16, 20),
    ("prefill", 3, 4, 16, None),
    ("mixed", 10, 2, 16, None),
    ("mixed", 8, 4, 32, 33),
    ("mixed", 8, 1, 16, 100),
]


@pytest.mark.parametrize(("kind", "count", "group", "block_size", "window"), CASES)
def test_attention_matches_reference(paged, kind, count, group, block_size, window) -> None:
    seed = case_seed(kind, count, group, block_size, window)
    seqs = draw_seqs(seed, kind, count)
    case = paged.case(seqs, seed=seed, group=group, block_size=block_size)
    check_against_reference(paged, case, window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_precision(paged, dtype) -> None:
    seed = case_seed("half", dtype)
    case = paged.case(draw_seqs(seed, "mixed", 3), seed=seed, group=2, dtype=dtype)
    check_against_reference(paged, case, dtype=dtype)


@pytest.mark.parametrize("head_dim", [128, 80, 96])
def test_attention_head_dims(paged, head_dim) -> None:
    seed = case_seed("head_dim", head_dim)
    case = paged.case([(1, 37), (9, 50)], seed=seed, group=2, kv_heads=1, head_dim=head_dim)
    check_against_reference(paged, case)


@pytest.mark.parametrize(("group", "window", "dtype"), [(2, None, torch.float32), (1, 20, torch.float32),
                                                    (2, 20, torch.bfloat16)])
def test_attention_softcap(paged, group, window, dtype) -> None:
    # Gemma 2's soft-capping; at 1.0 it changes N(0, 1) scores far beyond the tolerance.
    seed = case_seed("softcap", group, window, dtype)
    case = paged.case([(1, 45), (7, 30), (1, 3)], seed=seed, group=group, dtype=dtype)
    check_against_reference(paged, case, window, dtype=dtype, softcap=1.0)
    plain = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                      sliding_window=window, **case.kwargs())
    capped = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                       sliding_window=window, softcap=1.0, **case.kwargs())
    assert paged.relative_error(plain, capped) > 10 * paged.tolerance(dtype)


def test_attention_edge_sequences(paged) -> None:
    # A one-token context, an empty query between two sequences, a context ending on a block
    # boundary, and a query longer than one program tile.
    case = paged.case([(1, 1), (1, 32), (40, 64)], seed=5, group=2)
    case.cu_seqlens_q = torch.tensor([0, 1, 1, 2, 42], dtype=torch.int32)
    case.context_lens = torch.tensor([1, 9, 32, 64], dtype=torch.int32)
    case.block_tables = torch.cat([case.block_tables[:1], case.block_tables])
    case.query_lens = [1, 0, 1, 40]
    check_against_reference(paged, case)


def test_attention_strided_query(paged) -> None:
    # The engine's query is often a view into a fused QKV projection (row stride > heads*D).
    case = paged.case([(3, 20), (1, 70)], seed=9, group=2)
    fused = torch.randn(case.query.shape[0], case.query.shape[1] * 2, case.query.shape[2])
    fused[:, : case.query.shape[1]] = case.query
    case.query = fused[:, : case.query.shape[1]]
    check_against_reference(paged, case)


def test_dispatch_forced_to_triton(paged, monkeypatch) -> None:
    from portcullis import kernels

    monkeypatch.setenv("PORTCULLIS_ATTENTION", "triton")
    case = paged.case([(1, 20), (4, 4)], seed=13, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    out = kernels.paged_attention(case.query.to(DEVICE), case.key_cache.to(DEVICE),
                                  case.value_cache.to(DEVICE), case.batch(DEVICE),
                                  scale=case.scale)
    assert paged.relative_error(out.cpu(), ref) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_reference(paged, block_size, dtype) -> None:
    key, value, (kc, vc), slots = paged.write_case(24, block_size, seed=block_size, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    kc_dev, vc_dev = kc.to(DEVICE), vc.to(DEVICE)
    write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), kc_dev, vc_dev, slots.to(DEVICE))
    assert torch.equal(kc_dev.cpu(), kc_ref) and torch.equal(vc_dev.cpu(), vc_ref)


def test_write_kv_cache_strided_inputs(paged) -> None:
    # K and V as views of one fused projection output, as the engine produces them.
    key, value, (kc, vc), slots = paged.write_case(10, 16, seed=77)
    fused = torch.cat([key, value], dim=1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    fused, kc, vc = fused.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE)
    heads = key.shape[1]
    write_kv_cache_triton(fused[:, :heads], fused[:, heads:], kc, vc, slots.to(DEVICE))
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)


def test_empty_batches() -> None:
    kc = torch.randn(3, 16, 2, 64, device=DEVICE)
    vc = torch.randn(3, 16, 2, 64, device=DEVICE)
    before = kc.clone(), vc.clone()
    empty_slots = torch.empty(0, dtype=torch.long, device=DEVICE)
    write_kv_cache_triton(torch.empty(0, 2, 64, device=DEVICE),
                          torch.empty(0, 2, 64, device=DEVICE), kc, vc, empty_slots)
    write_kv_cache_triton(torch.randn(2, 2, 64, device=DEVICE),
                          torch.randn(2, 2, 64, device=DEVICE), kc, vc,
                          torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    batch = PagedBatch(torch.zeros(1, dtype=torch.int32, device=DEVICE),
                       torch.zeros(0, dtype=torch.int32, device=DEVICE),
                       torch.zeros(0, 1, dtype=torch.int32, device=DEVICE))
    out = paged_attention_triton(torch.empty(0, 4, 64, device=DEVICE), kc, vc, batch, scale=0.125)
    assert out.shape == (0, 4, 64)
