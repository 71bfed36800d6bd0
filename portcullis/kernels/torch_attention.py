"""The PyTorch path of both ops: what the engine runs on CPUs (and on GPUs when forced).

Eager PyTorch cannot read the paged cache in place, so attention gathers each sequence's
blocks with ``index_select`` over whole blocks (about 5x faster than advanced indexing here)
and hands contiguous-enough K/V to ``scaled_dot_product_attention``, whose CPU kernel
is fused and multi-threaded.

* Decodes (query length 1) are sorted by how many blocks they need and cut into chunks whose
  gathered K/V stays small (a few MiB): padding is only up to the longest sequence of its
  chunk, the gather buffer is reused (fresh allocations cost more in page faults than the
  copy itself), and the gathered rows are still in cache when SDPA reads them.
* Grouped-query attention folds the query heads of one KV head into SDPA's query-length
  dimension, so K/V are never repeated.
* For float32 caches and small GQA groups, decodes gather only K: scores come from one
  ``bmm`` per KV head, and P @ V is read straight from the cache by ``embedding_bag`` (a
  weighted sum of indexed rows), which saves V's copy; about 10-15% faster here.
* Prefill chunks (query length > 1; few per step) run one SDPA call each, with
  ``is_causal`` when the chunk is the whole context and an explicit mask otherwise.
* Soft-capped layers (Gemma 2: scores s become c * tanh(s / c) before the mask) cannot use
  SDPA's fused kernel nor the compiled decode kernel, which know no soft-capping: their
  decodes take the embedding-bag variant where it applies (it computes the scores itself) and
  everything else an explicit matmul-softmax-matmul (:func:`_softcapped_sdpa`), slower but
  exact. The native kernel is never used for them.

Everything that depends only on the step's metadata (the sort, the chunks, block ids,
masks) is a :class:`StepPlan`, memoized in the batch's ``plan`` dict so that all layers of
one step share it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from portcullis.kernels import cpu_decode
from portcullis.kernels.batch import PagedBatch

# Bytes gathered per decode chunk (K and V, or K alone for the embedding-bag variant). Fewer,
# larger chunks spend less on per-op overhead; much larger ones pad more and leave the last-level
# cache. 8 MiB measured best among 0.5-64 MiB for both variants on the development machines
# (benchmarks/attention_cpu.py shapes, distinct caches per layer).
DECODE_CHUNK_BYTES = 8 << 20

# Decodes on float32 CPU caches skip gathering V (see _attend_decodes_bag). A switch so the
# tests can run both variants.
DECODE_WITH_EMBEDDING_BAG = True

# Decodes on float32/bf16 CPU caches take the compiled kernel when it builds (kernels.cpu_decode),
# which reads K/V in place instead of gathering them. A switch so the tests can run both paths.
NATIVE_DECODE = True
# Queries up to this long (a decode plus its speculative proposals) take the compiled decode
# kernel one row per token, reading the cache in place; longer ones are prefills (gather + SDPA).
NATIVE_SHORT_QUERY = 17


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter K/V rows into the caches by slot; slots < 0 are padding and skipped. Float32 CPU
    caches take one native call where the kernels are built (the scatter below is ten small ops
    per layer and step)."""
    lib = cpu_decode.native_library() if NATIVE_DECODE and key.device.type == "cpu" else None
    if lib is not None and cpu_decode.write_kv_cache(lib, key, value, key_cache, value_cache, slot_mapping):
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    for new, cache in ((key, key_cache), (value, value_cache)):
        if cache.is_contiguous():
            # One row per slot: index_copy_ is a memcpy per token.
            row = cache.shape[2] * cache.shape[3]
            # index_copy_ needs one dtype: a cache may be held narrower than the model (bf16).
            cache.view(-1, row).index_copy_(0, slots, new.reshape(len(slots), row).to(cache.dtype))
        else:
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = new


@dataclass
class DecodeChunk:
    """Decoding sequences attended together in one attention call."""

    token_index: torch.Tensor  # long [n]: rows of query/out
    block_ids: torch.Tensor  # long [n * num_blocks]: cache blocks to gather, padded
    mask: torch.Tensor  # bool [n, 1, 1, num_blocks * block_size]
    num_blocks: int
    # Only for the embedding-bag variant (see _attend_decodes_bag):
    bias: torch.Tensor | None = None  # float [n, 1, 1, keys]: 0 or -inf
    value_rows: torch.Tensor | None = None  # [n * kv_heads * group, keys] rows of V


@dataclass
class PrefillChunk:
    """One sequence with more than one query token."""

    begin: int
    end: int
    block_ids: torch.Tensor  # long [num_blocks]
    mask: torch.Tensor | None  # bool [q_len, keys]; None means plain causal


@dataclass
class NativeDecodes:
    """Decodes and short queries for the compiled kernel (kernels.cpu_decode), which reads the
    cache in place."""

    tables: tuple[torch.Tensor, torch.Tensor]  # int32 block_tables, context_lens (contiguous)
    decodes: tuple[torch.Tensor, torch.Tensor]  # long sequence index, first query row of each item
    spans: torch.Tensor | None = None  # int32 query rows of each item (None: one each)
    written: torch.Tensor | None = None  # with spans: every query row the items cover


@dataclass
class StepPlan:
    """Per-step preparation shared by all layers."""

    decodes: list[DecodeChunk]
    prefills: list[PrefillChunk]
    native: NativeDecodes | None = None


# Gather buffers outlive steps: a fresh multi-MiB allocation costs more in page faults than
# the gather itself. Per thread, so two engines in one process never share one. Buffers above
# SCRATCH_KEEP_BYTES (a rare very long prefill) are not kept, so memory stays bounded.
_scratch = threading.local()
SCRATCH_KEEP_BYTES = 256 << 20


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer of at least ``numel`` elements (contents undefined)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (name, dtype, device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor, even when first made under inference_mode: an inference tensor could
        # not be written later outside it (as tests and other callers do).
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        if numel * buf.element_size() <= SCRATCH_KEEP_BYTES:
            buffers[key] = buf
    return buf[:numel]


def gather_buffer(name: str, rows: int, cache: torch.Tensor) -> torch.Tensor:
    """A reusable [rows, block elements] buffer for gathering whole blocks of ``cache``."""
    width = cache[0].numel()
    return scratch(name, rows * width, cache.dtype, cache.device).view(rows, width)


def _first_visible_key(
    context_lens: torch.Tensor, query_lens: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Position of the first key any query of each sequence can see (0 without a window)."""
    if window is None:
        return torch.zeros_like(context_lens)
    first_query = context_lens - query_lens
    return (first_query - window + 1).clamp(min=0)


def _block_ids(
    block_tables: torch.Tensor, first_block: torch.Tensor, blocks_needed: torch.Tensor, width: int
) -> torch.Tensor:
    """Blocks [first_block, first_block + width) of each row; unused columns point at block 0.

    Entries past a sequence's blocks may be anything, so they are replaced by a valid id;
    the mask hides them.
    """
    cols = first_block[:, None] + torch.arange(width, device=block_tables.device)[None, :]
    used = torch.arange(width, device=block_tables.device)[None, :] < blocks_needed[:, None]
    cols = cols.clamp(max=block_tables.shape[1] - 1)
    ids = block_tables.gather(1, cols).long()
    return torch.where(used, ids, torch.zeros_like(ids)).reshape(-1)


def _key_positions(first_block: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """Absolute position of each gathered key row: [n, width * block_size]."""
    rows = torch.arange(width * block_size, device=first_block.device)
    return first_block[:, None] * block_size + rows[None, :]


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query at ``query_pos`` may attend to a key at ``key_pos`` (broadcast)."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


def _plan_decodes(
    seqs: torch.Tensor,
    token_index: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None,
    bytes_per_key: int,
    bag_heads: tuple[int, int] | None,
) -> list[DecodeChunk]:
    """Sort decodes by blocks needed and cut them into chunks of bounded gathered size.

    ``bag_heads`` = (kv_heads, group) asks for the embedding-bag variant's extra indices.
    """
    ctx = context_lens[seqs].long()
    first_block = _first_visible_key(ctx, torch.ones_like(ctx), window) // block_size
    needed = (ctx + block_size - 1) // block_size - first_block
    order = torch.argsort(needed, stable=True)
    seqs, ctx, first_block, needed = seqs[order], ctx[order], first_block[order], needed[order]
    token_index = token_index[order]
    budget = max(1, DECODE_CHUNK_BYTES // (bytes_per_key * block_size))
    chunks, start, needed_list = [], 0, needed.tolist()
    while start < len(needed_list):
        stop = start + 1
        # Sorted ascending, so the chunk's width is its last sequence's need.
        while stop < len(needed_list) and (stop + 1 - start) * needed_list[stop] <= budget:
            stop += 1
        part = slice(start, stop)
        width = needed_list[stop - 1]
        key_pos = _key_positions(first_block[part], width, block_size)
        # The query sits at ctx - 1, so padding rows (positions >= ctx) are masked too.
        mask = _visible(key_pos, (ctx[part] - 1)[:, None], window)
        ids = _block_ids(block_tables[seqs[part]], first_block[part], needed[part], width)
        chunk = DecodeChunk(token_index[part], ids, mask[:, None, None, :], width)
        if bag_heads is not None:
            _add_bag_indices(chunk, block_size, *bag_heads)
        chunks.append(chunk)
        start = stop
    return chunks


def _add_bag_indices(chunk: DecodeChunk, block_size: int, kv_heads: int, group: int) -> None:
    """Rows of V (viewed as [slots * kv_heads, D]) that each (sequence, kv head, query head of
    the group) bag sums over, and the additive mask of the scores."""
    n = len(chunk.token_index)
    # int32 halves the index traffic whenever the cache is small enough to allow it.
    small = (int(chunk.block_ids.max()) + 1) * block_size * kv_heads < 2**31
    itype = torch.int32 if small else torch.long
    device = chunk.block_ids.device
    offsets = torch.arange(block_size, device=device, dtype=itype) * kv_heads
    slot_rows = (chunk.block_ids.to(itype).view(n, -1, 1) * (block_size * kv_heads) + offsets)
    slot_rows = slot_rows.view(n, 1, 1, -1)
    heads = torch.arange(kv_heads, device=device, dtype=itype).view(1, -1, 1, 1)
    # Bags in (sequence, kv head, query head) order: a sequence's rows of all heads are read
    # together, and the result is already [n, q_heads, D].
    rows = (slot_rows + heads).expand(-1, -1, group, -1)
    chunk.value_rows = rows.reshape(-1, rows.shape[-1])
    bias = torch.zeros(chunk.mask.shape, device=device)
    chunk.bias = bias.masked_fill_(~chunk.mask, float("-inf"))


def _plan_prefill(
    begin: int,
    end: int,
    context_len: int,
    block_table_row: torch.Tensor,
    block_size: int,
    window: int | None,
) -> PrefillChunk:
    """Block ids and mask of one multi-token query chunk."""
    q_len = end - begin
    first_key = 0 if window is None else max(0, context_len - q_len - window + 1)
    first_block = first_key // block_size
    last_block = (context_len + block_size - 1) // block_size
    ids = block_table_row[first_block:last_block].long()
    if window is None and q_len == context_len:
        return PrefillChunk(begin, end, ids, None)
    device = block_table_row.device
    key_pos = torch.arange(first_block * block_size, last_block * block_size, device=device)
    query_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    mask = _visible(key_pos[None, :], query_pos, window)
    return PrefillChunk(begin, end, ids, mask)


def build_step_plan(
    batch: PagedBatch,
    block_size: int,
    window: int | None,
    bytes_per_key: int,
    bag_heads: tuple[int, int] | None = None,
    native: bool = False,
) -> StepPlan:
    """Everything about a step that does not depend on the layer; ``native`` leaves the
    decodes to the compiled kernel."""
    context_lens, block_tables = batch.context_lens, batch.block_tables
    starts = batch.cu_seqlens_q.long()
    query_lens = starts[1:] - starts[:-1]
    decode_seqs = torch.nonzero(query_lens == 1).flatten()
    decodes, native_decodes = [], None
    short = torch.nonzero((query_lens > 1) & (query_lens <= NATIVE_SHORT_QUERY)).flatten() if native else []
    if len(short):
        native_decodes = _native_rows(decode_seqs, short, starts, query_lens, context_lens, block_tables)
    elif len(decode_seqs) and native:
        tables = (block_tables.int().contiguous(), context_lens.int().contiguous())
        native_decodes = NativeDecodes(tables, (decode_seqs, starts[decode_seqs].contiguous()))
    elif len(decode_seqs):
        decodes = _plan_decodes(
            decode_seqs, starts[decode_seqs], context_lens, block_tables,
            block_size, window, bytes_per_key, bag_heads,
        )
    prefills = []
    starts_list, ctx_list = starts.tolist(), context_lens.tolist()
    longer = query_lens > (NATIVE_SHORT_QUERY if native else 1)
    for s in torch.nonzero(longer).flatten().tolist():
        prefills.append(_plan_prefill(
            starts_list[s], starts_list[s + 1], ctx_list[s], block_tables[s], block_size, window,
        ))
    return StepPlan(decodes, prefills, native_decodes)


def _native_rows(
    decode_seqs: torch.Tensor, short: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor,
) -> NativeDecodes:
    """Decodes and short queries (speculative verification) as kernel items: a short query's
    rows are one item, its context read once for all of them (token j of a query of n sees
    context_len - (n - 1 - j) keys, which the kernel works out)."""
    seqs = torch.cat([decode_seqs, short])
    spans = query_lens[seqs].int().contiguous()
    firsts = starts[seqs].contiguous()
    n = query_lens[short]
    offset = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n).repeat_interleave(n)  # j within its query
    written = torch.cat([starts[decode_seqs], starts[short].repeat_interleave(n) + offset])
    tables = (block_tables.int().contiguous(), context_lens.int().contiguous())
    return NativeDecodes(tables, (seqs, firsts), spans, written)


def _gather(cache: torch.Tensor, ids: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Whole blocks of ``cache`` by id into ``buf``, viewed as [len(ids) * block, Hkv, D]."""
    torch.index_select(cache.view(cache.shape[0], -1), 0, ids, out=buf)
    return buf.view(-1, *cache.shape[2:])


def _softcapped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float) -> torch.Tensor:
    """SDPA's contract (q [B, Hq, L, D], k/v [B, Hkv, K, D], boolean mask broadcast to
    [B, Hq, L, K], None meaning causal with L == K) with scores soft-capped before the mask."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None, enable_gqa: bool) -> torch.Tensor:
    """SDPA, or its soft-capped equivalent; a mask of None means causal."""
    if softcap is not None:
        return _softcapped_sdpa(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=enable_gqa)


def _attend_decodes(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    chunk: DecodeChunk, scale: float, out: torch.Tensor, softcap: float | None = None,
) -> None:
    """One SDPA call for a chunk of decodes, GQA folded into the query-length dimension."""
    n, kv_heads, head_dim = len(chunk.token_index), key_cache.shape[2], key_cache.shape[3]
    rows = len(chunk.block_ids)
    k = _gather(key_cache, chunk.block_ids, gather_buffer("k", rows, key_cache))
    v = _gather(value_cache, chunk.block_ids, gather_buffer("v", rows, value_cache))
    k = k.view(n, -1, kv_heads, head_dim).transpose(1, 2)
    v = v.view(n, -1, kv_heads, head_dim).transpose(1, 2)
    q = query.index_select(0, chunk.token_index).view(n, kv_heads, -1, head_dim)
    o = _attention(q, k, v, chunk.mask, scale, softcap, enable_gqa=False)
    out.index_copy_(0, chunk.token_index, o.reshape(n, -1, head_dim).to(out.dtype))


def _attend_decodes_bag(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    chunk: DecodeChunk, scale: float, out: torch.Tensor, softcap: float | None = None,
) -> None:
    """Decodes with only K gathered: scores by bmm per KV head, then P @ V straight from the
    cache with ``embedding_bag`` (weighted row sums), which saves V's copy (~15% here)."""
    n, kv_heads, head_dim = len(chunk.token_index), key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // kv_heads
    rows = len(chunk.block_ids)
    k = _gather(key_cache, chunk.block_ids, gather_buffer("k", rows, key_cache))
    k = k.view(n, -1, kv_heads, head_dim)
    keys = k.shape[1]
    q = query.index_select(0, chunk.token_index).view(n, kv_heads, group, head_dim)
    # [kv_heads, n, group, keys]: each head's bmm writes one contiguous slab.
    scores = scratch("scores", kv_heads * n * group * keys, key_cache.dtype, key_cache.device)
    scores = scores.view(kv_heads, n, group, keys)
    for h in range(kv_heads):
        torch.bmm(q[:, h], k[:, :, h].transpose(1, 2), out=scores[h])
    scores.mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.add_(chunk.bias.view(1, n, 1, keys))
    probs = torch.softmax(scores, dim=-1).transpose(0, 1).reshape(-1, keys)
    o = F.embedding_bag(chunk.value_rows, value_cache.view(-1, head_dim), mode="sum",
                        per_sample_weights=probs)
    out.index_copy_(0, chunk.token_index, o.view(n, -1, head_dim).to(out.dtype))


def _attend_prefill(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    chunk: PrefillChunk, scale: float, out: torch.Tensor, softcap: float | None = None,
) -> None:
    """One SDPA call for one sequence's query chunk; SDPA's own GQA avoids repeating K/V."""
    rows = len(chunk.block_ids)
    k = _gather(key_cache, chunk.block_ids, gather_buffer("k", rows, key_cache))
    v = _gather(value_cache, chunk.block_ids, gather_buffer("v", rows, value_cache))
    q = query[chunk.begin:chunk.end].transpose(0, 1)[None]
    q_len = chunk.end - chunk.begin
    keys = q_len if chunk.mask is None else chunk.mask.shape[1]
    k, v = k[:keys].transpose(0, 1)[None], v[:keys].transpose(0, 1)[None]
    o = _attention(q, k, v, chunk.mask, scale, softcap, enable_gqa=True)
    out[chunk.begin:chunk.end] = o[0].transpose(0, 1)


def _bag_heads(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int] | None:
    """(kv_heads, group) when decodes should take the embedding-bag variant, else None.

    It needs a float32 CPU cache whose V is viewable as rows (what the engine uses on CPUs).
    Each query head sums V rows on its own, so with large groups (Qwen2.5-0.5B's 7) the extra
    row reads cancel the saved copy: those, and anything else, go through SDPA.
    """
    group = query.shape[1] // key_cache.shape[2]
    usable = (DECODE_WITH_EMBEDDING_BAG and group <= 4 and value_cache.device.type == "cpu"
              and key_cache.dtype == value_cache.dtype == torch.float32
              and value_cache.is_contiguous())
    return (key_cache.shape[2], group) if usable else None


def _native_decodes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether decodes take the compiled kernel (built on first use; see kernels.cpu_decode)."""
    return (NATIVE_DECODE and cpu_decode.usable(query, key_cache, value_cache)
            and cpu_decode.native_library() is not None)


def _step_plan(
    batch: PagedBatch, query: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, window: int | None, softcap: float | None = None,
) -> StepPlan:
    """The memoized plan for this step, window and decode variant, built on first use. A
    soft-capped layer never takes the compiled kernel, which has no soft-capping."""
    native = softcap is None and _native_decodes(query, key_cache, value_cache)
    bag_heads = None if native else _bag_heads(query, key_cache, value_cache)
    key = ("portcullis.kernels.torch_attention", window, key_cache.shape[1], bag_heads, native)
    cached = batch.plan.get(key)
    if cached is None:
        gathered = 1 if bag_heads else 2  # the bag variant gathers K only
        bytes_per_key = gathered * key_cache[0, 0].numel() * key_cache.element_size()
        cached = build_step_plan(batch, key_cache.shape[1], window, bytes_per_key, bag_heads,
                                 native)
        batch.plan[key] = cached
    return cached


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention with gathered K/V and SDPA; see the module docstring."""
    if out is None:
        out = torch.empty_like(query)
    step = _step_plan(batch, query, key_cache, value_cache, sliding_window, softcap)
    if step.native is not None:  # before the cast below: the kernel reads float32 queries
        cpu_decode.decode_attention(cpu_decode.native_library(), query, key_cache, value_cache,
                                    step.native.tables, step.native.decodes, scale,
                                    sliding_window, out, step.native.spans, step.native.written)
    if query.dtype != key_cache.dtype:  # a cache of another dtype than the model's: attend in the cache's
        query = query.to(key_cache.dtype)
    for chunk in step.decodes:
        attend = _attend_decodes if chunk.value_rows is None else _attend_decodes_bag
        attend(query, key_cache, value_cache, chunk, scale, out, softcap)
    for chunk in step.prefills:
        _attend_prefill(query, key_cache, value_cache, chunk, scale, out, softcap)
    return out
