"""Triton kernels: the KV-cache write and one paged-attention kernel for mixed batches.

Imported only when the Triton path is chosen: ``triton.jit`` reads ``TRITON_INTERPRET`` when
it decorates, so the tests' setting (CPU tensors through the interpreter) must come first.

Attention work is cut into programs of ``BLOCK_Q`` query tokens x one KV head. The program
holds the rows of all ``group`` query heads that share that KV head, so each K/V tile is read
once per group (grouped-query attention without repeating K/V). It walks the sequence's keys
in tiles of ``TILE_N`` positions, looking each position's page up in the block table, and
keeps an online softmax in float32. Decodes and prefill chunks differ only in how many rows
are live, which is why one kernel serves a mixed batch. Soft-capping (Gemma 2) is applied in
the log2 domain the scores live in: c * tanh(s / c) of the natural score is
c' * tanh(s' / c') of the log2 score s' = s * log2(e) with c' = c * log2(e).

The launch grid must not depend on device values (no syncs; CUDA-graph friendly), so it has
``num_tokens // BLOCK_Q + num_seqs`` program rows, an upper bound on the query tiles of any
batch: sequence s owns rows from ``cu_seqlens_q[s] // BLOCK_Q + s``, and a program finds its
sequence by binary search over that. Rows between two sequences' ranges exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portcullis.kernels.batch import PagedBatch

LOG2_E = 1.4426950408889634  # scores live in the log2 domain (exp2 is the cheap exponential)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch, stride_vcb, stride_vco, stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One program per token: copy its [heads, dim] K and V rows into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    # Padding tokens (slot < 0) load and store nothing. (The slot test is broadcast to the
    # tile first: the interpreter rejects a mask mixing a scalar into a block.)
    live = tl.zeros([HEADS_PAD, DIM_PAD], tl.int64) + slot >= 0
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & live
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = key_cache_ptr + block * stride_cb + offset * stride_co + heads * stride_ch + dims
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter K/V rows into the caches by slot; slot -1 is skipped."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, key_cache, value_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv_cache needs a unit stride along head_dim")
    if key.dtype != key_cache.dtype:  # cast by torch (round to nearest): a store's implicit cast may truncate
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _find_sequence(cu_seqlens_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence s with cu_seqlens[s] // BLOCK_Q + s <= tile (binary search)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in tl.math that the interpreter also runs); exact enough for
    float32 scores, and never overflows (exp of a non-positive number)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
    scale_log2, softcap_log2, num_seqs, block_size, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """One program: BLOCK_Q query tokens x the GROUP query heads of one KV head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        _attend_tile(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
            scale_log2, softcap_log2, block_size, window, q_start, q_len, q_tile, context_len,
            kv_head,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            GROUP, HEAD_DIM, GROUP_PAD, DIM_PAD, BLOCK_Q, TILE_N, USE_WINDOW, PRECISION,
            DOT_FP32, USE_SOFTCAP,
        )


@triton.jit
def _attend_tile(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr,
    scale_log2, softcap_log2, block_size, window, q_start, q_len, q_tile, context_len, kv_head,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """Online-softmax attention of one query tile over the keys it can see."""
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, ROWS)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD  # within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD
    row_live = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_live = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                mask=row_live[:, None] & dim_live[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Absolute positions; dead rows get the last live position so they stay finite.
    first_pos = context_len - q_len + q_tile * BLOCK_Q
    pos = context_len - q_len + tl.minimum(token, q_len - 1)
    last_pos = context_len - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(first_pos - window + 1, 0) // TILE_N * TILE_N

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    for n0 in range(key_start, last_pos + 1, TILE_N):
        n = n0 + tl.arange(0, TILE_N)
        n_live = n <= last_pos
        page = tl.load(table_ptr + n // block_size, mask=n_live, other=0).to(tl.int64)
        offset = n % block_size
        kv_live = n_live[:, None] & dim_live[None, :]
        k = tl.load(k_cache_ptr + page[:, None] * stride_kb + offset[:, None] * stride_ko
                    + k_head + dims[None, :], mask=kv_live, other=0.0)
        v = tl.load(v_cache_ptr + page[:, None] * stride_vb + offset[:, None] * stride_vo
                    + v_head + dims[None, :], mask=kv_live, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, TILE_N], log2 domain
        if USE_SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        visible = n[None, :] <= pos[:, None]
        if USE_WINDOW:
            visible &= n[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet (window start inside the tile) stays at -inf;
        # subtracting 0 instead keeps exp2 from producing NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    result = acc / l_i[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], result.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & dim_live[None, :])


def _tile_sizes(max_query_len: int | None, group_pad: int, dim_pad: int,
                element_size: int) -> tuple[int, int]:
    """(BLOCK_Q, TILE_N): at least 16 rows for tl.dot, more query rows for prefill; key tiles
    shrink for wide heads and float32 so K/V tiles stay within shared memory."""
    rows = 16 if (max_query_len is not None and max_query_len * group_pad <= 16) else 64
    block_q = max(1, rows // group_pad)
    tile_n = 64 if dim_pad * element_size <= 256 else 32
    return block_q, tile_n


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    launch: dict | None = None,
) -> torch.Tensor:
    """Launch the unified paged-attention kernel; returns [num_tokens, num_q_heads, D].
    `launch` overrides the tile and launch settings (``tile_n``, ``num_warps``,
    ``num_stages``) for tuning (``benchmarks/kernels_gpu.py --sweep``); None keeps the defaults."""
    num_tokens, num_q_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = num_q_heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    if query.dtype != key_cache.dtype:  # tl.dot takes one dtype: attend in the cache's, as the torch path
        query = query.to(key_cache.dtype)
    num_seqs = batch.context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    for t in (query, key_cache, value_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged_attention needs a unit stride along head_dim")
    group_pad, dim_pad = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_q, tile_n = _tile_sizes(batch.max_query_len, group_pad, dim_pad,
                                  key_cache.element_size())
    launch = dict(launch or {})
    tile_n = launch.pop("tile_n", tile_n)
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache,
        batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
        scale * LOG2_E, (softcap or 1.0) * LOG2_E, num_seqs, key_cache.shape[1],
        sliding_window if sliding_window is not None else 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        batch.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, DIM_PAD=dim_pad,
        BLOCK_Q=block_q, TILE_N=tile_n, USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        # tf32 would cost float32 callers about 1e-3 of accuracy; half types ignore this.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter (CPU tensors) computes tl.dot on bfloat16 wrongly in Triton 3.9.
        DOT_FP32=not query.is_cuda,
        **launch,  # num_warps / num_stages, when tuning
    )
    return out
