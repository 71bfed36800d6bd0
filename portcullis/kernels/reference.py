"""Reference implementations of the cache write and paged attention: the test oracle.

Written for clarity, not speed: one sequence at a time, gather its blocks, repeat K/V for
grouped-query attention, soft-cap the scores if asked, build the causal (and sliding-window)
mask, softmax in float32.
Every other implementation in this package is tested against these functions.
"""

from __future__ import annotations

import torch

from portcullis.kernels.batch import PagedBatch


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy token i's K/V rows into slot ``slot_mapping[i]`` of the caches; -1 skips."""
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[i]
        value_cache[block, offset] = value[i]


def gather_sequence_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` cached rows of one sequence: [context_len, kv_heads, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table_row[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def attention_mask(
    query_len: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean [query_len, context_len]: True where query i may attend to key j.

    Query i sits at absolute position ``context_len - query_len + i``; it sees keys at
    positions <= its own and, with a sliding window W, only those > position - W.
    """
    positions = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    keys = torch.arange(context_len, device=device)[None, :]
    allowed = keys <= positions
    if sliding_window is not None:
        allowed &= keys > positions - sliding_window
    return allowed


def attend_one_sequence(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query [q_len, Hq, D] over keys/values [ctx, Hkv, D] in float32; with
    ``softcap`` c the scaled scores s become c * tanh(s / c) before the mask (Gemma 2)."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask(query.shape[0], keys.shape[0], sliding_window, query.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention, one sequence at a time; returns [num_tokens, Hq, D] in query's dtype."""
    out = torch.empty_like(query)
    starts, block_tables = batch.cu_seqlens_q.tolist(), batch.block_tables
    for s, context_len in enumerate(batch.context_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        keys = gather_sequence_kv(key_cache, block_tables[s], context_len)
        values = gather_sequence_kv(value_cache, block_tables[s], context_len)
        result = attend_one_sequence(query[begin:end], keys, values, scale, sliding_window, softcap)
        out[begin:end] = result.to(query.dtype)
    return out
