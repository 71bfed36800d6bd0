"""A KV cache of another dtype than the model's (`--kv-cache-dtype`): both directions, both paths."""

from __future__ import annotations

import os

import pytest
import torch

from portcullis.kernels.reference import paged_attention_reference, write_kv_cache_reference
from portcullis.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch

MIXED = [(1, 1), (1, 300), (7, 7), (70, 133), (1, 17), (33, 250), (1, 64)]
DIRECTIONS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]  # (model, cache)


def _case(paged, model_dtype, cache_dtype, seqs=MIXED, seed=5):
    case = paged.case(seqs, seed=seed, group=2, dtype=cache_dtype)
    case.query = case.query.to(model_dtype)
    return case


def _triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before import")
    from portcullis.kernels import triton_attention

    return triton_attention


@pytest.mark.parametrize(("model_dtype", "cache_dtype"), DIRECTIONS)
def test_torch_attention_over_a_cache_of_another_dtype(paged, model_dtype, cache_dtype) -> None:
    case = _case(paged, model_dtype, cache_dtype)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache, **case.kwargs())
    out = paged_attention_torch(case.query, case.key_cache, case.value_cache, **case.kwargs())
    assert out.dtype == model_dtype
    assert paged.relative_error(out, ref) < paged.tolerance(torch.bfloat16)


@pytest.mark.parametrize(("model_dtype", "cache_dtype"), DIRECTIONS)
def test_torch_write_casts_rows_to_the_cache_dtype(paged, model_dtype, cache_dtype) -> None:
    key, value, caches, slots = paged.write_case(40, 16, seed=3, dtype=model_dtype)
    kc, vc = (c.to(cache_dtype) for c in caches)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    write_kv_cache_torch(key, value, kc, vc, slots)
    assert kc.dtype == cache_dtype and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize(("model_dtype", "cache_dtype"), DIRECTIONS)
def test_triton_over_a_cache_of_another_dtype(paged, model_dtype, cache_dtype) -> None:
    triton_attention = _triton()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _case(paged, model_dtype, cache_dtype, seqs=[(1, 37), (5, 20)], seed=9)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache, **case.kwargs())
    out = triton_attention.paged_attention_triton(
        case.query.to(device), case.key_cache.to(device), case.value_cache.to(device),
        case.batch(device), scale=case.scale)
    assert out.dtype == model_dtype
    assert paged.relative_error(out.cpu(), ref) < paged.tolerance(torch.bfloat16)

    key, value, caches, slots = paged.write_case(12, 16, seed=4, dtype=model_dtype)
    kc, vc = (c.to(cache_dtype) for c in caches)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    kc, vc = kc.to(device), vc.to(device)
    triton_attention.write_kv_cache_triton(key.to(device), value.to(device), kc, vc, slots.to(device))
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)
