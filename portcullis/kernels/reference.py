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


# ---- quantized matrix products (GGUF-quantized weights; kernels/cpu_quant.py) ----

QUANT_BLOCK = 32
QUANT_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def gguf_block_values(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of GGUF blocks (uint8 ``[N, nb * bytes]``) as (integer values int32 ``[N, nb, 32]``,
    scales and minimums float32 ``[N, nb]``): weight = scale * value + minimum."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, QUANT_BLOCK_BYTES[kind])

    def half(at: int) -> torch.Tensor:
        return b[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()

    scale = half(0)
    minimum = half(2) if kind == "Q4_1" else torch.zeros_like(scale)
    if kind == "Q8_0":
        return b[:, :, 2:].contiguous().view(torch.int8).int(), scale, minimum
    qs = b[:, :, 4 if kind == "Q4_1" else 2:].int()
    values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # low nibbles are elements 0..15
    return (values - 8 if kind == "Q4_0" else values), scale, minimum


def dequantize_reference(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weights the blocks stand for, ``[N, K]``: written here from the format for
    Q8_0, Q4_0 and Q4_1, gguf's own numpy dequantize (llama.cpp's reference) for the others."""
    if kind not in QUANT_BLOCK_BYTES:
        import gguf
        import numpy as np

        values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    values, scale, minimum = gguf_block_values(blocks, kind)
    return (scale[..., None] * values.float() + minimum[..., None]).reshape(blocks.shape[0], -1)


def quant_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """x @ W^T in float64 with W the blocks' float32 weights: what the kernel computes, summed
    without rounding until the end."""
    return x.double() @ dequantize_reference(blocks, kind).double().T


def int8_rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """The activations the int8 kernel multiplies (``--gguf-activations int8``), float64: each
    row's block of 32 rounded to int8 with the scale max|x| / 127 (float32), half to even, as
    llama.cpp's Q8_0 activations."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QUANT_BLOCK, QUANT_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse).double() * scale.double()).reshape(m, k)


def int8_activation_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """What the int8 kernel computes, summed without rounding: the int8-rounded activations times
    the blocks' float32 weights, in float64."""
    return int8_rounded_rows(x) @ dequantize_reference(blocks, kind).double().T
