"""The reference ops against SDPA, and the fast PyTorch path against the reference."""

from __future__ import annotations

import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portcullis import kernels
from portcullis.kernels.reference import (
    gather_sequence_kv,
    paged_attention_reference,
    write_kv_cache_reference,
)
from portcullis.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch

MIXED = [(1, 1), (1, 300), (7, 7), (70, 133), (1, 17), (16, 16), (33, 250), (1, 64), (2, 2)]


def sdpa_contiguous(case, s: int, window: int | None) -> torch.Tensor:
    """Sequence s through SDPA on contiguous K/V, with a mask built from tril/triu."""
    begin, end = int(case.cu_seqlens_q[s]), int(case.cu_seqlens_q[s + 1])
    ctx, q_len = int(case.context_lens[s]), end - begin
    k = gather_sequence_kv(case.key_cache, case.block_tables[s], ctx).float()
    v = gather_sequence_kv(case.value_cache, case.block_tables[s], ctx).float()
    ones = torch.ones(q_len, ctx, dtype=torch.bool)
    mask = ones.tril(diagonal=ctx - q_len)
    if window is not None:
        mask &= ones.triu(diagonal=ctx - q_len - window + 1)
    q = case.query[begin:end].float().transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(
        q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        scale=case.scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_sdpa(paged, group: int, window: int | None) -> None:
    case = paged.case(MIXED, seed=100 + group + (window or 0), group=group)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    sliding_window=window, **case.kwargs())
    for s in range(len(MIXED)):
        begin, end = int(case.cu_seqlens_q[s]), int(case.cu_seqlens_q[s + 1])
        expected = sdpa_contiguous(case, s, window)
        assert paged.relative_error(ref[begin:end], expected) < 1e-5


def test_reference_single_key_is_value(paged) -> None:
    # A first token sees only itself, so its output is exactly its own value row.
    case = paged.case([(1, 1)], seed=7, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    block = int(case.block_tables[0, 0])
    expected = case.value_cache[block, 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(ref[0], expected)


def run_torch_path(case, window=None, batch=None, out=None) -> torch.Tensor:
    batch = case.batch() if batch is None else batch
    return paged_attention_torch(case.query, case.key_cache, case.value_cache, batch,
                                 scale=case.scale, sliding_window=window, out=out)


SHAPES = {
    "decode": [(1, c) for c in (1, 15, 16, 17, 31, 100, 255, 300, 3, 64)],
    "prefill": [(q, q) for q in (2, 17, 70, 33)] + [(5, 200), (64, 64 + 48)],
    "mixed": MIXED,
}


@pytest.mark.parametrize("variant", ["bag", "sdpa"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_torch_path_matches_reference(paged, monkeypatch, kind, group, block_size, window,
                                      variant) -> None:
    # The gathering decode variants (the compiled kernel has its own tests in test_cpu_decode).
    monkeypatch.setattr("portcullis.kernels.torch_attention.NATIVE_DECODE", False)
    monkeypatch.setattr("portcullis.kernels.torch_attention.DECODE_WITH_EMBEDDING_BAG", variant == "bag")
    seed = zlib.crc32(repr((kind, group, block_size, window, variant)).encode())
    case = paged.case(SHAPES[kind], seed=seed, group=group, block_size=block_size)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    sliding_window=window, **case.kwargs())
    out = torch.full_like(case.query, float("nan"))
    batch = case.batch()
    result = run_torch_path(case, window, batch=batch, out=out)
    assert result is out
    assert not out.isnan().any(), "some output rows were never written"
    assert paged.relative_error(out, ref) < 1e-5
    (step,) = batch.plan.values()
    # The variant under test really ran.
    assert all((c.value_rows is not None) == (variant == "bag") for c in step.decodes)


def test_large_group_takes_sdpa(paged, monkeypatch) -> None:
    # Qwen2.5-0.5B's 14 query heads over 2 KV heads, where the compiled kernel is not used.
    monkeypatch.setattr("portcullis.kernels.torch_attention.NATIVE_DECODE", False)
    case = paged.case(MIXED, seed=51, kv_heads=2, group=7)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    batch = case.batch()
    assert paged.relative_error(run_torch_path(case, batch=batch), ref) < 1e-5
    (step,) = batch.plan.values()
    assert step.decodes and all(c.value_rows is None for c in step.decodes)


def test_strided_query_from_fused_projection(paged) -> None:
    # The engine's query is often a view into a fused QKV projection output.
    case = paged.case(MIXED, seed=52, group=2)
    fused = torch.randn(case.query.shape[0], case.query.shape[1] * 2, case.query.shape[2])
    fused[:, : case.query.shape[1]] = case.query
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    case.query = fused[:, : case.query.shape[1]]
    assert paged.relative_error(run_torch_path(case), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_path_half_precision(paged, dtype: torch.dtype) -> None:
    case = paged.case(MIXED, seed=11, group=2, dtype=dtype)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    out = run_torch_path(case)
    assert out.dtype == dtype
    assert paged.relative_error(out, ref) < paged.tolerance(dtype)


def test_many_decodes_span_several_chunks(paged, monkeypatch: pytest.MonkeyPatch) -> None:
    # A small chunk budget forces the sort-and-chunk logic through many chunks.
    monkeypatch.setattr("portcullis.kernels.torch_attention.NATIVE_DECODE", False)
    monkeypatch.setattr("portcullis.kernels.torch_attention.DECODE_CHUNK_BYTES", 64 << 10)
    lens = torch.randint(1, 400, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    case = paged.case([(1, c) for c in lens] + [(9, 40)], seed=12, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    assert paged.relative_error(run_torch_path(case), ref) < 1e-5


def test_plan_is_shared_across_layers(paged) -> None:
    # Two layers of one step: same batch, different caches and queries, one plan.
    layer_a = paged.case(MIXED, seed=21, group=2)
    layer_b = paged.case(MIXED, seed=22, group=2)
    layer_b.block_tables = layer_a.block_tables
    batch = layer_a.batch()
    for case in (layer_a, layer_b, layer_a):
        ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                        **case.kwargs())
        assert paged.relative_error(run_torch_path(case, batch=batch), ref) < 1e-5
    assert len(batch.plan) == 1


def test_plan_keeps_layers_with_different_windows_apart(paged) -> None:
    case = paged.case(MIXED, seed=23, group=2)
    batch = case.batch()
    for window in (None, 8, None, 8):
        ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                        sliding_window=window, **case.kwargs())
        assert paged.relative_error(run_torch_path(case, window, batch=batch), ref) < 1e-5


def test_unkept_scratch_buffers(paged, monkeypatch) -> None:
    # Buffers too large to keep are allocated per call; results must not change.
    monkeypatch.setattr("portcullis.kernels.torch_attention.SCRATCH_KEEP_BYTES", 0)
    monkeypatch.setattr("portcullis.kernels.torch_attention._scratch", threading.local())
    case = paged.case(MIXED, seed=53, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    assert paged.relative_error(run_torch_path(case), ref) < 1e-5


def test_zero_length_queries_are_skipped(paged) -> None:
    # A sequence with no tokens this step must not disturb its neighbours.
    case = paged.case([(3, 10), (1, 20)], seed=31)
    case.cu_seqlens_q = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    case.context_lens = torch.tensor([10, 5, 20], dtype=torch.int32)
    case.block_tables = torch.cat([case.block_tables[:1], case.block_tables])
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    assert paged.relative_error(run_torch_path(case), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_reference(paged, block_size: int, dtype: torch.dtype) -> None:
    key, value, (kc, vc), slots = paged.write_case(40, block_size, seed=block_size, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    write_kv_cache_torch(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    written = slots[slots >= 0]
    assert torch.equal(kc.view(-1, 2, 64)[written], key[slots >= 0])


@pytest.mark.parametrize("path", ["reference", "torch", "dispatch"])
def test_empty_batches(path, no_attention_override) -> None:
    # An idle step (no tokens) and an all-padding step must be no-ops, not errors.
    write = {"reference": write_kv_cache_reference, "torch": write_kv_cache_torch,
             "dispatch": kernels.write_kv_cache}[path]
    kc, vc = torch.randn(3, 16, 2, 64), torch.randn(3, 16, 2, 64)
    before = kc.clone(), vc.clone()
    write(torch.empty(0, 2, 64), torch.empty(0, 2, 64), kc, vc, torch.empty(0, dtype=torch.long))
    write(torch.randn(2, 2, 64), torch.randn(2, 2, 64), kc, vc, torch.tensor([-1, -1]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    batch = kernels.PagedBatch(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                               torch.zeros(0, 1, dtype=torch.int32))
    attend = {"reference": paged_attention_reference, "torch": paged_attention_torch,
              "dispatch": kernels.paged_attention}[path]
    assert attend(torch.empty(0, 4, 64), kc, vc, batch, scale=0.125).shape == (0, 4, 64)


def test_write_kv_cache_non_contiguous_cache(paged) -> None:
    key, value, (kc, vc), slots = paged.write_case(20, 16, seed=5)
    # A cache that is a strided view of a bigger buffer still receives every write.
    big_k = torch.zeros(kc.shape[0], kc.shape[1], kc.shape[2], 128)
    big_v = torch.zeros_like(big_k)
    view_k, view_v = big_k[..., :64], big_v[..., :64]
    view_k.copy_(kc)
    view_v.copy_(vc)
    write_kv_cache_reference(key, value, kc, vc, slots)
    write_kv_cache_torch(key, value, view_k, view_v, slots)
    assert torch.equal(view_k, kc) and torch.equal(view_v, vc)


def test_dispatch_picks_torch_on_cpu(paged, no_attention_override, monkeypatch) -> None:
    case = paged.case(MIXED, seed=41)
    assert not kernels.use_triton(case.query)
    monkeypatch.setenv("PORTCULLIS_ATTENTION", "torch")
    assert not kernels.use_triton(case.query)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    **case.kwargs())
    out = kernels.paged_attention(case.query, case.key_cache, case.value_cache,
                                  case.batch(max_query_len=70, max_context_len=300),
                                  scale=case.scale)
    assert paged.relative_error(out, ref) < 1e-5


def test_dispatch_rejects_unknown_choice(monkeypatch) -> None:
    monkeypatch.setenv("PORTCULLIS_ATTENTION", "cuda-graphs-please")
    with pytest.raises(ValueError, match="PORTCULLIS_ATTENTION"):
        kernels.use_triton(torch.zeros(1))


def test_dispatch_rejects_bad_head_ratio(paged) -> None:
    case = paged.case([(1, 4)], seed=42, kv_heads=2, group=2)
    with pytest.raises(ValueError, match="multiple"):
        kernels.paged_attention(case.query[:, :3], case.key_cache, case.value_cache,
                                **case.kwargs())


def test_write_through_dispatch(paged, no_attention_override) -> None:
    key, value, (kc, vc), slots = paged.write_case(12, 16, seed=6)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(key, value, kc_ref, vc_ref, slots)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_import_needs_no_triton() -> None:
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported'"
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo)


def test_scratch_made_under_inference_mode_works_outside_it():
    """The engine runs steps under inference_mode; callers outside it share the kept buffers."""
    from portcullis.kernels.torch_attention import scratch

    with torch.inference_mode():
        scratch("probe-inference", 64, torch.float32, torch.device("cpu"))
    buf = scratch("probe-inference", 64, torch.float32, torch.device("cpu"))
    buf.fill_(1.0)  # raised "Inplace update to inference tensor outside InferenceMode" before
    assert float(buf.sum()) == 64.0


# Gemma 2's attention logit soft-capping: scores of N(0, 1)-ish data soft-capped at 1.0 change
# the output far beyond the tolerances below, so a path that ignored `softcap` fails.
SOFTCAP = 1.0


def test_reference_softcap_matches_a_direct_computation(paged) -> None:
    case = paged.case([(5, 40), (1, 33)], seed=61, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    sliding_window=9, softcap=SOFTCAP, **case.kwargs())
    plain = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                      sliding_window=9, **case.kwargs())
    assert paged.relative_error(plain, ref) > 1e-2, "soft-capping at 1.0 should change the output"
    for s in range(2):
        begin, end = int(case.cu_seqlens_q[s]), int(case.cu_seqlens_q[s + 1])
        ctx = int(case.context_lens[s])
        k = gather_sequence_kv(case.key_cache, case.block_tables[s], ctx).repeat_interleave(2, 1)
        v = gather_sequence_kv(case.value_cache, case.block_tables[s], ctx).repeat_interleave(2, 1)
        for i in range(end - begin):
            pos = ctx - (end - begin) + i
            keys = range(max(0, pos - 8), pos + 1)  # window 9: positions > pos - 9
            scores = (case.query[begin + i][:, None, :] * k[list(keys)].transpose(0, 1)).sum(-1)
            scores = SOFTCAP * torch.tanh(scores * case.scale / SOFTCAP)
            expected = (torch.softmax(scores, -1)[..., None] * v[list(keys)].transpose(0, 1)).sum(1)
            assert paged.relative_error(ref[begin + i], expected) < 1e-5


@pytest.mark.parametrize("variant", ["native", "bag", "sdpa"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("group", [1, 2])
def test_torch_path_softcap(paged, monkeypatch, variant, window, group) -> None:
    # "native" leaves the compiled kernel on: a soft-capped layer must be routed around it.
    monkeypatch.setattr("portcullis.kernels.torch_attention.NATIVE_DECODE", variant == "native")
    monkeypatch.setattr("portcullis.kernels.torch_attention.DECODE_WITH_EMBEDDING_BAG", variant == "bag")
    seqs = MIXED + [(5, 40)]  # a short query, which the compiled kernel would otherwise take
    case = paged.case(seqs, seed=zlib.crc32(repr(("softcap", variant, window, group)).encode()),
                      group=group)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    sliding_window=window, softcap=SOFTCAP, **case.kwargs())
    batch = case.batch()
    out = paged_attention_torch(case.query, case.key_cache, case.value_cache, batch,
                                scale=case.scale, sliding_window=window, softcap=SOFTCAP)
    assert paged.relative_error(out, ref) < 1e-5
    (step,) = batch.plan.values()
    assert step.native is None
    assert all((c.value_rows is not None) == (variant == "bag") for c in step.decodes)
    # A layer without soft-capping in the same step still gets its own (uncapped) result.
    plain = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                      sliding_window=window, **case.kwargs())
    assert paged.relative_error(run_torch_path(case, window, batch=batch), plain) < 1e-5


def test_dispatch_passes_softcap(paged, no_attention_override) -> None:
    case = paged.case([(1, 30), (6, 6)], seed=62, group=2)
    ref = paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                    softcap=SOFTCAP, **case.kwargs())
    out = kernels.paged_attention(case.query, case.key_cache, case.value_cache, case.batch(),
                                  scale=case.scale, softcap=SOFTCAP)
    assert paged.relative_error(out, ref) < 1e-5
